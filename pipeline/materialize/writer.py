"""The materializer: folds the log into read models (episodes, turns, samples), training batches and the
batch outbox, exactly once.

Each step reads the next events after the checkpoint (positions are gapless and in commit order, so
``position > checkpoint`` never skips one), folds them, and writes everything it produced, the new
checkpoint included, in ONE transaction: a crash anywhere leaves either all of a step or none of it, and
the restart folds the same events again to the same result. Everything is a deterministic function of
the log and the configuration (no wall clock: group timeouts use the events' own ``recorded_at``), so a
rebuild with the same configuration gives byte-identical batch ids and payloads.

Memory is bounded by what is still open: the events of running episodes, the samples of groups still
waiting for members, and samples not yet in a batch. All of it is also in the read models, so a restart
rebuilds it from the tables.

Events are read as raw rows (JSON data, packed tokens), not validated models: this is the hot loop of a
rebuild over millions of turns, and the log was validated when it was written.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import json
import logging
import multiprocessing
import os
import pickle
from collections.abc import Awaitable
from multiprocessing.connection import Connection
from typing import Any, Final

import psycopg
from psycopg import sql

from pipeline.batches import BATCHES_CHANNEL
from pipeline.errors import ConfigError
from pipeline.materialize.config import MaterializerConfig
from pipeline.materialize.fold import Fold
from pipeline.materialize.rebuild import build_deferred_indexes, create_rebuild_schema
from pipeline.materialize.records import LogRow, Writes, log_rows, read_query
from pipeline.materialize.state import load_state, read_log
from pipeline.materialize.workers import (
    FOLD_WORKER_BACKLOG,
    FOLD_WORKER_CPUS,
    FOLD_WORKERS,
    FoldedPage,
    WorkerDone,
    episode_worker,
    from_micros,
    receive_bytes,
    to_micros,
)
from pipeline.materialize.writes import qualified, write
from pipeline.settings import libpq_url

log = logging.getLogger(__name__)


REFUSED_WRITES: Final = (psycopg.errors.DataError, psycopg.errors.IntegrityError)
"""What the read models answer to a value they cannot hold: out of a column's range, text with NUL, a
duplicate key. The transaction is rolled back; ``Materializer.step`` then finds and skips the event."""


def _first_line(error: BaseException) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


class Materializer:
    """Runs a ``Fold`` on PostgreSQL: ``await m.open()``, then ``step()``, ``catch_up()`` or ``run()``."""

    def __init__(self, database_url: str, config: MaterializerConfig) -> None:
        self.database_url = libpq_url(database_url)
        self.config = config
        self.fold = Fold(config)
        self.steps = 0
        self._connection: psycopg.AsyncConnection[Any] | None = None
        """Reads the log and the tables (autocommit)."""
        self._writer: psycopg.Connection[Any] | None = None
        """Writes each step in one transaction, from a worker thread (``_commit``)."""
        self._indexes_built = False
        self.fold_worker: bool | None = None
        """Run the fold's episode half in worker processes during ``catch_up``: None (the default) when the
        log is at least ``FOLD_WORKER_BACKLOG`` events ahead and the machine has ``FOLD_WORKER_CPUS``."""
        self.fold_workers = FOLD_WORKERS
        """How many: each folds the episodes of its share of the streams."""
        self.worker_peak_rss_kb: int | None = None
        """The last worker's peak resident memory (it starts as a fork of this process: it counts the
        pages it shares with it)."""

    @property
    def position(self) -> int:
        return self.fold.position

    @property
    def skipped(self) -> int:
        """Events this process skipped (see ``Fold.skip``); ``skipped_events`` holds all of them."""
        return self.fold.skipped

    def _table(self, name: str) -> sql.Composed:
        return qualified(self.config.schema, name)

    async def open(self, *, create: bool = False) -> None:
        """Connect, register (or check) the configuration, and load the state from the read models.
        ``create``: make the rebuild schema ``rm_<name>`` (refused when it exists)."""
        # autocommit: each read is its own statement; every write goes in an explicit transaction() block
        self._connection = await psycopg.AsyncConnection.connect(self.database_url, autocommit=True)
        connection = self._connection
        async with connection.transaction():
            await connection.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (self.config.checkpoint,))
            row = await (
                await connection.execute(
                    "SELECT config, config_hash FROM materializers WHERE name = %s", (self.config.name,)
                )
            ).fetchone()
            if row is None:
                if self.config.schema != "public":
                    await self._create_schema(connection, create)
                await connection.execute(
                    "INSERT INTO materializers (name, schema_name, config, config_hash) "
                    "VALUES (%s, %s, %s, %s)",
                    (self.config.name, self.config.schema, json.dumps(self.config.semantics()),
                     self.fold.config_hash),
                )  # fmt: skip
            elif row[1] != self.fold.config_hash:
                older = "advantage_peers" not in row[0] and self.config.advantage_peers != "slot"
                hint = (
                    " It was made before --advantage-peers existed, when samples were compared by slot: "
                    "--advantage-peers slot goes on with it."
                    if older
                    else ""
                )
                if "lineage_rule" not in row[0] and "lineage_rule" in self.config.semantics():
                    hint += (
                        " It was made under lineage rule 1 (side calls trained, a tool call sent back in "
                        "another form a new root; docs/lineages.md), which no release folds any more: build "
                        "the read models again under the new rule (turnstile rematerialize --name NEW, then "
                        "point the services at it, or drop the old ones and let `serve materializer` refold)."
                    )
                raise ConfigError(
                    f"materializer {self.config.name!r} was built with {json.dumps(row[0], sort_keys=True)}; "
                    f"it cannot go on with {json.dumps(self.config.semantics(), sort_keys=True)} (its "
                    "batches would mix two configurations). Rebuild under a new name: "
                    f"turnstile rematerialize --name NEW.{hint}"
                )
            elif create:
                raise ConfigError(
                    f"a rebuild named {self.config.name!r} exists already (schema {self.config.schema}); "
                    "choose another --name, or drop it with --replace"
                )
        if self.fold.searches:
            await self._check_search_index(connection)
        await load_state(self._require(), self.fold, self.config.schema)
        self._writer = await asyncio.to_thread(psycopg.Connection.connect, self.database_url, autocommit=True)

    @staticmethod
    async def _check_search_index(connection: psycopg.AsyncConnection[Any]) -> None:
        """The live materializer indexes turns for search through migration 0024's function: a database not
        migrated that far is named now, not by the first step that folds a turn."""
        row = await (
            await connection.execute("SELECT to_regprocedure('turnstile_index_turns(bigint[])') IS NOT NULL")
        ).fetchone()
        if row is None or not row[0]:
            raise ConfigError(
                "this database is not migrated for this materializer: it has no turnstile_index_turns "
                "(migration 0024, search over running episodes); run `turnstile migrate` first"
            )

    async def _create_schema(self, connection: psycopg.AsyncConnection[Any], create: bool) -> None:
        if not create:
            raise ConfigError(
                f"no materializer named {self.config.name!r}; build one with `turnstile rematerialize --name "
                f"{self.config.name}`"
            )
        await create_rebuild_schema(connection, self.config.schema)

    async def build_deferred_indexes(self) -> int:
        """A rebuild's schema gets the live read models' other indexes once it has caught up (see
        ``rebuild.create_rebuild_schema``); also after a restart, when a rebuild stopped before that. The
        indexes built."""
        if self.config.schema == "public" or self._indexes_built:
            return 0
        built = await build_deferred_indexes(self._require(), self.database_url, self.config.schema)
        self._indexes_built = True
        return built

    async def close(self) -> None:
        if self._connection is not None:
            await self._connection.close()
            self._connection = None
        if self._writer is not None:
            await asyncio.to_thread(self._writer.close)
            self._writer = None

    def _require(self) -> psycopg.AsyncConnection[Any]:
        if self._connection is None:
            raise ConfigError("the materializer is not open: call open() first")
        return self._connection

    def _require_writer(self) -> psycopg.Connection[Any]:
        if self._writer is None:
            raise ConfigError("the materializer is not open: call open() first")
        return self._writer

    async def _read(self, where: str, params: dict[str, Any], limit: int | None = None) -> list[LogRow]:
        return await read_log(self._require(), where, params, limit)

    def _read_after(self, connection: psycopg.Connection[Any], position: int) -> list[tuple[Any, ...]]:
        """``_read``'s next page after ``position``, on ``connection``, unparsed (blocking: ``catch_up``'s
        prefetch runs it in a worker thread, and the rows are parsed by the thread that folds them)."""
        with connection.cursor(binary=True) as cursor:
            return cursor.execute(
                *read_query("position > %(position)s", {"position": position}, self.config.step_events)
            ).fetchall()

    async def step(self) -> int:
        """Fold the next events after the checkpoint and commit what they produced; the events folded."""
        rows = await self._read(
            "position > %(position)s", {"position": self.fold.position}, self.config.step_events
        )
        if not rows:
            return 0
        skipped, writes = self._fold(rows)
        await self._settle(self._commit(writes, self.fold.position), rows, skipped)
        return len(rows)

    def _fold(self, rows: list[LogRow]) -> tuple[int, Writes]:
        """Fold ``rows``; the skips counted before them, and what they produced."""
        skipped = self.fold.skipped
        for row in rows:
            self.fold.apply(row)
        writes, self.fold.writes = self.fold.writes, Writes()
        return skipped, writes

    async def _settle(
        self, commit: Awaitable[None], rows: list[LogRow] | tuple[int, int], skipped: int
    ) -> bool:
        """Wait for the commit of the step that folded ``rows`` (or the events in (after, last], which a
        worker folded). When the read models refused it, go back to the checkpoint and commit the step's
        events one at a time, skipping the culprit; False then."""
        try:
            await commit
            return True
        except REFUSED_WRITES as error:
            after = rows[0] if isinstance(rows, tuple) else rows[0].position - 1
            log.warning(
                "materializer %s: the read models refused the step after position %d (%s); folding its "
                "events one at a time to find the one to skip",
                self.config.name, after, _first_line(error),
            )  # fmt: skip
            await self._reload(skipped)
            if isinstance(rows, tuple):
                rows = await self._read(
                    "position > %(after)s AND position <= %(last)s", {"after": after, "last": rows[1]}
                )
            await self._fold_one_at_a_time(rows)
            return False

    async def _fold_one_at_a_time(self, rows: list[LogRow]) -> None:
        """The safety net behind the fold's own checks: a value the tables cannot hold (out of an integer
        column's range, a duplicate key) made a step's transaction fail. Back to the checkpoint, commit the
        step's events one by one; the one whose commit fails again is skipped (recorded with the database's
        reason) and the rest go on."""
        for row in rows:
            if row.position <= self.fold.position:
                continue
            skipped = self.fold.skipped
            self.fold.apply(row)
            writes, self.fold.writes = self.fold.writes, Writes()
            try:
                await self._commit(writes, row.position)
            except REFUSED_WRITES as error:
                await self._reload(skipped)
                self.fold.position = row.position
                self.fold.skip(row, f"the read models refused it: {_first_line(error)}")
                writes, self.fold.writes = self.fold.writes, Writes()
                await self._commit(writes, row.position)

    async def _reload(self, skipped: int) -> None:
        """Forget the in-memory state and load it again from the tables as of the checkpoint."""
        self.fold = Fold(self.config)
        self.fold.skipped = skipped
        await load_state(self._require(), self.fold, self.config.schema)

    async def _commit(self, writes: Writes, position: int) -> None:
        """Write one step's output and its checkpoint, on the writer connection in a worker thread (see
        ``catch_up``: the next step is read and folded meanwhile)."""
        await asyncio.to_thread(self._commit_now, writes, position)
        self.fold.position = max(self.fold.position, position)
        self.steps += 1

    def _commit_now(self, writes: Writes, position: int) -> None:
        # One transaction: the read models, the batches, the outbox and the checkpoint commit together.
        connection = self._require_writer()
        with connection.transaction():
            write(connection, self.config.schema, writes)
            connection.execute(
                "INSERT INTO checkpoints (name, position) VALUES (%s, %s) ON CONFLICT (name) DO UPDATE "
                "SET position = excluded.position, updated_at = now()",
                (self.config.checkpoint, position),
            )
            if writes.outbox:
                connection.execute(sql.SQL("NOTIFY {}").format(sql.Identifier(BATCHES_CHANNEL)))

    async def head(self) -> int:
        connection = self._require()
        row = await (await connection.execute("SELECT coalesce(max(position), 0) FROM events")).fetchone()
        return int(row[0]) if row else 0

    async def catch_up(self) -> int:
        """Fold until the checkpoint reaches the head of the log as it was when called; events folded. Far
        behind (``fold_worker``), the episode half of the fold runs in worker processes."""
        target, total = await self.head(), 0
        while True:
            if self._wants_worker(target):
                done, folded = await self._catch_up_with_workers(target)
            else:
                done, folded = await self._catch_up_here(target)
            total += folded
            if done:
                break
        await self.build_deferred_indexes()
        return total

    def _wants_worker(self, target: int) -> bool:
        if self.fold_worker is None:
            wanted = (
                target - self.fold.position >= FOLD_WORKER_BACKLOG
                and (os.cpu_count() or 1) >= FOLD_WORKER_CPUS
            )
        else:
            wanted = self.fold_worker and self.fold.position < target
        return wanted and "fork" in multiprocessing.get_all_start_methods()

    async def _catch_up_here(self, target: int) -> tuple[bool, int]:
        """``catch_up`` in this process; (True, events folded), or (False, ...) after a refused step (the
        caller goes on from the checkpoint)."""
        # Pipelined: each step is read and folded while the step before it commits (on the writer connection,
        # in a worker thread), so PostgreSQL's work on the writes overlaps the fold; and the page after a step
        # is read (on a reader connection, in another worker thread) while that step folds. Commits still go
        # one at a time and in order, each with its checkpoint; at most two steps' output and one page read
        # ahead are in memory. When a commit is refused, the step folded meanwhile was folded on a state that
        # is gone: it is read again, and the page read ahead of it is dropped.
        total = 0
        pending: tuple[asyncio.Future[None], list[LogRow], int] | None = None
        reader: psycopg.Connection[Any] = await asyncio.to_thread(
            psycopg.Connection.connect, self.database_url, autocommit=True
        )
        ahead: tuple[int, asyncio.Future[list[tuple[Any, ...]]]] | None = None
        loop = asyncio.get_running_loop()
        try:
            while True:
                rows: list[LogRow] = []
                if self.fold.position < target:
                    if ahead is not None and ahead[0] == self.fold.position:
                        rows = log_rows(await ahead[1])
                    else:
                        if ahead is not None:
                            await ahead[1]  # read after a position the fold went back from: dropped
                        rows = await self._read(
                            "position > %(position)s",
                            {"position": self.fold.position},
                            self.config.step_events,
                        )
                    ahead = None
                    if rows and rows[-1].position < target:
                        # submitted now, not when the event loop next runs: it reads while this step folds
                        after = rows[-1].position
                        ahead = (after, loop.run_in_executor(None, self._read_after, reader, after))
                folded = self._fold(rows) if rows else None
                if pending is not None:
                    committed, pending = await self._settle(*pending), None
                    if not committed:
                        return False, total
                if folded is None:
                    break
                skipped, writes = folded
                pending = (asyncio.ensure_future(self._commit(writes, self.fold.position)), rows, skipped)
                await asyncio.sleep(0)  # the commit's thread starts now, not after the next page has folded
                total += len(rows)
        finally:
            if ahead is not None:
                with contextlib.suppress(Exception):
                    await ahead[1]
            if pending is not None:  # something failed while a commit was in flight: let it finish first
                with contextlib.suppress(Exception):
                    await pending[0]
            await asyncio.to_thread(reader.close)
        return True, total

    async def _catch_up_with_workers(self, target: int) -> tuple[bool, int]:
        """``_catch_up_here`` with the fold's episode half in forked worker processes (``episode_worker``),
        ``fold_workers`` of them, each with its share of the streams: each reads the log itself and sends
        each page folded; this process folds the group half of each page, its workers' events merged in log
        order (``_take_pages``), and commits it, pipelined as ``_catch_up_here`` does. The workers hold the
        open episodes meanwhile, and hand them back when they are done. After a refused step the workers are
        stopped (they are ahead, on a state that is gone)."""
        loop = asyncio.get_running_loop()
        context = multiprocessing.get_context("fork")  # nothing to import or pickle at start
        handed, self.fold.open = self.fold.open, {}
        shards = max(1, self.fold_workers)
        pipes: list[Connection] = []
        workers: list[multiprocessing.process.BaseProcess] = []
        for number in range(shards):
            ours, theirs = context.Pipe(duplex=False)
            worker = context.Process(
                target=episode_worker,
                args=(
                    theirs,
                    self.database_url,
                    self.config,
                    (number, shards),
                    self.fold.position,
                    target,
                    handed,
                ),
                name=f"materializer-{self.config.name}-episodes-{number}",
                daemon=True,
            )
            worker.start()
            theirs.close()
            pipes.append(ours)
            workers.append(worker)

        total = 0
        pending: tuple[asyncio.Future[None], tuple[int, int], int] | None = None
        # The pages' bytes arrive in a thread (without the GIL); they are unpickled here, by the thread that
        # folds them.
        incoming: asyncio.Future[list[bytes]] | None = loop.run_in_executor(None, receive_bytes, pipes)
        try:
            while True:
                assert incoming is not None
                messages, incoming = [pickle.loads(data) for data in await incoming], None
                page: tuple[Writes, tuple[int, int], int, int] | None = None
                failed = [message for message in messages if isinstance(message, str)]
                if failed:
                    raise RuntimeError(f"the materializer's episode worker failed:\n{failed[0]}")
                if all(isinstance(message, FoldedPage) for message in messages):
                    incoming = loop.run_in_executor(None, receive_bytes, pipes)  # the next, while these fold
                    after, skipped = self.fold.position, self.fold.skipped
                    events = sum(len(message.positions) for message in messages)
                    page = (self._take_pages(messages), (after, self.fold.position), skipped, events)
                elif all(isinstance(message, WorkerDone) for message in messages):
                    self.fold.open = {stream: e for message in messages for stream, e in message.open.items()}
                    self.worker_peak_rss_kb = max(message.peak_rss_kb for message in messages)
                else:
                    raise RuntimeError("the materializer's episode workers fell out of step")
                if pending is not None:
                    committed, pending = await self._settle(*pending), None
                    if not committed:
                        return False, total
                if page is None:
                    return True, total
                writes, span, skipped, events = page
                pending = (asyncio.ensure_future(self._commit(writes, span[1])), span, skipped)
                await asyncio.sleep(0)  # the commit's thread starts now, not after the next page has folded
                total += events
        finally:
            if pending is not None:  # something failed while a commit was in flight: let it finish first
                with contextlib.suppress(Exception):
                    await pending[0]
            for process in workers:
                if process.is_alive():
                    process.terminate()
            for process in workers:
                await asyncio.to_thread(process.join)
            if incoming is not None:  # their pipes are closed now: it ends
                with contextlib.suppress(BaseException):
                    await incoming
            for pipe in pipes:
                pipe.close()

    def _take_pages(self, pages: list[FoldedPage]) -> Writes:
        """The group half of the fold over one page of each worker (the same positions), their events in
        log order; the step's writes, both halves'."""
        if len({page.span for page in pages}) != 1:
            raise RuntimeError(f"the episode workers sent different pages: {[page.span for page in pages]}")
        fold = self.fold
        pending, timeout = fold.pending, self.config.group_timeout_s
        outcomes = [iter(page.outcomes) for page in pages]
        upcoming = [next(each, None) for each in outcomes]
        shares = [
            zip(p.positions, p.micros, itertools.repeat(n), itertools.count()) for n, p in enumerate(pages)
        ]
        for position, micros, shard, index in heapq.merge(*shares) if len(shares) > 1 else shares[0]:
            fold.position = position
            next_outcome = upcoming[shard]
            if next_outcome is not None and next_outcome[0] == index:
                _, stream, kind, outcome = next_outcome
                row = LogRow(position, stream, kind, {}, None, from_micros(micros))
                fold._expire_groups(row)
                fold.take(outcome, row)
                upcoming[shard] = next(outcomes[shard], None)
            elif pending:
                # _expire_groups' own test on the oldest group, in integers: most events expire nothing
                oldest = next(iter(pending.values()))
                if (micros - to_micros(oldest.last_time)) / 10**6 > timeout:
                    fold._expire_groups(LogRow(position, "", "", {}, None, from_micros(micros)))
        fold.skipped += sum(page.skipped for page in pages)
        writes, fold.writes = fold.writes, Writes()
        for page in pages:
            theirs = page.writes
            writes.episodes.update(theirs.episodes)
            writes.finished += theirs.finished
            writes.turns += theirs.turns
            writes.searched += theirs.searched
        writes.skipped = [row for page in pages for row in page.writes.skipped] + writes.skipped
        return writes

    async def run(self, stop: asyncio.Event, *, poll_interval: float = 5.0) -> None:
        """Fold new events as they are appended (woken by the log's NOTIFY) until ``stop`` is set."""
        listener = await psycopg.AsyncConnection.connect(self.database_url, autocommit=True)
        try:
            await listener.execute("LISTEN turnstile_events")
            while not stop.is_set():
                if await self.step():
                    continue
                await self.build_deferred_indexes()  # caught up: a rebuild's other indexes, once
                with contextlib.suppress(TimeoutError):
                    async for _ in listener.notifies(timeout=poll_interval, stop_after=1):
                        pass
        finally:
            await listener.close()
