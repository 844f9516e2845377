"""``InMemoryStore``: the store port in a process's memory, for reruns and for unit tests of logic.

It accepts and refuses exactly what ``EventStore`` does (the same validation, encoding and append plan,
``pipeline.log.appends``), keeps events encoded as PostgreSQL would (JSON data + packed token arrays) and
decodes them on read, so a reader gets the same events from either adapter. Runner leases and the
episode index answer what ``pipeline.log.episode_queries`` answers in SQL. Nothing is durable.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections import defaultdict
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Final
from uuid import UUID

from pipeline.errors import InvalidEvent, TurnstileError
from pipeline.log.appends import RecordedId, plan_appends, prepare_append, recorded_event
from pipeline.log.port import AbandonedEpisode, AppendResult, EpisodeFilter, EpisodeRow, RecordedEvent
from schemas import Event

_NUL: Final = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")
"""A JSON escape of NUL (an odd number of backslashes before u0000; an escaped backslash is text)."""
_EPISODE: Final = "episode-"


@dataclass(frozen=True, slots=True)
class _Row:
    position: int
    stream: str
    version: int
    event_id: UUID
    type: str
    data: str
    tokens: bytes | None
    metadata: str
    recorded_at: datetime


@dataclass(slots=True)
class _Lease:
    host: str
    pid: int
    heartbeat_at: datetime = field(default_factory=lambda: datetime.now(UTC))
    stopped_at: datetime | None = None


class InMemoryStore:
    """Append, read and tail a log held in memory. Safe for any number of appenders in one event loop:
    an append is planned and applied without an await in between, so appends are atomic and in order."""

    def __init__(self, *, max_event_bytes: int = 16 * 1024 * 1024) -> None:
        self.max_event_bytes = max_event_bytes
        self._rows: list[_Row] = []
        self._recorded: dict[UUID, RecordedId] = {}
        self._versions: dict[str, int] = {}
        self._streams: defaultdict[str, list[_Row]] = defaultdict(list)
        self._appended = asyncio.Condition()
        self._closed = False
        self._leases: dict[str, _Lease] = {}

    async def close(self) -> None:
        self._closed = True

    async def append(
        self,
        stream: str,
        events: Sequence[Event | Mapping[str, Any]],
        expected_version: int | None = None,
        *,
        metadata: Mapping[str, Any] | None = None,
    ) -> AppendResult:
        if self._closed:
            raise TurnstileError("the event store is closed")
        pending = prepare_append(stream, events, expected_version, metadata, self.max_event_bytes)
        if any(_NUL.search(item.data) for item in pending.events):
            # jsonb cannot hold NUL: PostgreSQL refuses such an append, so this store does too.
            raise InvalidEvent(
                f"the append to {stream!r} was refused: its JSON holds a NUL character (\\u0000), which "
                "PostgreSQL's jsonb cannot store; remove or replace it"
            )
        plan = plan_appends([pending], self._recorded, self._versions, len(self._rows))
        (outcome,) = plan.outcomes
        if isinstance(outcome, TurnstileError):
            raise outcome
        now = datetime.now(UTC)
        for position, stream_, version, event_id, type_, data, tokens, metadata_json, digest in plan.rows:
            row = _Row(position, stream_, version, event_id, type_, data, tokens, metadata_json, now)
            self._rows.append(row)
            self._streams[stream_].append(row)
            self._recorded[event_id] = RecordedId(stream_, position, version, digest)
            self._versions[stream_] = version
        if plan.rows:
            async with self._appended:
                self._appended.notify_all()
        return outcome

    async def read_stream(self, stream: str, after_version: int = 0) -> list[RecordedEvent]:
        return [_decode(row) for row in self._streams.get(stream, [])[after_version:]]

    async def read_all(self, after: int = 0, limit: int = 1000) -> list[RecordedEvent]:
        """Up to ``limit`` events with position > ``after`` (positions are 1, 2, ... so the list index is
        position - 1)."""
        return [_decode(row) for row in self._rows[max(after, 0) : max(after, 0) + limit]]

    async def stream_version(self, stream: str) -> int:
        return self._versions.get(stream, 0)

    async def head(self) -> int:
        return len(self._rows)

    # -- runner leases and the episode index (the same answers as pipeline.log.episode_queries) --

    async def start_lease(self, runner_id: str, *, host: str, pid: int) -> None:
        if runner_id in self._leases:
            raise TurnstileError(f"runner {runner_id!r} holds a lease already")
        self._leases[runner_id] = _Lease(host, pid)

    async def renew_lease(self, runner_id: str) -> None:
        if (lease := self._leases.get(runner_id)) is not None:
            lease.heartbeat_at = datetime.now(UTC)

    async def end_lease(self, runner_id: str) -> None:
        if (lease := self._leases.get(runner_id)) is not None:
            lease.stopped_at = datetime.now(UTC)

    async def abandoned_episodes(
        self, *, runner_key: str, lease_timeout: float, orphan_after: float
    ) -> list[AbandonedEpisode]:
        now = datetime.now(UTC)
        abandoned = []
        for started in self._started():
            rows = self._streams[started.stream]
            if any(row.type == "EpisodeFinished" for row in rows):
                continue
            metadata = json.loads(started.metadata)
            if runner_key in metadata:
                value = metadata[runner_key]
                runner_id = None if value is None else _as_text(value)
                lease = None if runner_id is None else self._leases.get(runner_id)
                live = (
                    lease is not None
                    and lease.stopped_at is None
                    and lease.heartbeat_at > now - timedelta(seconds=lease_timeout)
                )
                if live:
                    continue
            else:
                runner_id = None
                if max(row.recorded_at for row in rows) >= now - timedelta(seconds=orphan_after):
                    continue
            abandoned.append(AbandonedEpisode(started.stream, runner_id, rows[-1].version))
        return abandoned

    async def find_episode_ids(self, text: str, limit: int) -> list[str]:
        started = [row.stream.removeprefix(_EPISODE) for row in self._started()]
        if text in started:
            return [text]
        return [episode_id for episode_id in started if episode_id.startswith(text)][:limit]

    async def list_episodes(self, filters: EpisodeFilter) -> list[EpisodeRow]:
        listed: list[EpisodeRow] = []
        for started in reversed(self._started()):
            if len(listed) > filters.limit:
                break
            row = self._episode_row(started)
            data = json.loads(started.data)
            if (
                (filters.policy is not None and data.get("policy") != filters.policy)
                or (filters.agent is not None and data.get("agent") != filters.agent)
                or (filters.since is not None and row.started_at < filters.since)
                or (filters.status == "running" and row.finished_at is not None)
                or (filters.status == "finished" and row.finished_at is None)
                or (filters.termination is not None and row.termination != filters.termination)
                or not _within(row.reward, filters.min_reward, filters.max_reward)
            ):
                continue
            listed.append(row)
        return listed

    def _started(self) -> list[_Row]:
        """The EpisodeStarted rows of episode streams, in log order."""
        return [row for row in self._rows if row.type == "EpisodeStarted" and row.stream.startswith(_EPISODE)]

    def _episode_row(self, started: _Row) -> EpisodeRow:
        rows = self._streams[started.stream]
        data = json.loads(started.data)
        finished = next((row for row in rows if row.type == "EpisodeFinished"), None)
        rewards = [float(json.loads(row.data)["value"]) for row in rows if row.type == "RewardAssigned"]
        return EpisodeRow(
            episode_id=_as_text(data.get("episode_id")),
            policy=_as_text(data.get("policy")),
            agent=_as_text(data.get("agent")),
            task_id=_as_text(data.get("task_id")),
            started_at=started.recorded_at,
            finished_at=None if finished is None else finished.recorded_at,
            termination=None if finished is None else _as_text(json.loads(finished.data).get("termination")),
            turns=sum(row.type == "TurnCompleted" for row in rows),
            reward=sum(rewards) if rewards else None,
        )

    async def tail(
        self, after: int = 0, *, batch_size: int = 500, poll_interval: float = 5.0
    ) -> AsyncIterator[RecordedEvent]:
        """Every event with position > ``after``, in order, exactly once; then waits for more."""
        position = after
        while True:
            batch = await self.read_all(position, batch_size)
            for recorded in batch:
                position = recorded.position
                yield recorded
            if batch:
                continue
            async with self._appended:
                while len(self._rows) <= position:
                    await self._appended.wait()


def _within(reward: float | None, low: float | None, high: float | None) -> bool:
    """As SQL compares: no reward is outside every bound (NULL >= x is not true)."""
    if low is None and high is None:
        return True
    return reward is not None and (low is None or reward >= low) and (high is None or reward <= high)


def _as_text(value: Any) -> str:
    """A JSON value as PostgreSQL's ``->>`` gives it: a string as itself, anything else as its JSON."""
    return value if isinstance(value, str) else json.dumps(value)


def _decode(row: _Row) -> RecordedEvent:
    return recorded_event(
        position=row.position,
        stream=row.stream,
        version=row.version,
        event_id=row.event_id,
        type_=row.type,
        data=json.loads(row.data),
        tokens=row.tokens,
        metadata=json.loads(row.metadata),
        recorded_at=row.recorded_at,
    )
