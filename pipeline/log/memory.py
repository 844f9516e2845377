"""``InMemoryStore``: the store port in a process's memory, for reruns and for unit tests of logic.

It accepts and refuses exactly what ``EventStore`` does (the same validation, encoding and append plan,
``pipeline.log.appends``), keeps events encoded as PostgreSQL would (JSON data + packed token arrays) and
decodes them on read, so a reader gets the same events from either adapter. Nothing is durable.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections import defaultdict
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final
from uuid import UUID

from pipeline.errors import InvalidEvent, TurnstileError
from pipeline.log.appends import RecordedId, plan_appends, prepare_append, recorded_event
from pipeline.log.port import AppendResult, RecordedEvent
from schemas import Event

_NUL: Final = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")
"""A JSON escape of NUL (an odd number of backslashes before u0000; an escaped backslash is text)."""


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
