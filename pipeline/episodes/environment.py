"""Agents as environments (the ARES pattern, dm_env's ``TimeStep``).

The agent is the environment and the LLM is the policy that acts in it: ``await env.reset()`` starts the
episode and returns the agent's first LLM request as the observation; ``await env.step(response)``
answers it and returns the next request, or the last step with the episode's reward. Whoever steps the
environment supplies the replies (any engine, or a trainer's own sampler). The episode is recorded exactly
as a runner records it: the environment is an ``EpisodeSession`` whose LLM client is a queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
from typing import Any, NamedTuple

from pipeline.episodes.agent import Agent, RewardFunction, run_episode
from pipeline.episodes.fold import EpisodeOutcome
from pipeline.episodes.session import EpisodeSession
from pipeline.errors import TurnstileError
from pipeline.inference import PendingCall, QueueLLMClient
from pipeline.log import Store
from schemas import LLMRequest, LLMResponse, SamplingParams


class StepType(enum.IntEnum):
    FIRST = 0
    MID = 1
    LAST = 2


class TimeStep(NamedTuple):
    """dm_env's TimeStep: the observation is the agent's next LLM request (None at the last step)."""

    step_type: StepType
    reward: float | None
    discount: float | None
    observation: LLMRequest | None

    def first(self) -> bool:
        return self.step_type is StepType.FIRST

    def mid(self) -> bool:
        return self.step_type is StepType.MID

    def last(self) -> bool:
        return self.step_type is StepType.LAST


class AgentEnvironment:
    """``env = AgentEnvironment(agent, task, store=store, policy="main")``; ``ts = await env.reset()``;
    ``while not ts.last(): ts = await env.step(await engine(ts.observation))``; ``await env.close()``."""

    def __init__(
        self,
        agent: Agent,
        task: dict[str, Any],
        *,
        store: Store,
        policy: str,
        task_id: str = "",
        agent_name: str = "",
        group_id: str | None = None,
        group_size: int = 1,
        episode_id: str | None = None,
        sampling: SamplingParams | None = None,
        max_turns: int | None = None,
        timeout: float | None = None,
        reward_fn: RewardFunction | None = None,
        tags: dict[str, str] | None = None,
    ) -> None:
        self.agent = agent
        self.task = task
        self.store = store
        self.timeout = timeout
        self.reward_fn = reward_fn
        self._session_options: dict[str, Any] = {
            "policy": policy,
            "task": task,
            "task_id": task_id,
            "agent": agent_name or type(agent).__qualname__,
            "group_id": group_id,
            "group_size": group_size,
            "episode_id": episode_id,
            "sampling": sampling,
            "max_turns": max_turns,
            "tags": tags,
        }
        self.session: EpisodeSession | None = None
        self.outcome: EpisodeOutcome | None = None
        self._queue: QueueLLMClient | None = None
        self._episode: asyncio.Task[EpisodeOutcome] | None = None
        self._pending: PendingCall | None = None

    @property
    def episode_id(self) -> str | None:
        return self.session.episode_id if self.session else None

    async def reset(self) -> TimeStep:
        """Start a new episode (closing one still running as cancelled); the first step."""
        await self.close()
        self._queue = QueueLLMClient()
        self.session = EpisodeSession(self.store, self._queue, **self._session_options)
        self._episode = asyncio.create_task(
            run_episode(self.agent, self.session, reward_fn=self.reward_fn, timeout=self.timeout)
        )
        return await self._next(StepType.FIRST)

    async def step(self, response: LLMResponse) -> TimeStep:
        """Answer the pending request with ``response``; the next step."""
        if self._pending is None:
            raise TurnstileError("no LLM request is waiting: call reset() first (or after the last step)")
        if response.request_id != self._pending.request.request_id:
            raise TurnstileError(
                f"step() got the response to request {response.request_id}, but the pending request is "
                f"{self._pending.request.request_id}"
            )
        pending, self._pending = self._pending, None
        pending.reply(response)
        return await self._next(StepType.MID)

    async def close(self) -> None:
        """Cancel an episode in progress: it is recorded as finished ``cancelled``."""
        if self._episode is not None and not self._episode.done():
            self._episode.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._episode
        self._episode = None
        self._pending = None

    async def _next(self, step_type: StepType) -> TimeStep:
        assert self._queue is not None
        assert self._episode is not None
        call = asyncio.ensure_future(self._queue.next_call())
        done, _ = await asyncio.wait({call, self._episode}, return_when=asyncio.FIRST_COMPLETED)
        if call in done:
            self._pending = call.result()
            return TimeStep(
                step_type, None if step_type is StepType.FIRST else 0.0, 1.0, self._pending.request
            )
        call.cancel()
        self.outcome = self._episode.result()
        return TimeStep(StepType.LAST, self.outcome.reward or 0.0, 0.0, None)
