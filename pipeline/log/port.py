"""The store port: what Turnstile needs from an event log, and the values a store returns.

Two adapters implement it: ``EventStore`` (PostgreSQL, the record) and ``InMemoryStore`` (a process's
memory: reruns and unit tests of logic). ``tests/support/store_contract.py`` holds the assertions both must
pass.

Besides the log itself the port holds two small sub-ports that the online stack needs and that only a store
can answer: ``RunnerLeases`` (a runner's lease, and the open episodes whose runner's lease lapsed) and
``EpisodeIndex`` (finding an episode by id or prefix, listing episodes with filters). Callers outside
``pipeline.log`` reach the log through these methods only, never through SQL.
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal, Protocol

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


@dataclass(frozen=True, slots=True)
class AbandonedEpisode:
    """An episode started and never finished whose runner is gone; ``version`` is its stream's version."""

    stream: str
    runner_id: str | None
    version: int


@dataclass(frozen=True)
class EpisodeFilter:
    """Which episodes ``EpisodeIndex.list_episodes`` returns; every field set must match."""

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
    """One episode as the log has it: its start, its finish (if any), its turn count and reward sum."""

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


class RunnerLeases(Protocol):
    """Runner leases, and the open episodes their lapsed leases left behind.

    A lease is a row per runner id: ``start_lease`` records it (a second start of the same id is refused),
    ``renew_lease`` moves its heartbeat to now, ``end_lease`` marks it stopped. ``abandoned_episodes`` lists,
    oldest first, the episodes started and not finished whose EpisodeStarted metadata names a runner under
    ``runner_key`` with no live lease (stopped, unknown, or no heartbeat within ``lease_timeout`` seconds),
    and those started without a runner whose last event is older than ``orphan_after`` seconds.
    """

    async def start_lease(self, runner_id: str, *, host: str, pid: int) -> None: ...

    async def renew_lease(self, runner_id: str) -> None: ...

    async def end_lease(self, runner_id: str) -> None: ...

    async def abandoned_episodes(
        self, *, runner_key: str, lease_timeout: float, orphan_after: float
    ) -> list[AbandonedEpisode]: ...


class EpisodeIndex(Protocol):
    """Episodes found in the log itself (its EpisodeStarted events), not in a read model.

    ``find_episode_ids(text, limit)``: ``[text]`` when an episode has exactly that id; otherwise the ids of at
    most ``limit`` episodes whose ids begin with ``text``, oldest first (``%`` and ``_`` are plain text).
    ``list_episodes(filters)``: at most ``filters.limit + 1`` episodes matching, newest first (one more than
    the limit, so that a caller can tell whether more matched).
    """

    async def find_episode_ids(self, text: str, limit: int) -> list[str]: ...

    async def list_episodes(self, filters: EpisodeFilter) -> list[EpisodeRow]: ...


class Store(RunnerLeases, EpisodeIndex, Protocol):
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
