"""The fold's episode half in forked worker processes, and the pages they send back through pipes."""

from __future__ import annotations

import contextlib
import copyreg
import io
import pickle
import resource
import signal
import traceback
import uuid
from array import array
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from multiprocessing.connection import Connection
from typing import Any, Final

import psycopg

from pipeline.log import JsonText
from pipeline.materialize.config import MaterializerConfig
from pipeline.materialize.fold import Fold
from pipeline.materialize.records import Finished, LogRow, Outcome, ReadySample, Writes, log_rows, read_query

FOLD_WORKER_BACKLOG: Final = 20_000
"""A ``catch_up`` this many events behind or more runs the fold's episode half in worker processes."""
FOLD_WORKERS: Final = 2
"""Worker processes of such a catch-up, each with half of the episodes."""
FOLD_WORKER_CPUS: Final = 2
"""Cores a machine needs for the workers by default. They cost CPU (the pages cross a pipe: ~40% more
Python than one process), which pays where the workers, this process (groups, batches, the writes) and
PostgreSQL find the cores idle: on two quiet cores a rebuild took 5.7-5.9 s with them and 7.6-7.7 s
without; on two cores busy with other work it did no better than one process (``bench/materialize.py``)."""


@dataclass(slots=True)
class FoldedPage:
    """A page of the log as a worker's episode half folded it (``episode_worker``)."""

    span: tuple[int, int]
    """The positions it covers: (after, last]."""
    positions: array[int]
    """Each event's position, in log order."""
    micros: array[int]
    """Each event's recorded_at, microseconds since the Unix epoch: the group half's clock."""
    outcomes: list[tuple[int, str, str, Outcome]]
    """The events that gave the group half something: index in ``positions``, stream, type, outcome."""
    writes: Writes
    """The episode half's writes: episodes, finished, turns, searched, skipped."""
    skipped: int
    """Events skipped in this page."""


_UNIX_EPOCH: Final = datetime(1970, 1, 1, tzinfo=UTC)
_MICROSECOND: Final = timedelta(microseconds=1)


def to_micros(moment: datetime) -> int:
    return (moment - _UNIX_EPOCH) // _MICROSECOND


def from_micros(micros: int) -> datetime:
    """The instant ``micros`` (in UTC: only instants reach the tables and the group timeouts)."""
    return _UNIX_EPOCH + timedelta(microseconds=micros)


def _ready_fields(s: ReadySample) -> tuple[Any, ...]:
    """A ``ReadySample``'s fields in order: what its constructor takes."""
    return (
        s.sample_id, s.episode_id, s.group_id, s.policy, s.turn_ids, s.policy_version, s.tokens, s.reward,
        s.arrays, s.position, s.slot, s.advantage,
    )  # fmt: skip


def _reduce_datetime(value: datetime) -> Any:
    if value.tzinfo is None:
        return value.__reduce_ex__(pickle.HIGHEST_PROTOCOL)
    return from_micros, (to_micros(value),)


_WIRE: Final = {
    **copyreg.dispatch_table,
    uuid.UUID: lambda value: (uuid.UUID, (None, None, None, None, value.int)),
    datetime: _reduce_datetime,
    JsonText: lambda value: (JsonText, (str(value),)),
    ReadySample: lambda sample: (ReadySample, _ready_fields(sample)),
    Finished: lambda value: (Finished, tuple(value)),
}
"""How the worker's pages cross the pipe: ``uuid.UUID`` by its int, an aware ``datetime`` by its instant, a
``ReadySample`` by its fields in order (pickle's own way restores each through ``__setstate__``, a
``SafeUUID``, a time zone or ``copyreg``: together they cost more than folding the episodes)."""


def _dumps(message: Any) -> memoryview:
    buffer = io.BytesIO()
    pickler = pickle.Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL)
    pickler.dispatch_table = _WIRE
    pickler.dump(message)
    return buffer.getbuffer()


@dataclass(slots=True)
class WorkerDone:
    """The worker reached its target: the episodes still open, for this process to go on with."""

    open: dict[str, list[LogRow]]
    peak_rss_kb: int


_SHARD: Final = "(hashtext(stream) & 2147483647) %% %(shards)s = %(shard)s"
"""The streams of one worker of ``shards`` (an episode's events are all in its stream)."""


def episode_worker(
    pipe: Connection,
    database_url: str,
    config: MaterializerConfig,
    shard: tuple[int, int],
    position: int,
    target: int,
    open_episodes: dict[str, list[LogRow]],
) -> None:
    """A forked process: the episode half of the fold (``Fold.fold_event``) over the events of the streams
    of ``shard`` (this worker's number, and how many there are) after ``position`` until ``target``, page by
    page, read on its own connection (the next page while one folds). A page is a range of positions, the
    same for every worker; each goes to ``pipe`` as it is folded (a send waits while the page before is still
    unread: at most one page ahead of the parent). Ends with ``WorkerDone``, or the traceback of what
    failed."""
    with contextlib.suppress(ValueError):
        signal.set_wakeup_fd(-1)  # the parent's event loop's, not this process's
    try:
        fold = Fold(config)
        fold.position = position
        number, shards = shard
        params: dict[str, Any] = {"shard": number, "shards": shards}
        where = "position > %(after)s AND position <= %(last)s" + (f" AND {_SHARD}" if shards > 1 else "")
        with (
            psycopg.Connection.connect(database_url, autocommit=True) as connection,
            ThreadPoolExecutor(1) as reader,
        ):
            if shards > 1 and open_episodes:
                mine = connection.execute(
                    f"SELECT stream FROM unnest(%(streams)s::text[]) AS stream WHERE {_SHARD}",
                    {**params, "streams": list(open_episodes)},
                ).fetchall()
                open_episodes = {stream: open_episodes[stream] for (stream,) in mine}
            fold.open = open_episodes

            def read(after: int, last: int) -> list[tuple[Any, ...]]:
                # the rows only: they are parsed by the thread that folds them (one thread at a time holds the
                # GIL, and handing it back and forth costs)
                with connection.cursor(binary=True) as cursor:
                    query = read_query(where, {**params, "after": after, "last": last}, None)
                    return cursor.execute(*query).fetchall()

            # The first pages are smaller, so that the processes get going sooner: 1/8 of a step, then twice
            # as many each page up to a step.
            size = max(1, config.step_events // 8)
            last = min(target, position + size)
            ahead = reader.submit(read, position, last) if position < target else None
            while ahead is not None:
                raw = ahead.result()
                after, position = position, last
                # the next page is read (PostgreSQL's work; psycopg waits without the GIL) while this folds
                size = min(config.step_events, 2 * size)
                last = min(target, position + size)
                ahead = reader.submit(read, position, last) if position < target else None
                rows = log_rows(raw)
                skipped = fold.skipped
                outcomes = []
                for index, row in enumerate(rows):
                    outcome = fold.fold_event(row)
                    if outcome is not None:
                        outcomes.append((index, row.stream, row.type, outcome))
                writes, fold.writes = fold.writes, Writes()
                positions = array("q", [row.position for row in rows])
                micros = array("q", [to_micros(row.recorded_at) for row in rows])
                page = FoldedPage(
                    (after, position), positions, micros, outcomes, writes, fold.skipped - skipped
                )
                pipe.send_bytes(_dumps(page))
        pipe.send_bytes(_dumps(WorkerDone(fold.open, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)))
    except BaseException:
        with contextlib.suppress(Exception):
            pipe.send_bytes(_dumps(traceback.format_exc()))
    finally:
        pipe.close()


def receive_bytes(pipes: list[Connection]) -> list[bytes]:
    return [pipe.recv_bytes() for pipe in pipes]
