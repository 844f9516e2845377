"""The event store: Turnstile's append-only log of events in PostgreSQL (the only source of truth).

Ordering (invariant 4). Every append transaction first takes one transaction-scoped advisory lock
(``APPEND_LOCK``), then reads the head position, inserts its events at head+1, head+2, ... and commits,
which releases the lock (PostgreSQL makes a commit visible before it releases the transaction's locks).
So at most one transaction is ever between "positions assigned" and "committed": positions are gapless
and increase in commit order, and a tailer that has read up to position p can never later find a
committed event below p. "read position > p" therefore never skips an event that commits late, and a
rolled-back append leaves no hole to wait for. The database holds every writer to this (migration 0007: an
INSERT or COPY into ``events`` without the lock, or leaving a gap, is refused), and an append waits for
the lock at most ``lock_timeout`` seconds (then ``StoreUnavailable`` naming it).

Why the lock and not an xid8 horizon: a horizon lets appends run in parallel, but then the global
order is the order of transaction ids rather than commit order, readers need an (xid, position) cursor,
and any long transaction anywhere in the database holds every tailer back. The lock's cost is that
appends are serialized across processes; the group-commit writer below amortizes it (one lock, one
COPY and one fsync for a batch of hundreds of appends), and a lone append holds it for one round trip
(``write_in_one_round_trip``). bench/ingest.py measures what is left.

Idempotency (invariant 3). An append whose events are all recorded already, with the same content, is a
no-op that returns the recorded positions, whatever its expected version: that is what a retry after an
ambiguous commit looks like. The same event id with other content is refused.
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence, Set
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import Any, Final

import psycopg
import sqlalchemy as sa
import sqlalchemy.exc
import stamina
from psycopg import postgres, pq
from psycopg.adapt import Dumper
from sqlalchemy.ext.asyncio import AsyncEngine

from pipeline.errors import (
    ConfigError,
    InvalidEvent,
    StoreUnavailable,
    TurnstileError,
)
from pipeline.log import episode_queries
from pipeline.log.appends import PendingAppend, RecordedId, plan_appends, prepare_append, recorded_event
from pipeline.log.db import create_engine
from pipeline.log.json_text import JsonText as JsonText  # re-exported: COPY callers pair it with the dumper
from pipeline.log.port import AbandonedEpisode, AppendResult, EpisodeFilter, EpisodeRow, RecordedEvent
from pipeline.log.prepared import PreparedStatement
from pipeline.log.tables import events as events_table
from pipeline.settings import libpq_url
from schemas import Event

log = logging.getLogger(__name__)

APPEND_LOCK: Final = 0x7475726E73746C  # "turnstl": the one lock every append transaction holds
NOTIFY_CHANNEL: Final = "turnstile_events"
COPY_COLUMNS: Final = (
    "position",
    "stream",
    "version",
    "event_id",
    "type",
    "data",
    "tokens",
    "metadata",
    "content_hash",
)
COPY_TYPES: Final = ["int8", "text", "int4", "uuid", "text", "jsonb", "bytea", "jsonb", "bytea"]
ONE_ROUND_TRIP_MAX_EVENTS: Final = 32
"""The largest batch written in one round trip (``write_in_one_round_trip``) by default; a larger one is
COPYed. An INSERT from arrays costs PostgreSQL more per row than COPY, the round trips it saves are per
transaction: ``bench/ingest.py --copy-path`` finds where the two cross."""
APPEND_TYPES: Final = ("text", "int4", "uuid", "text", "text", "bytea", "text", "bytea")
"""The element types of ``append_events``'s array parameters: ``COPY_COLUMNS`` but the position (the rows'
order gives it), jsonb sent as text."""
APPEND_STATEMENT: Final = (
    "turnstile_append_events",
    [f"{name}[]" for name in APPEND_TYPES],
    f"SELECT append_events({', '.join(f'${n}' for n in range(1, len(APPEND_TYPES) + 1))})",
)
"""One append transaction in one statement (migration 0016): the append lock, the streams' versions checked,
then the rows at head + 1, head + 2, ... in the order given; returns the head before them. Each writer
prepares it on its connection (``PreparedStatement``) and sends its parameters as ``binary_arrays``."""


@dataclass(slots=True)
class WriterStats:
    appends: int = 0
    events: int = 0
    transactions: int = 0
    one_round_trip: int = 0
    """Batches sent in one round trip (``write_in_one_round_trip``), refused ones included."""
    rewritten: int = 0
    """Batches the database refused as written optimistically, written again with look-ups."""


# --- the store -----------------------------------------------------------------------------------


class EventStore:
    """Append, read and tail the log. Concurrent ``append`` calls are group-committed.

    Use ``await EventStore.connect(url)`` (or pass an engine you own) and ``await store.close()``.
    """

    def __init__(
        self,
        engine: AsyncEngine,
        *,
        max_event_bytes: int = 16 * 1024 * 1024,
        max_batch_events: int = 256,
        writers: int = 2,
        retry_for: float = 30.0,
        lock_timeout: float = 30.0,
        one_round_trip_max_events: int = ONE_ROUND_TRIP_MAX_EVENTS,
        owns_engine: bool = False,
    ) -> None:
        if lock_timeout <= 0:
            raise ConfigError(f"lock_timeout must be positive, got {lock_timeout}")
        self.engine = engine
        self.lock_timeout = lock_timeout  # how long an append waits for the append lock
        self.max_event_bytes = max_event_bytes
        self.max_batch_events = max_batch_events
        self.one_round_trip_max_events = one_round_trip_max_events  # 0: every batch COPYed (bench/ingest.py)
        self.writers = writers
        self.retry_for = retry_for
        self.stats = WriterStats()
        self._owns_engine = owns_engine
        self._queue: asyncio.Queue[PendingAppend | None] = asyncio.Queue()
        self._writer_tasks: list[asyncio.Task[None]] = []
        self._closed = False

    @classmethod
    async def connect(cls, url: str, **options: Any) -> EventStore:
        return cls(create_engine(url), owns_engine=True, **options)

    @property
    def libpq_url(self) -> str:
        return libpq_url(self.engine.url.render_as_string(hide_password=False))

    async def close(self) -> None:
        """Finish the appends already queued, then stop the writer (and dispose an engine we created)."""
        self._closed = True
        for _ in self._writer_tasks:
            await self._queue.put(None)  # each writer stops at the first None it takes
        await asyncio.gather(*self._writer_tasks)
        self._writer_tasks.clear()
        if self._owns_engine:
            await self.engine.dispose()

    # -- appending --

    async def append(
        self,
        stream: str,
        events: Sequence[Event | Mapping[str, Any]],
        expected_version: int | None = None,
        *,
        metadata: Mapping[str, Any] | None = None,
    ) -> AppendResult:
        """Append ``events`` to ``stream`` atomically and durably.

        ``expected_version``: None to skip the check, 0 for a stream that must not exist yet, n for a
        stream that must hold exactly n events. Raises InvalidEvent, WrongExpectedVersion,
        DuplicateEventConflict or StoreUnavailable; a failed append records nothing.
        """
        if self._closed:
            raise TurnstileError("the event store is closed")
        pending = prepare_append(stream, events, expected_version, metadata, self.max_event_bytes)
        pending.future = asyncio.get_running_loop().create_future()
        if not self._writer_tasks:
            self._writer_tasks = [
                asyncio.create_task(_Writer(self).run(), name=f"turnstile-group-commit-{n}")
                for n in range(self.writers)
            ]
        self._queue.put_nowait(pending)  # unbounded: never waits
        return await pending.future

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[AppendTransaction]:
        """One explicit append transaction, holding the append lock until it commits (or rolls back when
        the block raises). Appends from everywhere else wait meanwhile: keep it short."""
        async with self.engine.connect() as connection:
            raw = await connection.get_raw_connection()
            pg: psycopg.AsyncConnection[Any] = raw.driver_connection  # type: ignore[assignment]
            async with pg.transaction():
                # Taken here, not only in write_appends, so the lock covers the whole transaction.
                await take_append_lock(pg, self.lock_timeout)
                yield AppendTransaction(self, pg)

    # -- reading --

    async def read_stream(self, stream: str, after_version: int = 0) -> list[RecordedEvent]:
        query = (
            sa.select(events_table)
            .where(events_table.c.stream == stream, events_table.c.version > after_version)
            .order_by(events_table.c.version)
        )
        async with self.engine.connect() as connection:
            rows = (await connection.execute(query)).all()
        return [decode_row(row) for row in rows]

    async def read_all(self, after: int = 0, limit: int = 1000) -> list[RecordedEvent]:
        """Up to ``limit`` events with position > ``after``, in global (= commit) order."""
        query = (
            sa.select(events_table)
            .where(events_table.c.position > after)
            .order_by(events_table.c.position)
            .limit(limit)
        )
        async with self.engine.connect() as connection:
            rows = (await connection.execute(query)).all()
        return [decode_row(row) for row in rows]

    async def stream_version(self, stream: str) -> int:
        query = sa.select(sa.func.coalesce(sa.func.max(events_table.c.version), 0)).where(
            events_table.c.stream == stream
        )
        async with self.engine.connect() as connection:
            return int(await connection.scalar(query) or 0)

    async def head(self) -> int:
        """The position of the newest committed event (0 for an empty log)."""
        query = sa.select(sa.func.coalesce(sa.func.max(events_table.c.position), 0))
        async with self.engine.connect() as connection:
            return int(await connection.scalar(query) or 0)

    # -- runner leases and the episode index (pipeline.log.port; the SQL is in episode_queries) --

    async def start_lease(self, runner_id: str, *, host: str, pid: int) -> None:
        await episode_queries.start_lease(self.engine, runner_id, host=host, pid=pid)

    async def renew_lease(self, runner_id: str) -> None:
        await episode_queries.renew_lease(self.engine, runner_id)

    async def end_lease(self, runner_id: str) -> None:
        await episode_queries.end_lease(self.engine, runner_id)

    async def abandoned_episodes(
        self, *, runner_key: str, lease_timeout: float, orphan_after: float
    ) -> list[AbandonedEpisode]:
        return await episode_queries.abandoned_episodes(
            self.engine, runner_key=runner_key, lease_timeout=lease_timeout, orphan_after=orphan_after
        )

    async def find_episode_ids(self, text: str, limit: int) -> list[str]:
        return await episode_queries.find_episode_ids(self.engine, text, limit)

    async def list_episodes(self, filters: EpisodeFilter) -> list[EpisodeRow]:
        return await episode_queries.list_episodes(self.engine, filters)

    async def tail(
        self, after: int = 0, *, batch_size: int = 500, poll_interval: float = 5.0
    ) -> AsyncIterator[RecordedEvent]:
        """Every event with position > ``after``, in global order, exactly once; then waits for more.

        Wakes on NOTIFY from the insert trigger; ``poll_interval`` only bounds the wait should a
        notification be lost (e.g. while reconnecting). Survives PostgreSQL restarts.
        """
        position = after
        listener: psycopg.AsyncConnection[Any] | None = None
        try:
            while True:
                async for attempt in stamina.retry_context(
                    on=is_connection_error, attempts=None, timeout=None, wait_initial=0.1, wait_max=5.0
                ):
                    with attempt:
                        if attempt.num > 1:
                            log.warning("tail: connection lost; reconnecting (attempt %d)", attempt.num)
                            await _close_quietly(listener)
                            listener = None
                        if listener is None or listener.closed:
                            listener = await psycopg.AsyncConnection.connect(self.libpq_url, autocommit=True)
                            await listener.execute(f"LISTEN {NOTIFY_CHANNEL}")
                        batch = await self.read_all(position, batch_size)
                for recorded in batch:
                    position = recorded.position
                    yield recorded
                if len(batch) == batch_size:
                    continue
                assert listener is not None  # the attempt above connected it
                try:
                    async for _ in listener.notifies(timeout=poll_interval, stop_after=1):
                        pass
                except psycopg.Error:
                    await _close_quietly(listener)
                    listener = None
        finally:
            await _close_quietly(listener)


class _Writer:
    """One group-commit writer: takes batches of appends off the store's queue and commits each batch in
    one transaction on a connection of its own (a pool checkout, with its ping and reset, would cost more
    than the rest of a small batch's transaction).

    While one batch commits, new appends queue up and form the next, so batches grow with the load and a
    lone append is not delayed. The store runs two writers: while one waits for PostgreSQL (its COPY and
    fsync), the event loop encodes the next appends and the other writer sends them, and the append lock
    keeps their commits in position order. ``max_batch_events`` splits a burst between them.
    """

    def __init__(self, store: EventStore) -> None:
        self.store = store
        self._queue = store._queue
        self._connection: psycopg.AsyncConnection[Any] | None = None
        self._append_events = PreparedStatement(*APPEND_STATEMENT)
        """``write_in_one_round_trip``'s statement, prepared on this writer's connection."""

    async def run(self) -> None:
        stopping = False
        while not stopping:
            first = await self._queue.get()
            if first is None:
                break
            batch, size = [first], len(first.events)
            while size < self.store.max_batch_events and not self._queue.empty():
                item = self._queue.get_nowait()
                if item is None:
                    stopping = True
                    break
                batch.append(item)
                size += len(item.events)
            await self.commit_isolated(batch)
        await _close_quietly(self._connection)

    async def commit_isolated(self, batch: list[PendingAppend]) -> None:
        """Commit a batch; if PostgreSQL refuses it, commit each append alone so only the bad one fails."""
        try:
            outcomes = await self.commit_retrying(batch)
        except StoreUnavailable as error:
            outcomes = [error] * len(batch)
        except (psycopg.Error, sqlalchemy.exc.DBAPIError) as error:
            if len(batch) > 1:
                for append in batch:
                    await self.commit_isolated([append])
                return
            outcomes = [
                InvalidEvent(
                    f"PostgreSQL refused the append to {batch[0].stream!r}: {_postgres_message(error)}"
                )
            ]
        for append, outcome in zip(batch, outcomes, strict=True):
            future = append.future
            if future is None or future.done():
                continue  # the caller gave up waiting; its append may still have been recorded
            if isinstance(outcome, BaseException):
                future.set_exception(outcome)
            else:
                future.set_result(outcome)

    async def commit_retrying(self, batch: list[PendingAppend]) -> list[AppendResult | TurnstileError]:
        # A lost connection leaves a commit ambiguous; retrying is safe because a batch that did commit
        # is found again by its event ids and reported as recorded (idempotent by event id). The first
        # attempt goes without the retry machinery (stamina's context is a tenth of a lone append's CPU);
        # only a connection error enters it.
        try:
            return await self.commit(batch)
        except Exception as error:
            if not is_connection_error(error):
                raise
            log.warning("append: connection lost; retrying")
        try:
            async for attempt in stamina.retry_context(
                on=is_connection_error,
                attempts=None,
                timeout=self.store.retry_for,
                wait_initial=0.05,
                wait_max=2.0,
            ):
                with attempt:
                    if attempt.num > 1:
                        log.warning("append: connection lost; retrying (attempt %d)", attempt.num + 1)
                    return await self.commit(batch)
        except Exception as error:
            if not is_connection_error(error):
                raise
            raise StoreUnavailable(
                f"PostgreSQL unreachable for {self.store.retry_for:.0f} s while appending ({error}); "
                "check that it runs and that TURNSTILE_DATABASE_URL points at it"
            ) from error
        raise AssertionError("unreachable: the retry loop returns or raises")

    async def commit(self, batch: list[PendingAppend]) -> list[AppendResult | TurnstileError]:
        """One attempt: the batch in one transaction on this writer's connection (dropped if it broke).

        Written optimistically first (in one round trip where every append names its expected version,
        ``write_in_one_round_trip``, else ``write_appends``); if the database refuses that, written again with
        everything looked up, which decides each append (a retry of a recorded append, a stale expected
        version) and fails only where an append itself is refused."""
        wait = self.store.lock_timeout
        try:
            connection = await self.connect()
            try:
                if in_one_round_trip(batch, self.store.one_round_trip_max_events):
                    self.store.stats.one_round_trip += 1
                    outcomes = await write_in_one_round_trip(connection, self._append_events, batch, wait)
                else:
                    async with connection.transaction():
                        outcomes = await write_appends(connection, batch, wait, optimistic=True)
            except psycopg.errors.IntegrityError:
                self.store.stats.rewritten += 1
                async with connection.transaction():
                    outcomes = await write_appends(connection, batch, wait)
        except Exception as error:
            if is_connection_error(error):
                await _close_quietly(self._connection)
                self._connection = None
            raise
        self.store.stats.transactions += 1
        self.store.stats.appends += len(batch)
        self.store.stats.events += sum(len(a.events) for a in batch)
        return outcomes

    async def connect(self) -> psycopg.AsyncConnection[Any]:
        """This writer's connection: in autocommit, where ``write_in_one_round_trip``'s one statement is its
        own transaction (the other paths open one with ``connection.transaction()``), with ``lock_timeout``
        set for the session, since that statement sends nothing else to set it."""
        if self._connection is None or self._connection.closed or self._connection.broken:
            connection = await psycopg.AsyncConnection.connect(self.store.libpq_url, autocommit=True)
            await connection.execute(
                "SELECT set_config('lock_timeout', %s, false)", (f"{int(self.store.lock_timeout * 1000)}ms",)
            )
            self._connection = connection
        return self._connection


class AppendTransaction:
    """Appends inside one explicit transaction (see ``EventStore.transaction``)."""

    def __init__(self, store: EventStore, connection: psycopg.AsyncConnection[Any]) -> None:
        self._store = store
        self._connection = connection

    async def append(
        self,
        stream: str,
        events: Sequence[Event | Mapping[str, Any]],
        expected_version: int | None = None,
        *,
        metadata: Mapping[str, Any] | None = None,
    ) -> AppendResult:
        pending = prepare_append(stream, events, expected_version, metadata, self._store.max_event_bytes)
        async with self._connection.transaction():  # a savepoint: a refused append leaves the rest intact
            (outcome,) = await write_appends(self._connection, [pending], self._store.lock_timeout)
        if isinstance(outcome, TurnstileError):
            raise outcome
        return outcome


async def take_append_lock(connection: psycopg.AsyncConnection[Any], wait: float) -> None:
    """Take the append lock for the rest of the transaction (``StoreUnavailable`` after ``wait`` s)."""
    with _lock_wait(wait):
        async with connection.pipeline():
            await _request_append_lock(connection, wait)


async def _request_append_lock(connection: psycopg.AsyncConnection[Any], wait: float) -> None:
    # lock_timeout for the rest of this transaction: a session holding the lock (even a stuck one) makes
    # appends fail with a clear error instead of waiting for ever.
    await connection.execute("SELECT set_config('lock_timeout', %s, true)", (f"{int(wait * 1000)}ms",))
    await connection.execute("SELECT pg_advisory_xact_lock(%s)", (APPEND_LOCK,))


@contextmanager
def _lock_wait(timeout: float) -> Iterator[None]:
    try:
        yield
    except psycopg.errors.LockNotAvailable:
        raise StoreUnavailable(
            f"the append lock was not granted within {timeout:g} s: another session holds it (find it with "
            f"SELECT pid, usename, query FROM pg_locks JOIN pg_stat_activity USING (pid) WHERE locktype = "
            f"'advisory' AND objid = {APPEND_LOCK & 0xFFFFFFFF}); appends resume once it is released"
        ) from None


async def write_appends(
    connection: psycopg.AsyncConnection[Any],
    appends: Sequence[PendingAppend],
    lock_timeout: float,
    *,
    optimistic: bool = False,
) -> list[AppendResult | TurnstileError]:
    """Take the append lock (waiting at most ``lock_timeout`` s; the database refuses appends without it),
    decide every append (``plan_appends``) and COPY the accepted rows.

    ``optimistic``: look up only what the database does not check itself. No event id is looked up (the
    unique index on ``event_id`` refuses one recorded already), and an append that names its expected
    version is written as if the stream were at that version (the unique index on (stream, version) refuses
    a stream that is further on, migration 0015's guard one that is not as far): the usual append, a new
    event at its stream's version, then costs the database no look-up and the client no parameters to send
    or rows to read. Where the database refuses the COPY (an ``IntegrityError``), the caller rolls back and
    calls again without ``optimistic``, which looks everything up and decides each append on its own.

    Runs inside the caller's transaction; the caller commits, which releases the lock.
    """
    if optimistic:
        ids = []
        streams = {append.stream for append in appends if append.expected_version is None}
    else:
        ids = [item.event_id for append in appends for item in append.events]
        streams = {append.stream for append in appends}
    with _lock_wait(lock_timeout):
        async with connection.pipeline():  # the lock and the look-ups in one round trip
            await _request_append_lock(connection, lock_timeout)
            recorded_cursor = versions_cursor = None
            if ids:
                recorded_cursor = await connection.execute(
                    "SELECT event_id, stream, position, version, content_hash FROM events "
                    "WHERE event_id = ANY(%s)",
                    (ids,),
                )
            if streams:
                # One index probe per stream; "stream = ANY(...) GROUP BY stream" makes the planner scan
                # the table.
                versions_cursor = await connection.execute(
                    "SELECT s.stream, (SELECT max(e.version) FROM events e WHERE e.stream = s.stream) "
                    "FROM unnest(%s::text[]) AS s(stream)",
                    (sorted(streams),),
                )
            head_cursor = await connection.execute("SELECT coalesce(max(position), 0) FROM events")
            recorded = {
                row[0]: RecordedId(row[1], row[2], row[3], row[4])
                for row in (await recorded_cursor.fetchall() if recorded_cursor else ())
            }
            versions = {
                row[0]: row[1]
                for row in (await versions_cursor.fetchall() if versions_cursor else ())
                if row[1] is not None
            }
            head_row = await head_cursor.fetchone()
    if optimistic:  # each stream not looked up is taken to be where its first append expects it
        versions.update(_expected_versions(appends, looked_up=streams))
    plan = plan_appends(appends, recorded, versions, int(head_row[0]) if head_row else 0)
    if plan.rows:
        cursor = connection.cursor()
        cursor.adapters.register_dumper(JsonText, JsonTextBinaryDumper)
        async with cursor.copy(f"COPY events ({', '.join(COPY_COLUMNS)}) FROM STDIN (FORMAT BINARY)") as copy:
            copy.set_types(COPY_TYPES)
            for row in plan.rows:
                await copy.write_row(row)
    return plan.outcomes


def in_one_round_trip(appends: Sequence[PendingAppend], max_events: int) -> bool:
    """Whether ``write_in_one_round_trip`` can write this batch: every append names its expected version
    (so nothing needs looking up) and the batch has at most ``max_events`` events (over that, COPY)."""
    events = 0
    for append in appends:
        if append.expected_version is None:
            return False
        events += len(append.events)
    return events <= max_events


async def write_in_one_round_trip(
    connection: psycopg.AsyncConnection[Any],
    statement: PreparedStatement,
    appends: Sequence[PendingAppend],
    lock_timeout: float,
) -> list[AppendResult | TurnstileError]:
    """``write_appends(optimistic=True)`` for appends that all name their expected version, as one statement
    on the writer's autocommit connection (``cursor``'s): ``append_events`` (migration 0016) takes the
    append lock, checks the streams' versions, inserts the rows after the head and commits, one message each
    way (the connection's ``lock_timeout`` is set already, see ``_Writer.connect``), through libpq itself
    (``statement``: ``PreparedStatement``). At one episode every turn is a transaction of its own, and each
    round trip that puts the process to sleep costs more CPU than the statements (bench/ingest.py
    ``--copy-path``).

    Where the database refuses the rows (an ``IntegrityError``: a stream not at its expected version, an
    event id recorded already), nothing was written and the error is raised, as in ``write_appends``: the
    caller writes the batch again with look-ups.
    """
    plan = plan_appends(appends, {}, _expected_versions(appends), 0)
    if not plan.rows:  # every append was refused in planning: nothing to write
        return plan.outcomes
    with _lock_wait(lock_timeout):
        value = await statement.run(connection, binary_arrays(plan.rows))
    head = int(value) if value is not None else 0
    return [
        AppendResult(
            outcome.stream, tuple(head + position for position in outcome.positions), outcome.version
        )
        if isinstance(outcome, AppendResult)
        else outcome
        for outcome in plan.outcomes
    ]


_HEADER = struct.Struct("!iiIii")  # dimensions, has nulls, element type, length, lower bound
_LENGTH, _INT4 = struct.Struct("!i"), struct.Struct("!ii")
_NULL, _UUID_LENGTH = _LENGTH.pack(-1), _LENGTH.pack(16)
_APPEND_OIDS = tuple(postgres.types[name].oid for name in APPEND_TYPES)


def binary_arrays(rows: Sequence[Sequence[Any]]) -> list[bytes]:
    """The columns of ``rows`` (in ``COPY_COLUMNS`` order, positions 1, 2, ...) but the position, as binary
    arrays for ``APPEND_STATEMENT``: each element its length and its type's binary form (``array_recv``); only
    ``tokens`` may be null.

    Written here rather than by psycopg's list dumper, which inspects every list to choose an element type:
    for the one-element arrays of a lone append that was a third of what the whole append cost."""
    columns: list[list[bytes]] = [[] for _ in _APPEND_OIDS]
    streams, versions, ids, types, data, tokens, metadata, hashes = columns
    for _, stream, version, event_id, type_, text, packed, meta, content_hash in rows:
        streams.append(_text(stream))
        versions.append(_INT4.pack(4, version))
        ids.append(_UUID_LENGTH + event_id.bytes)
        types.append(_text(type_))
        data.append(_text(text))
        tokens.append(_NULL if packed is None else _LENGTH.pack(len(packed)) + packed)
        metadata.append(_text(meta))
        hashes.append(_LENGTH.pack(len(content_hash)) + content_hash)
    return [
        _HEADER.pack(1, _NULL in parts, oid, len(rows), 1) + b"".join(parts)
        for oid, parts in zip(_APPEND_OIDS, columns, strict=True)
    ]


def _text(value: str) -> bytes:
    raw = value.encode()
    return _LENGTH.pack(len(raw)) + raw


def _expected_versions(appends: Sequence[PendingAppend], looked_up: Set[str] = frozenset()) -> dict[str, int]:
    """Each stream's version as its first append in the batch expects it (but for streams looked up)."""
    versions: dict[str, int] = {}
    for append in appends:
        if append.expected_version is not None and append.stream not in looked_up:
            versions.setdefault(append.stream, append.expected_version)
    return versions


class JsonTextBinaryDumper(Dumper):
    """Binary jsonb is a version byte and the JSON text (psycopg's own dumper would re-serialize a str)."""

    format = pq.Format.BINARY
    oid = postgres.types["jsonb"].oid

    def dump(self, obj: str) -> bytes:
        return b"\x01" + obj.encode()


def decode_row(row: sa.Row[Any]) -> RecordedEvent:
    return recorded_event(
        position=row.position,
        stream=row.stream,
        version=row.version,
        event_id=row.event_id,
        type_=row.type,
        data=row.data,
        tokens=row.tokens,
        metadata=row.metadata,
        recorded_at=row.recorded_at,
    )


def is_connection_error(error: BaseException) -> bool:
    """True for errors that mean "the connection or server went away", as opposed to a refused statement."""
    if isinstance(error, sqlalchemy.exc.DBAPIError):
        if error.connection_invalidated:
            return True
        error = error.orig or error
    if isinstance(error, (sqlalchemy.exc.OperationalError, sqlalchemy.exc.InterfaceError)):
        return True
    return isinstance(error, (psycopg.OperationalError, psycopg.InterfaceError, ConnectionError, OSError))


def _postgres_message(error: BaseException) -> str:
    original = error.orig if isinstance(error, sqlalchemy.exc.DBAPIError) else error
    diag = getattr(original, "diag", None)
    if diag is None or not diag.message_primary:
        return str(original).splitlines()[0]
    return " ".join(part for part in (diag.message_primary, diag.message_detail) if part)


async def _close_quietly(connection: psycopg.AsyncConnection[Any] | None) -> None:
    if connection is not None:
        try:
            await connection.close()
        except Exception:
            log.debug("closing a broken connection failed", exc_info=True)
