"""Reruns: the agent runs again on a recorded episode's task, answered by the recording.

The agent runs on an ``EpisodeSession`` whose LLM client is ``RecordedLLM`` (it answers the agent's k-th
call with the recorded k-th turn, after checking the agent asked the same thing) and whose store is an
``InMemoryStore`` (nothing is written to the log). The first difference stops the agent and is reported
as a ``Divergence``: which turn, which field, and a unified diff. Calls are matched in order, so an agent
that makes concurrent calls whose replies were recorded in another order than it now asks diverges
(identical concurrent requests, such as OpenAI ``n`` > 1, are answered in recorded order)."""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal

from rich.text import Text

from pipeline.episodes import Agent, Episode, EpisodeSession, run_episode
from pipeline.errors import ConfigError, TurnstileError
from pipeline.log import EventStore, InMemoryStore
from pipeline.replay.lookup import load_episode
from pipeline.replay.transcript import short_number
from pipeline.runners import load_agent
from schemas import (
    ChatMessage,
    LLMRequest,
    LLMResponse,
    TurnCompleted,
    TurnRequest,
)

# Endings whose recording holds every turn the agent asked for: a rerun must make exactly those calls.
# (cancelled, timeout and aborted episodes were cut short from outside: their turns are a prefix.)
COMPLETE_ENDINGS: Final = frozenset({"done", "max_turns", "truncated", "error"})
# The last traceback line of an agent whose LLM call failed (the turnstile's or the OpenAI SDK's error).
# Logs keep the module path the error had when it was recorded: pipeline.llm before the subpackages.
LLM_FAILURE: Final = re.compile(r"^(pipeline\.(inference\.client|llm)\.\w+|openai\.\w*Error)\b")


@dataclass(frozen=True)
class Divergence:
    """Where a rerun first differed from the recording. ``turn`` is 1-based (None: the episode as a whole)."""

    turn: int | None
    field: Literal["messages", "tools", "sampling", "turns", "outcome", "reward"]
    summary: str
    diff: str = ""


class RerunDiverged(TurnstileError):
    """Raised into the agent at the first call that differs from the recording (it stops the rerun)."""

    def __init__(self, divergence: Divergence) -> None:
        self.divergence = divergence
        super().__init__(
            f"the rerun diverged at turn {divergence.turn} ({divergence.field}): {divergence.summary}"
        )


class RecordingEnded(TurnstileError):
    """Raised into the agent when it asks for a turn past an incomplete recording (cut short, or --until)."""


def ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _message_fields(message: ChatMessage) -> dict[str, Any]:
    """What the agent sent: role, content, name, tool calls, tool call id (not the reasoning)."""
    return {
        "role": message.role,
        "content": message.content,
        "name": message.name,
        "tool_calls": None
        if message.tool_calls is None
        else [call.model_dump(mode="json") for call in message.tool_calls],
        "tool_call_id": message.tool_call_id,
    }


def _message_lines(message: ChatMessage | None) -> list[str]:
    if message is None:
        return []
    lines = [f"role: {message.role}"]
    if message.name is not None:
        lines.append(f"name: {message.name}")
    if message.tool_call_id is not None:
        lines.append(f"tool_call_id: {message.tool_call_id}")
    if message.content is None:
        lines.append("content: null")
    else:
        lines.append("content:")
        lines += [f"  {line}" for line in message.content.split("\n")]
    if message.tool_calls is not None:
        lines.append("tool_calls:")
        lines += [f"  - {c.id} {c.function.name} {c.function.arguments}" for c in message.tool_calls]
    return lines


def _diff(recorded: list[str], rerun: list[str], recorded_name: str, rerun_name: str) -> str:
    return "\n".join(
        difflib.unified_diff(recorded, rerun, fromfile=recorded_name, tofile=rerun_name, lineterm="")
    )


def _json_lines(value: Any) -> list[str]:
    return json.dumps(value, indent=2, sort_keys=True).split("\n")


def compare_request(turn: int, recorded: TurnRequest, sent: LLMRequest) -> Divergence | None:
    """The first difference between what the agent sent for ``turn`` and what was recorded, or None."""
    if [_message_fields(m) for m in recorded.messages] != [_message_fields(m) for m in sent.messages]:
        index = next(
            i
            for i in range(max(len(recorded.messages), len(sent.messages)))
            if i >= len(recorded.messages)
            or i >= len(sent.messages)
            or _message_fields(recorded.messages[i]) != _message_fields(sent.messages[i])
        )
        before = recorded.messages[index] if index < len(recorded.messages) else None
        after = sent.messages[index] if index < len(sent.messages) else None
        role = (after or before or recorded.messages[-1]).role
        if len(recorded.messages) != len(sent.messages):
            summary = (
                f"the agent sent {len(sent.messages)} messages; {len(recorded.messages)} were recorded "
                f"(first difference: message {index + 1}, {role})"
            )
        else:
            summary = f"message {index + 1} of {len(sent.messages)} ({role}) differs"
        where = f"turn {turn}, message {index + 1}"
        diff = _diff(_message_lines(before), _message_lines(after), f"recorded {where}", f"rerun {where}")
        return Divergence(turn, "messages", summary, diff)
    recorded_tools = [tool.model_dump(mode="json") for tool in recorded.tools]
    sent_tools = [tool.model_dump(mode="json") for tool in sent.tools]
    if recorded_tools != sent_tools:
        names = ", ".join(t.function.name for t in sent.tools) or "none"
        recorded_names = ", ".join(t.function.name for t in recorded.tools) or "none"
        summary = f"tools differ (sent: {names}; recorded: {recorded_names})"
        diff = _diff(
            _json_lines(recorded_tools), _json_lines(sent_tools), f"recorded turn {turn} tools",
            f"rerun turn {turn} tools",
        )  # fmt: skip
        return Divergence(turn, "tools", summary, diff)
    recorded_sampling = recorded.sampling.model_dump(mode="json")
    sent_sampling = sent.sampling.model_dump(mode="json")
    if recorded_sampling != sent_sampling:
        changed = ", ".join(k for k in sent_sampling if sent_sampling[k] != recorded_sampling.get(k))
        diff = _diff(
            _json_lines(recorded_sampling), _json_lines(sent_sampling), f"recorded turn {turn} sampling",
            f"rerun turn {turn} sampling",
        )  # fmt: skip
        return Divergence(turn, "sampling", f"sampling differs ({changed})", diff)
    return None


class RecordedLLM:
    """An LLM client for dry runs: the agent's k-th call gets the recorded k-th turn's reply (its text, tool
    calls, tokens, logprobs, policy version and engine), once the request matches the recorded one.

    The first mismatch is kept in ``divergence`` and raised (``RerunDiverged``) at that call and every later
    one, so an agent that catches it cannot go on as if nothing happened. ``complete``: the recording holds
    every turn the agent asked for, so a call past it is a divergence; otherwise it raises
    ``RecordingEnded`` and sets ``ran_out``.
    """

    def __init__(self, turns: Sequence[TurnCompleted], *, complete: bool) -> None:
        self.turns = list(turns)
        self.complete = complete
        self.calls = 0
        self.divergence: Divergence | None = None
        self.ran_out = False

    async def __call__(self, request: LLMRequest) -> LLMResponse:
        if self.divergence is not None:
            raise RerunDiverged(self.divergence)
        index = self.calls
        if index >= len(self.turns):
            if not self.complete:
                self.ran_out = True
                raise RecordingEnded(f"the recording ends after {len(self.turns)} turns")
            self.divergence = Divergence(
                index + 1,
                "turns",
                f"the agent asked for a {ordinal(index + 1)} turn; {len(self.turns)} were recorded",
                "\n".join(f"+ {line}" for m in request.messages[-1:] for line in _message_lines(m)),
            )
            raise RerunDiverged(self.divergence)
        turn = self.turns[index]
        found = compare_request(index + 1, turn.request, request)
        if found is not None:
            self.divergence = found
            raise RerunDiverged(found)
        self.calls += 1
        return LLMResponse(
            request_id=request.request_id,
            text=turn.reply.text,
            tool_calls=turn.reply.tool_calls,
            finish_reason=turn.reply.finish_reason,
            prompt_token_ids=turn.prompt_token_ids,
            completion_token_ids=turn.completion_token_ids,
            completion_logprobs=turn.completion_logprobs,
            policy_version=turn.policy_version,
            consumer_id=turn.engine_id,
            timings=turn.timings,
            prefix_break=turn.prefix_break,
        )


@dataclass(frozen=True)
class RerunResult:
    episode_id: str
    agent: str
    recorded_turns: int
    replayed_turns: int
    divergence: Divergence | None = None
    note: str = ""
    termination: str | None = None

    @property
    def identical(self) -> bool:
        return self.divergence is None

    def to_json(self) -> dict[str, Any]:
        divergence = self.divergence
        return {
            "episode_id": self.episode_id,
            "agent": self.agent,
            "identical": self.identical,
            "recorded_turns": self.recorded_turns,
            "replayed_turns": self.replayed_turns,
            "termination": self.termination,
            "note": self.note or None,
            "divergence": None
            if divergence is None
            else {
                "turn": divergence.turn,
                "field": divergence.field,
                "summary": divergence.summary,
                "diff": divergence.diff,
            },
        }


def _last_line(text: str | None) -> str:
    lines = [line for line in (text or "").strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


def _agent_rewards(episode: Episode) -> list[tuple[int | None, float]]:
    """Rewards the agent returned, as (turn number or None for the episode, value)."""
    number = {turn.turn_id: index + 1 for index, turn in enumerate(episode.turns)}
    return [
        (None if reward.turn_id is None else number.get(reward.turn_id), reward.value)
        for reward in episode.rewards
        if reward.source == "agent"
    ]


def _rewards_text(rewards: list[tuple[int | None, float]]) -> str:
    shown = [f"{short_number(v)} ({'episode' if t is None else f'turn {t}'})" for t, v in rewards]
    return ", ".join(shown) or "none"


async def rerun_episode(
    episode: Episode,
    agent: Agent,
    *,
    agent_name: str,
    timeout: float | None = None,  # noqa: ASYNC109 - the rerun episode's own limit (run_episode's)
) -> RerunResult:
    """Run ``agent`` on the recorded episode's task with the recorded replies; nothing is written to the log.

    Identical means: the same calls (messages, tools, sampling) in the same order and number, and, for a
    recording that ended by itself, the same ending and the same rewards returned by the agent.
    """
    started, recorded = episode.started, episode.turns
    ending = episode.finished.termination if episode.finished is not None else None
    recorded_error = _last_line(episode.finished.error if episode.finished is not None else None)
    # An episode that ended in error because an LLM call failed holds no turn for that call.
    llm_failed = ending == "error" and bool(LLM_FAILURE.match(recorded_error))
    client = RecordedLLM(recorded, complete=ending in COMPLETE_ENDINGS and not llm_failed)
    session = EpisodeSession.like(
        started,
        InMemoryStore(),  # a dry run: nothing reaches the log
        client,
        max_turns=len(recorded) if ending == "max_turns" else None,
    )
    outcome = await run_episode(agent, session, timeout=timeout)

    def result(divergence: Divergence | None = None, note: str = "") -> RerunResult:
        return RerunResult(
            episode.episode_id, agent_name, len(recorded), client.calls, divergence, note, outcome.termination
        )

    if client.divergence is not None:
        return result(client.divergence)
    if client.calls < len(recorded):
        how = outcome.termination + (f": {_last_line(outcome.error)}" if outcome.error else "")
        return result(
            Divergence(
                client.calls + 1,
                "turns",
                f"the agent stopped after {client.calls} turn{'' if client.calls == 1 else 's'}; "
                f"{len(recorded)} were recorded (the rerun ended {how})",
                (outcome.error or "").rstrip(),
            )
        )
    if client.ran_out or not client.complete:
        why = "unfinished" if ending is None else f"ended {ending}"
        if llm_failed:
            why += f": {recorded_error}"
        stopped = "; the agent was stopped when it asked for more" if client.ran_out else ""
        turns = f"{len(recorded)} turn{'' if len(recorded) == 1 else 's'}"
        return result(note=f"the recording ends after {turns} ({why}){stopped}")
    rerun_error = _last_line(outcome.error)
    if outcome.termination != ending or recorded_error != rerun_error:
        summary = f"the recorded episode ended {ending}; the rerun ended {outcome.termination}"
        if recorded_error != rerun_error:
            summary += f" ({rerun_error or 'no error'} instead of {recorded_error or 'no error'})"
        return result(Divergence(None, "outcome", summary, (outcome.error or "").rstrip()))
    rerun_rewards = _agent_rewards(session.episode())
    if _agent_rewards(episode) != rerun_rewards:
        return result(
            Divergence(
                None,
                "reward",
                f"the agent returned reward {_rewards_text(rerun_rewards)}; "
                f"{_rewards_text(_agent_rewards(episode))} was recorded",
            )
        )
    return result()


def render_rerun(result: RerunResult, *, diff: bool = True) -> Text:
    """One line per episode (identical / diverged at turn N (field): summary), then the diff."""
    if result.divergence is None:
        text = Text.assemble(("identical", "bold green"), f"  {result.episode_id}  ")
        text.append(f"{result.replayed_turns} of {result.recorded_turns} recorded turns replayed, ")
        text.append(f"agent {result.agent}")
        if result.note:
            text.append(f"; {result.note}", style="dim")
        return text
    divergence = result.divergence
    where = "the episode's end" if divergence.turn is None else f"turn {divergence.turn}"
    text = Text.assemble(
        ("diverged", "bold red"), f"  {result.episode_id}  at {where} ({divergence.field}): "
    )
    text.append(divergence.summary)
    if diff and divergence.diff:
        for line in divergence.diff.split("\n"):
            style = (
                "bold" if line.startswith(("---", "+++")) else
                "red" if line.startswith("-") else
                "green" if line.startswith("+") else
                "cyan" if line.startswith("@@") else ""
            )  # fmt: skip
            text.append("\n    ")
            text.append(line, style=style)
    return text


@dataclass
class RerunSummary:
    results: list[RerunResult] = field(default_factory=list)
    errors: list[tuple[str, str]] = field(default_factory=list)

    @property
    def diverged(self) -> int:
        return sum(not result.identical for result in self.results)

    def line(self) -> str:
        identical = len(self.results) - self.diverged
        total = len(self.results) + len(self.errors)
        failed = f", {len(self.errors)} could not be rerun" if self.errors else ""
        return (
            f"{total} episode{'' if total == 1 else 's'} rerun: {identical} identical, "
            f"{self.diverged} diverged{failed}"
        )


def names_agent_code(agent: str) -> bool:
    """Whether an episode's recorded ``agent`` names code a rerun can load (``package.module:Name``, what a
    runner records). A gateway session records the name its client gave (``gateway`` unless told): the
    agent ran outside Turnstile (a CLI, another machine), so there is nothing to rerun."""
    module, _, attribute = agent.partition(":")
    return bool(module and attribute)


async def rerun_by_id(
    store: EventStore,
    episode_id: str,
    *,
    agent: str | None = None,
    until: int | None = None,
    timeout: float | None = None,  # noqa: ASYNC109 - passed on to rerun_episode
    agents: dict[str, Agent] | None = None,
) -> RerunResult:
    """Rerun one recorded episode (its turns up to ``until``) with ``agent``, or the agent it recorded.

    ``agents`` caches loaded agents by spec across calls (one instance per spec, as a runner has).
    """
    replayed = await load_episode(store, episode_id, until=until)
    spec = agent or replayed.episode.started.agent
    if not agent and spec and not names_agent_code(spec):
        raise ConfigError(
            f"episode {episode_id} was recorded through the gateway by {spec!r}, an agent that ran outside "
            "Turnstile: there is no code of it to rerun; name one with --agent package.module:Name"
        )
    if not spec:
        raise ConfigError(f"episode {episode_id} records no agent; name the one to rerun with --agent")
    agents = {} if agents is None else agents
    if spec not in agents:
        agents[spec] = load_agent(spec)
    return await rerun_episode(replayed.episode, agents[spec], agent_name=spec, timeout=timeout)


async def rerun_all(
    store: EventStore,
    episode_ids: Sequence[str],
    *,
    agent: str | None = None,
    timeout: float | None = None,  # noqa: ASYNC109 - passed on to rerun_episode
    each: Callable[[str, RerunResult | TurnstileError], object] | None = None,
) -> RerunSummary:
    """Rerun every episode of ``episode_ids`` in turn (one agent instance per spec, as a runner has); an
    episode that cannot be rerun is counted with its error and the others go on. ``each(id, outcome)``
    sees every result or error as it comes."""
    summary = RerunSummary()
    agents = {agent: load_agent(agent)} if agent else {}
    for episode_id in episode_ids:
        try:
            result = await rerun_by_id(store, episode_id, agent=agent, timeout=timeout, agents=agents)
        except TurnstileError as error:
            summary.errors.append((episode_id, str(error)))
            if each is not None:
                each(episode_id, error)
            continue
        summary.results.append(result)
        if each is not None:
            each(episode_id, result)
    return summary
