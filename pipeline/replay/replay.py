"""Replay: episodes read back from the log as transcripts, listed, folded as of a turn, and re-run.

Everything here reads the log (the ``events`` table), never the read models, so it works whether or not a
materializer ran. A transcript is the fold of an episode's events (``pipeline.episodes.session.fold_episode``),
optionally cut after turn N (time travel); per-turn rewards and discounted returns are computed on the
fly with ``pipeline.materialize.trajectory``, with the materializer's semantics (the episode's reward on its last turn).

A rerun runs the agent again on an ``EpisodeSession`` whose LLM client is ``RecordedLLM`` (it answers the
agent's k-th call with the recorded k-th turn, after checking the agent asked the same thing) and whose
store is a ``ScratchStore`` (nothing is written to the log). The first difference stops the agent and
is reported as a ``Divergence``: which turn, which field, and a unified diff. Calls are matched in
order, so an agent that makes concurrent calls whose replies were recorded in another order than it now
asks diverges (identical concurrent requests, such as OpenAI ``n`` > 1, are answered in recorded order).
"""

from __future__ import annotations

import datetime as dt
import difflib
import json
import math
import re
import statistics
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal, cast

import sqlalchemy as sa
from rich.console import Group, RenderableType
from rich.markup import escape
from rich.rule import Rule
from rich.style import Style
from rich.table import Table
from rich.text import Text

from pipeline.episodes import Agent, Episode, EpisodeSession, episode_stream, fold_episode, run_episode
from pipeline.errors import ConfigError, TurnstileError, WrongExpectedVersion
from pipeline.log.store import AppendResult, EventStore, RecordedEvent
from pipeline.log.tables import events as events_table
from pipeline.materialize.trajectory import Turn, discounted_rewards, parents
from pipeline.runners import load_agent
from schemas import (
    ChatMessage,
    EpisodeFinished,
    Event,
    LLMRequest,
    LLMResponse,
    TurnCompleted,
    TurnRequest,
)

EPISODE_ID_PATTERN: Final = re.compile(r"^[A-Za-z0-9._:-]{1,200}$")
MAX_CANDIDATES: Final = 10
# Endings whose recording holds every turn the agent asked for: a rerun must make exactly those calls.
# (cancelled, timeout and aborted episodes were cut short from outside: their turns are a prefix.)
COMPLETE_ENDINGS: Final = frozenset({"done", "max_turns", "truncated", "error"})
# The last traceback line of an agent whose LLM call failed (the turnstile's or the OpenAI SDK's error).
LLM_FAILURE: Final = re.compile(r"^(pipeline\.llm\.\w+|openai\.\w*Error)\b")


class EpisodeNotFound(TurnstileError):
    """No episode in the log has that id (or an id beginning with it)."""


class AmbiguousEpisodeId(TurnstileError):
    """Several episodes' ids begin with the given text."""

    def __init__(self, prefix: str, candidates: Sequence[str], more: bool) -> None:
        self.prefix, self.candidates = prefix, list(candidates)
        listed = "\n".join(f"  {candidate}" for candidate in candidates)
        super().__init__(
            f"episode id {prefix!r} is ambiguous: it begins {'more than ' if more else ''}"
            f"{len(candidates)} episode ids:\n{listed}{chr(10) + '  ...' if more else ''}\n"
            "give more of the id"
        )


# -- finding and folding episodes -----------------------------------------------------------------------


def _like_prefix(text: str) -> str:
    return re.sub(r"([\\%_])", r"\\\1", text) + "%"


async def resolve_episode_id(store: EventStore, text: str) -> str:
    """The id of the one episode whose id is ``text`` or begins with it (EpisodeStarted rows of the log)."""
    if not EPISODE_ID_PATTERN.match(text):
        raise ConfigError(
            f"{escape(repr(text))} is not an episode id: ids are letters, digits and . _ : - "
            "(list episodes with `turnstile episodes`)"
        )
    e = events_table
    exact = sa.select(e.c.stream).where(e.c.type == "EpisodeStarted", e.c.stream == episode_stream(text))
    # EpisodeStarted rows have a partial index (events_episode_started); the LIKE filters those rows only.
    by_prefix = (
        sa.select(e.c.stream)
        .where(e.c.type == "EpisodeStarted", e.c.stream.like(episode_stream(_like_prefix(text)), escape="\\"))
        .order_by(e.c.position)
        .limit(MAX_CANDIDATES + 1)
    )
    async with store.engine.connect() as connection:
        if await connection.scalar(exact) is not None:
            return text
        streams = list((await connection.scalars(by_prefix)).all())
    ids = [str(stream).removeprefix("episode-") for stream in streams]
    if not ids:
        raise EpisodeNotFound(
            f"no episode {text!r} in the log (no episode id is or begins with it); "
            "list episodes with `turnstile episodes`"
        )
    if len(ids) > 1:
        raise AmbiguousEpisodeId(text, ids[:MAX_CANDIDATES], more=len(ids) > MAX_CANDIDATES)
    return ids[0]


@dataclass(frozen=True)
class ReplayedEpisode:
    """An episode folded from the log, with the envelopes of its events; cut after turn ``until`` if set."""

    episode: Episode
    events: list[RecordedEvent]
    recorded_turns: int
    until: int | None = None

    @property
    def finished(self) -> EpisodeFinished | None:
        return self.episode.finished

    @property
    def status(self) -> str:
        if self.until is not None:
            return f"running as of turn {self.until} ({self.recorded_turns} recorded)"
        if self.finished is None:
            return "running"
        return f"finished: {self.finished.termination}"

    def recorded_at(self, event: Event) -> dt.datetime | None:
        for recorded in self.events:
            if recorded.event_id == event.event_id:
                return recorded.recorded_at
        return None


async def load_episode(store: EventStore, episode_id: str, *, until: int | None = None) -> ReplayedEpisode:
    """The fold of the episode's events, or of those up to and including its turn ``until`` (1-based)."""
    recorded = [r for r in await store.read_stream(episode_stream(episode_id)) if r.event is not None]
    if not recorded:
        raise EpisodeNotFound(f"no episode {episode_id!r} in the log")
    turn_rows = [i for i, r in enumerate(recorded) if isinstance(r.event, TurnCompleted)]
    if until is not None:
        if until < 1:
            raise ConfigError(f"--until counts turns from 1, got {until}")
        if until > len(turn_rows):
            raise ConfigError(
                f"--until {until}: episode {episode_id} has {len(turn_rows)} recorded "
                f"turn{'' if len(turn_rows) == 1 else 's'}"
            )
        recorded = recorded[: turn_rows[until - 1] + 1]
    episode = fold_episode([cast(Event, r.event) for r in recorded])
    return ReplayedEpisode(episode, recorded, recorded_turns=len(turn_rows), until=until)


@dataclass(frozen=True)
class TurnValues:
    """Per turn (in order): its own reward and its discounted return (None when the tokens do not allow)."""

    rewards: list[float]
    returns: list[float] | None


def turn_values(episode: Episode, discount: float) -> TurnValues:
    """Each turn's reward (an episode reward goes to its last turn, as in the materializer) and its
    discounted return over the token-prefix tree of ``pipeline.materialize.trajectory``."""
    own = {turn.turn_id: 0.0 for turn in episode.turns}
    for reward in episode.rewards:
        target = reward.turn_id
        if target is None and episode.turns:
            target = episode.turns[-1].turn_id
        if target in own:
            own[target] += reward.value
    rewards = [own[turn.turn_id] for turn in episode.turns]
    try:
        turns = [
            Turn.from_event(turn, episode_id=episode.episode_id, index=index, reward=own[turn.turn_id])
            for index, turn in enumerate(episode.turns)
        ]
    except ValueError:  # a turn whose logprobs do not match its tokens; the materializer refuses it too
        return TurnValues(rewards, None)
    values = discounted_rewards(turns, parents(turns), discount)
    return TurnValues(rewards, [values[turn.turn_id] for turn in turns])


def mean_logprob(turn: TurnCompleted) -> float | None:
    return statistics.fmean(turn.completion_logprobs) if turn.completion_logprobs else None


def episode_json(replayed: ReplayedEpisode, discount: float) -> dict[str, Any]:
    """The whole folded episode as JSON: every event's fields, plus per-turn reward, return and times."""
    episode = replayed.episode
    values = turn_values(episode, discount)
    turns = []
    for index, turn in enumerate(episode.turns):
        recorded_at = replayed.recorded_at(turn)
        turns.append(
            {
                "index": index + 1,
                **turn.model_dump(mode="json"),
                "reward": values.rewards[index],
                "discounted_return": None if values.returns is None else values.returns[index],
                "mean_logprob": mean_logprob(turn),
                "recorded_at": recorded_at.isoformat() if recorded_at else None,
            }
        )
    started_at = replayed.recorded_at(episode.started)
    return {
        "episode_id": episode.episode_id,
        "status": "running" if episode.finished is None else "finished",
        "until": replayed.until,
        "recorded_turns": replayed.recorded_turns,
        "discount": discount,
        "started_at": started_at.isoformat() if started_at else None,
        "started": episode.started.model_dump(mode="json"),
        "turns": turns,
        "rewards": [reward.model_dump(mode="json") for reward in episode.rewards],
        "total_reward": episode.total_reward if episode.rewards else None,
        "finished": None if episode.finished is None else episode.finished.model_dump(mode="json"),
    }


# -- the transcript -------------------------------------------------------------------------------------

SEPARATOR: Final = " · "
ROLE_STYLES: Final = {"system": "dim", "user": "bold cyan", "assistant": "bold green", "tool": "magenta"}


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() and abs(value) < 1e15 else f"{value:.4g}"


def _indented(text: str) -> str:
    return text.replace("\n", "\n    ")


def _message_text(message: ChatMessage, *, label: str | None = None) -> Text:
    role = label or message.role
    if message.role == "tool":
        role = f"tool {message.name or ''}".rstrip() + (
            f" ({message.tool_call_id})" if message.tool_call_id else ""
        )
    text = Text.assemble((f"{role}:", ROLE_STYLES.get(message.role, "")))
    if message.content or not message.tool_calls:
        text.append(" " + _indented(message.content or ""))
    for call in message.tool_calls or []:
        text.append("\n  ↳ tool call ", style="yellow")
        text.append(f"{call.function.name} {call.function.arguments}", style="yellow")
        text.append(f" (id {call.id})", style="dim")
    return text


def probability_style(logprob: float) -> Style:
    """Green for likely tokens through yellow to red for unlikely ones (by probability)."""
    p = min(1.0, max(0.0, math.exp(logprob)))
    red = round(255 * min(1.0, 2 * (1 - p)))
    green = round(200 * min(1.0, 2 * p))
    return Style(color="black", bgcolor=f"rgb({red},{green},0)")


def token_text(token_ids: Sequence[int], logprobs: Sequence[float], tokenizer: Any | None = None) -> Text:
    """Completion tokens shaded by logprob: ids separated by spaces, or, with a tokenizer, decoded texts."""
    text = Text()
    for position, (token_id, logprob) in enumerate(zip(token_ids, logprobs, strict=False)):
        if tokenizer is None:
            if position:
                text.append(" ")
            text.append(str(token_id), style=probability_style(logprob))
        else:
            piece = str(tokenizer.decode([token_id])).replace("\n", "\\n").replace("\t", "\\t")
            text.append(piece or "∅", style=probability_style(logprob))
    return text


def load_tokenizer(directory: Path) -> Any:
    """A local Hugging Face tokenizer (e.g. from ``turnstile model init-tiny``), for ``--tokens --model``."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ConfigError(
            "--model needs the transformers package: pip install 'turnstile-rl[torch]'"
        ) from None
    if not directory.is_dir():
        raise ConfigError(f"--model {str(directory)!r} is not a directory")
    try:
        return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except (OSError, ValueError) as error:
        raise ConfigError(
            f"--model {str(directory)!r}: no tokenizer could be loaded there ({error})"
        ) from None


def _new_messages(turn: TurnCompleted, by_id: Mapping[uuid.UUID, TurnCompleted]) -> list[ChatMessage]:
    """The messages this turn added to its parent's conversation and reply (all of them for a root)."""
    parent = by_id.get(turn.parent_turn_id) if turn.parent_turn_id else None
    if parent is None:
        return list(turn.request.messages)
    return list(turn.request.messages[len(parent.request.messages) + 1 :])


def _time(moment: dt.datetime | None) -> str:
    return moment.astimezone().strftime("%Y-%m-%d %H:%M:%S") if moment else "?"


def render_transcript(
    replayed: ReplayedEpisode, *, discount: float = 1.0, tokens: bool = False, tokenizer: Any | None = None
) -> RenderableType:
    """A readable transcript: the episode's header, then each turn's new messages, reply and numbers."""
    episode = replayed.episode
    started = episode.started
    values = turn_values(episode, discount)
    parts: list[RenderableType] = []
    parts.append(Text.assemble(("Episode ", "bold"), (episode.episode_id, "bold")))
    about = [f"task {started.task_id or '-'}", f"agent {started.agent or '-'}", f"policy {started.policy}"]
    if started.group_id:
        about.append(f"group {started.group_id} ({started.group_size})")
    if started.retry_of:
        about.append(f"retry of {started.retry_of}")
    sampling = started.sampling.model_dump(exclude_defaults=True)
    if sampling:
        about.append(f"sampling {json.dumps(sampling)}")
    if started.tags:
        about.append(f"tags {json.dumps(started.tags)}")
    parts.append(Text(SEPARATOR.join(about)))
    status = [f"started {_time(replayed.recorded_at(started))}", replayed.status]
    duration = episode.finished.metrics.get("duration_s") if episode.finished is not None else None
    if duration is not None:
        status[-1] += f" after {duration:.2f} s"
    status.append(f"{len(episode.turns)} turn{'' if len(episode.turns) == 1 else 's'}")
    if episode.rewards:
        sources = ", ".join(sorted({reward.source for reward in episode.rewards}))
        status.append(f"reward {_number(episode.total_reward)} ({sources})")
    parts.append(Text(SEPARATOR.join(status)))
    by_id = {turn.turn_id: turn for turn in episode.turns}
    index_of = {turn.turn_id: index + 1 for index, turn in enumerate(episode.turns)}
    shown_tools: list[Any] = []
    for index, turn in enumerate(episode.turns):
        title = [f"Turn {index + 1} of {replayed.recorded_turns}", str(turn.turn_id)[:8]]
        parent_index = index_of.get(turn.parent_turn_id) if turn.parent_turn_id else None
        if parent_index is not None:
            title.append(f"continues turn {parent_index}")
        if turn.prefix_break:
            title.append("prefix break")
        parts.append(Rule(SEPARATOR.join(title), align="left"))
        for message in _new_messages(turn, by_id):
            parts.append(_message_text(message))
        if turn.request.tools != shown_tools:
            names = ", ".join(tool.function.name for tool in turn.request.tools) or "none"
            parts.append(Text(f"tools: {names}", style="dim"))
            shown_tools = list(turn.request.tools)
        reply = ChatMessage(
            role="assistant", content=turn.reply.text, tool_calls=turn.reply.tool_calls or None
        )
        parts.append(_message_text(reply, label="reply"))
        if tokens:
            parts.append(Text("completion tokens: ", style="dim") + token_text(
                turn.completion_token_ids, turn.completion_logprobs, tokenizer
            ))  # fmt: skip
        mean = mean_logprob(turn)
        returned = "?" if values.returns is None else _number(round(values.returns[index], 6))
        timings = turn.timings
        numbers = [
            f"finish {turn.reply.finish_reason}",
            f"tokens {len(turn.prompt_token_ids)} prompt + {len(turn.completion_token_ids)} completion",
            f"mean logprob {'-' if mean is None else f'{mean:.3f}'}",
            f"reward {_number(values.rewards[index])}",
            f"return {returned}",
        ]
        engine = [
            f"policy v{turn.policy_version}",
            f"consumer {turn.engine_id}",
            f"{timings.total_ms:.1f} ms (queued {timings.queued_ms:.1f}, "
            f"first token {timings.first_token_ms:.1f})",
        ]
        parts.append(Text(SEPARATOR.join(numbers), style="dim"))
        parts.append(Text(SEPARATOR.join(engine), style="dim"))
    if tokens:
        legend = Text("shading: probability 1 ", style="dim")
        for probability in (1.0, 0.75, 0.5, 0.25, 0.0):
            legend.append("  ", style=probability_style(math.log(probability) if probability else -100.0))
        parts.append(legend + Text(" 0", style="dim"))
    if episode.finished is not None and episode.finished.error:
        parts.append(Rule("error", align="left", style="red"))
        parts.append(Text(episode.finished.error.rstrip(), style="red"))
    return Group(*parts)


# -- listing episodes -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class EpisodeFilter:
    policy: str | None = None
    status: Literal["running", "finished"] | None = None
    termination: str | None = None
    agent: str | None = None
    min_reward: float | None = None
    max_reward: float | None = None
    since: dt.datetime | None = None
    limit: int = 20


@dataclass(frozen=True)
class EpisodeRow:
    episode_id: str
    policy: str
    agent: str
    task_id: str
    started_at: dt.datetime
    finished_at: dt.datetime | None
    termination: str | None
    turns: int
    reward: float | None

    @property
    def status(self) -> str:
        return "running" if self.termination is None else self.termination

    @property
    def duration_s(self) -> float | None:
        return None if self.finished_at is None else (self.finished_at - self.started_at).total_seconds()


_SINCE = re.compile(r"^(\d+(?:\.\d+)?)\s*(s|m|h|d|w)$")
_UNITS: Final = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_since(text: str, now: dt.datetime | None = None) -> dt.datetime:
    """``30m``, ``1h``, ``2d``, ``1w`` ago, or an ISO date or time (local time unless it names a zone)."""
    now = now or dt.datetime.now(dt.UTC)
    relative = _SINCE.match(text.strip())
    if relative:
        return now - dt.timedelta(seconds=float(relative[1]) * _UNITS[relative[2]])
    try:
        moment = dt.datetime.fromisoformat(text.strip())
    except ValueError:
        raise ConfigError(
            f"--since {text!r}: give a duration ago (30m, 1h, 2d, 1w) or a date or time "
            "(2026-11-23, 2026-11-23T10:30)"
        ) from None
    return moment if moment.tzinfo else moment.astimezone()


def _listing_query(filters: EpisodeFilter) -> sa.Select[Any]:
    """Episodes from the log itself: EpisodeStarted rows, their EpisodeFinished, turn counts, reward sums."""
    e = events_table
    started, finished, other = e.alias("started"), e.alias("finished"), e.alias("other")
    turns = (
        sa.select(sa.func.count())
        .where(other.c.stream == started.c.stream, other.c.type == "TurnCompleted")
        .scalar_subquery()
    )
    reward_values = e.alias("reward")
    reward = (
        sa.select(sa.func.sum(reward_values.c.data["value"].as_float()))
        .where(reward_values.c.stream == started.c.stream, reward_values.c.type == "RewardAssigned")
        .scalar_subquery()
    )
    conditions: list[sa.ColumnElement[bool]] = [started.c.type == "EpisodeStarted"]
    if filters.policy is not None:
        conditions.append(started.c.data["policy"].as_string() == filters.policy)
    if filters.agent is not None:
        conditions.append(started.c.data["agent"].as_string() == filters.agent)
    if filters.since is not None:
        conditions.append(started.c.recorded_at >= filters.since)
    if filters.status == "running":
        conditions.append(finished.c.position.is_(None))
    elif filters.status == "finished":
        conditions.append(finished.c.position.is_not(None))
    if filters.termination is not None:
        conditions.append(finished.c.data["termination"].as_string() == filters.termination)
    listing = (
        sa.select(
            started.c.position,
            started.c.data["episode_id"].as_string().label("episode_id"),
            started.c.data["policy"].as_string().label("policy"),
            started.c.data["agent"].as_string().label("agent"),
            started.c.data["task_id"].as_string().label("task_id"),
            started.c.recorded_at.label("started_at"),
            finished.c.recorded_at.label("finished_at"),
            finished.c.data["termination"].as_string().label("termination"),
            turns.label("turns"),
            reward.label("reward"),
        )
        .select_from(
            started.outerjoin(
                finished, sa.and_(finished.c.stream == started.c.stream, finished.c.type == "EpisodeFinished")
            )
        )
        .where(*conditions)
        .subquery()
    )
    query = sa.select(listing)
    if filters.min_reward is not None:
        query = query.where(listing.c.reward >= filters.min_reward)
    if filters.max_reward is not None:
        query = query.where(listing.c.reward <= filters.max_reward)
    return query.order_by(listing.c.position.desc()).limit(filters.limit + 1)


async def list_episodes(store: EventStore, filters: EpisodeFilter) -> tuple[list[EpisodeRow], bool]:
    """Episodes matching ``filters``, newest first, and whether more than ``filters.limit`` matched."""
    async with store.engine.connect() as connection:
        rows = (await connection.execute(_listing_query(filters))).all()
    episodes = [
        EpisodeRow(
            episode_id=row.episode_id,
            policy=row.policy,
            agent=row.agent,
            task_id=row.task_id,
            started_at=row.started_at,
            finished_at=row.finished_at,
            termination=row.termination,
            turns=int(row.turns),
            reward=None if row.reward is None else float(row.reward),
        )
        for row in rows
    ]
    return episodes[: filters.limit], len(episodes) > filters.limit


def episodes_table(rows: Sequence[EpisodeRow]) -> Table:
    table = Table(show_header=True, header_style="bold")
    for name in ("episode", "started", "policy", "agent", "task", "status"):
        table.add_column(name, overflow="fold")
    for name in ("turns", "reward", "seconds"):
        table.add_column(name, justify="right")
    for row in rows:
        style = "" if row.termination in (None, "done") else "red" if row.termination == "error" else "yellow"
        table.add_row(
            row.episode_id,
            _time(row.started_at),
            row.policy,
            row.agent,
            row.task_id,
            Text(row.status, style=style),
            str(row.turns),
            "-" if row.reward is None else _number(round(row.reward, 6)),
            "-" if row.duration_s is None else f"{row.duration_s:.2f}",
        )
    return table


def episode_row_json(row: EpisodeRow) -> dict[str, Any]:
    return {
        "episode_id": row.episode_id,
        "policy": row.policy,
        "agent": row.agent,
        "task_id": row.task_id,
        "status": "running" if row.termination is None else "finished",
        "termination": row.termination,
        "turns": row.turns,
        "reward": row.reward,
        "started_at": row.started_at.isoformat(),
        "finished_at": row.finished_at.isoformat() if row.finished_at else None,
        "duration_s": row.duration_s,
    }


# -- reruns ---------------------------------------------------------------------------------------------


class ScratchStore:
    """An append-only list in memory, for dry runs that must not touch the log.

    It implements the one method an ``EpisodeSession`` calls, ``append``, with the same expected-version
    check as the event store; positions count the appends made here only.
    """

    def __init__(self) -> None:
        self.streams: dict[str, list[Event]] = {}
        self.position = 0

    async def append(
        self,
        stream: str,
        events: Sequence[Event],
        expected_version: int | None,
        *,
        metadata: Mapping[str, Any] | None = None,
    ) -> AppendResult:
        held = self.streams.setdefault(stream, [])
        if expected_version is not None and expected_version != len(held):
            raise WrongExpectedVersion(stream, expected_version, len(held))
        held.extend(events)
        first = self.position + 1
        self.position += len(events)
        return AppendResult(stream, tuple(range(first, self.position + 1)), len(held))


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
    shown = [f"{_number(v)} ({'episode' if t is None else f'turn {t}'})" for t, v in rewards]
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
    session = EpisodeSession(
        # EpisodeSession only appends to its store; the scratch store is a stand-in with that one method.
        cast(EventStore, ScratchStore()),
        client,
        policy=started.policy,
        task=started.task,
        task_id=started.task_id,
        agent=started.agent,
        episode_id=started.episode_id,
        group_id=started.group_id,
        group_size=started.group_size,
        sampling=started.sampling,
        tags=started.tags,
        retry_of=started.retry_of,
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
    if not spec:
        raise ConfigError(f"episode {episode_id} records no agent; name the one to rerun with --agent")
    agents = {} if agents is None else agents
    if spec not in agents:
        agents[spec] = load_agent(spec)
    return await rerun_episode(replayed.episode, agents[spec], agent_name=spec, timeout=timeout)
