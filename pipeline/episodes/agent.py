"""The agent contract and the episode run loop.

Agents are ordinary objects with ``async def run(task: dict, llm) -> float | dict[str, float] | None``:
a float is the episode's reward, a dict maps turn ids to rewards, None leaves the reward to a reward
function ``reward(task, episode) -> float`` (when one is given). ``run_episode`` drives one agent through
one session and decides how the episode ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from pipeline.episodes.fold import Episode, EpisodeOutcome
from pipeline.episodes.refusals import MaxTurnsExceeded
from pipeline.episodes.session import EpisodeLLM, EpisodeSession
from schemas import RewardAssigned, Termination


@runtime_checkable
class Agent(Protocol):
    async def run(self, task: dict[str, Any], llm: EpisodeLLM) -> float | dict[str, float] | None: ...


AgentResult = float | int | dict[str, float] | None
RewardFunction = Callable[[dict[str, Any], Episode], float | Awaitable[float]]


@dataclass(frozen=True, slots=True)
class FunctionAgent:
    """An ``async def run(task, llm)`` function as an ``Agent``."""

    function: Callable[[dict[str, Any], EpisodeLLM], Awaitable[AgentResult]]

    async def run(self, task: dict[str, Any], llm: EpisodeLLM) -> AgentResult:
        return await self.function(task, llm)


async def run_episode(
    agent: Agent,
    session: EpisodeSession,
    *,
    reward_fn: RewardFunction | None = None,
    timeout: float | None = None,  # noqa: ASYNC109 - the episode's own limit, recorded as "timeout"
) -> EpisodeOutcome:
    """Run ``agent`` on the session's task from EpisodeStarted to EpisodeFinished.

    Termination: ``done``; ``max_turns`` (the agent hit the turn limit); ``truncated`` (its last reply was
    cut at max_tokens); ``timeout``; ``error`` (the agent raised: the traceback is recorded); ``cancelled``
    (this coroutine was cancelled, at any await: the episode is closed, then the cancellation goes on).
    """
    try:
        return await _run_episode(agent, session, reward_fn, timeout)
    except asyncio.CancelledError:
        # Wherever it came (starting, in the agent, recording rewards, finishing): close the episode. The
        # appends already under way land first, and a finish already under way wins (see finish()).
        with contextlib.suppress(Exception):
            await asyncio.shield(session.finish("cancelled"))
        raise


async def _run_episode(
    agent: Agent,
    session: EpisodeSession,
    reward_fn: RewardFunction | None,
    timeout: float | None,  # noqa: ASYNC109 - see run_episode
) -> EpisodeOutcome:
    await session.start()
    task = session.started.task
    termination: Termination
    error: str | None = None
    result: AgentResult = None
    try:
        result = await asyncio.wait_for(agent.run(task, session.llm), timeout)
        termination = "done"
        if session.max_turns_hit:
            termination = "max_turns"
        elif session.turns and session.turns[-1].finish_reason == "length":
            termination = "truncated"
    except MaxTurnsExceeded:
        termination = "max_turns"
    except TimeoutError:
        termination, error = "timeout", f"the episode ran past its timeout of {timeout} s"
    except Exception:
        termination, error = "error", traceback.format_exc()
    rewards: list[RewardAssigned] = []  # recorded with the finish, in one append
    if termination != "error" and termination != "timeout":
        try:
            await _score(session, result, reward_fn, rewards)
        except Exception:
            termination, error = "error", traceback.format_exc()
    await session.finish(termination, error=error, rewards=rewards)
    return EpisodeOutcome.of_events(session.events)


async def _score(
    session: EpisodeSession,
    result: AgentResult,
    reward_fn: RewardFunction | None,
    rewards: list[RewardAssigned],
) -> None:
    """The episode's rewards from the agent's result (or the reward function), onto ``rewards``; those
    made before one that fails stay there, to be recorded."""
    if isinstance(result, bool):
        raise TypeError(
            f"the agent returned {result!r}; return a float reward, a dict of turn rewards or None"
        )
    if isinstance(result, int | float):
        rewards.append(session.reward_event(float(result)))
    elif isinstance(result, dict):
        for turn_id, value in result.items():
            rewards.append(session.reward_event(float(value), turn_id))
    elif result is not None:
        raise TypeError(
            f"the agent returned {type(result).__name__}; return a float reward, a dict mapping turn ids "
            "to rewards, or None"
        )
    elif reward_fn is not None:
        scored = reward_fn(session.started.task, session.episode())
        value = await scored if inspect.isawaitable(scored) else scored
        rewards.append(session.reward_event(float(value), source="reward_fn"))
