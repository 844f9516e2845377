"""The store port: what Turnstile needs from an event log, and the values a store returns.

Two adapters implement it: ``EventStore`` (PostgreSQL, the record) and ``InMemoryStore`` (a process's
memory: reruns and unit tests of logic). ``tests/store_contract.py`` holds the assertions both must pass.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

from schemas import Event


@dataclass(frozen=True, slots=True)
class RecordedEvent:
    """The envelope of one event in the log.

    ``event`` is None for a type this reader does not know, and for a recorded event that does not parse
    (written by an older bug, or by hand): then ``problem`` says why. A reader skips such an event and goes
    on; it never stops on one (the materializer records it in ``skipped_events``).
    """

    position: int
    stream: str
    version: int
    event_id: uuid.UUID
    type: str
    event: Event | None
    metadata: dict[str, Any]
    recorded_at: datetime
    problem: str | None = None


@dataclass(frozen=True, slots=True)
class AppendResult:
    stream: str
    positions: tuple[int, ...]
    version: int
    """The stream's version after this append's last event (the version of that event)."""
    duplicate: bool = False
    """True when every event was recorded already (an idempotent retry); nothing new was written."""


class Store(Protocol):
    """An append-only log of events in streams named ``<category>-<id>``.

    ``append`` is atomic and idempotent by event id (a retry of recorded events returns their positions),
    guarded by ``expected_version`` (None: any; 0: the stream must be new; n: it must hold n events), and
    raises InvalidEvent, WrongExpectedVersion, DuplicateEventConflict or StoreUnavailable. Positions are
    global, gapless and in commit order; ``tail`` yields every event after a position exactly once, then
    waits for more.
    """

    async def append(
        self,
        stream: str,
        events: Sequence[Event | Mapping[str, Any]],
        expected_version: int | None = None,
        *,
        metadata: Mapping[str, Any] | None = None,
    ) -> AppendResult: ...

    async def read_stream(self, stream: str, after_version: int = 0) -> list[RecordedEvent]: ...

    async def read_all(self, after: int = 0, limit: int = 1000) -> list[RecordedEvent]: ...

    async def stream_version(self, stream: str) -> int: ...

    async def head(self) -> int: ...

    def tail(
        self, after: int = 0, *, batch_size: int = 500, poll_interval: float = 5.0
    ) -> AsyncIterator[RecordedEvent]: ...

    async def close(self) -> None: ...
