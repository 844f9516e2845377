"""Rebuild throughput of the materializer: turns/s folding a recorded log of 1,000,000 turns into read
models and training batches, against a raw sequential SELECT of the same rows in the same run; and the
rebuild's peak memory.

What it measures, in one run on one PostgreSQL server:

1. The log (not timed as a result). ``--turns`` turns of realistic episodes, written straight into
   ``events`` with binary COPY, in position order (``EventStore.append`` would take longer than all the
   rest): groups of four episodes (``EpisodeStarted`` with ``group_id`` and ``group_size`` 4), each with
   one to three ``TurnCompleted`` whose prompts (about 200-400 token ids) extend the previous turn's
   prompt and completion token for token, so the turn tree has parents; completions of 20-60 ids with
   float32 logprobs; chat messages of about 4 characters per token; then ``RewardAssigned`` and
   ``EpisodeFinished``. ``--open`` episodes are open at any time, their events interleaved as a busy
   runner records them. Data, tokens and content hash come from ``encode_event``; positions 1..N, stream
   versions and event ids are what appends would give; ``recorded_at`` is a clock of 2 ms per event (group
   timeouts are judged by it). Worker processes build and encode the events, this process COPYs them;
   then ``VACUUM ANALYZE`` and ``CHECKPOINT``, so no timed reader pays for hint bits or the load's writes.
2. ``SELECT`` (the baseline): a raw sequential read of the same rows, ``SELECT position, stream, type, data,
   tokens, recorded_at FROM events WHERE position > %s ORDER BY position LIMIT <step>``, page after page until
   the log ends, into Python tuples with psycopg (async, autocommit, jsonb parsed), paged as the materializer
   pages. (It was the materializer's own query; the materializer now reads less of each row, see
   ``Materializer._read``, and the baseline stays what it was so that the ratios compare.) It runs before
   and after each rebuild; the faster of the two is the baseline.
3. ``rebuild``: what ``turnstile rematerialize`` does, in this process: ``Materializer(url,
   MaterializerConfig(name=..., step_events=<step>))`` (defaults otherwise: individual samples, GRPO
   advantages, batches of 64), ``open(create=True)``, then ``catch_up()``, timed: reading the log, folding
   it (turn trees, discounted returns, samples, advantages, batches) and writing episodes, turns, samples,
   batches and the outbox, one transaction per step. Its schema is dropped after counting what it made.
   (It runs as a subclass that only counts the rows of each step's writes, for the lines under the table:
   rows COPYed, and rows UPDATEd one statement each because they were inserted in an earlier step.)

4. What the search index costs the live materializer, which a rebuild does not pay (a rebuild writes no
   ``turn_search``): after the first rebuild, its turns written as 0023 indexed them (into a copy of
   ``turn_rows`` with 0023's trigger, which writes each turn's words when its episode finishes), as 0024
   does (``turnstile_index_turns`` as the tail passes each turn, then ``public.turn_rows``, whose trigger
   passes over turns indexed already) and into a copy of ``turn_rows`` without a trigger, one step's turns
   a statement, alternating, each rolled back; the extra time is also given as a share of the rebuild's.

Reading the table: "x SELECT" is turns/s ÷ the baseline's turns/s at the same step size: 1.00 would mean
folding and writing cost nothing over reading the log; the target is at least 0.50. "peak RSS" is this
process's resident high-water mark during the timed part, and in brackets how far it rose over the RSS
just before (VmHWM, reset through /proc/self/clear_refs; Linux). "CPU s": CPU seconds of this process
and of the fold's worker processes together ("py"; "of which worker": the workers' alone) and of the
PostgreSQL server with all its processes ("pg"; embedded server only) in the timed part. A rebuild this
far behind the log folds its episodes in two worker processes (``Materializer.fold_worker``, on a machine
of two cores or more); ``--fold-worker on,off`` rebuilds once with them and once without, one after the
other. "worker RSS": the larger worker's peak resident memory (a fork: it counts
the pages it shares with this process). ``--profile FILE`` runs one
more rebuild (untimed) under cProfile, saves the stats to FILE and prints the top functions by cumulative
and by own time (this process's only).

Server: ``TURNSTILE_DATABASE_URL`` if set, else an embedded PostgreSQL in a temporary directory (under
``--tmp-dir``). Either way the run works in a scratch database ``bench_<random>``, dropped at the end.
A 1,000,000-turn log takes about 5 GB, and each rebuild about as much again while it exists.

    python bench/materialize.py                     # 1,000,000 turns, the default step (10,000)
    python bench/materialize.py --quick             # 50,000 turns
    python bench/materialize.py --quick --step-events 500,2000,10000 --profile /tmp/rebuild.prof
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import os
import platform
import pstats
import random
import re
import resource
import string
import struct
import sys
import time
import uuid
from array import array
from collections import deque
from collections.abc import Container, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from contextlib import suppress
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from functools import cache
from itertools import islice
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql
from rich.console import Console
from rich.table import Table

from migrations.objects import sql as sql_object
from pipeline.log import encode_event
from pipeline.log.store import APPEND_LOCK, COPY_COLUMNS, COPY_TYPES, JsonText, JsonTextBinaryDumper
from pipeline.materialize.config import MaterializerConfig
from pipeline.materialize.rebuild import READ_MODEL_TABLES
from pipeline.materialize.records import Writes
from pipeline.materialize.writer import Materializer
from schemas import (
    ChatMessage,
    EpisodeFinished,
    EpisodeStarted,
    Event,
    FunctionCall,
    RewardAssigned,
    ToolCall,
    TurnCompleted,
    TurnReply,
    TurnRequest,
)
from schemas.common import Timings

from common import checkpoint, note, postgres_server, scratch_database, summary  # bench/common.py

TARGET_RATIO = 0.50
VOCAB_SIZE = 151_936
GROUP_SIZE = 4
MAX_TURNS = 3
FIRST_PROMPT = (180, 260)
COMPLETION = (20, 60)
GLUE = (10, 40)
"""Token ids between a turn's completion and the next prompt's end: the tool result and chat template."""
CHARS_PER_TOKEN = 4
GROUPS_PER_VERSION = 200
POLICY = "bench"
LAYOUT = "delta"
"""How turns are recorded: ``delta`` (today: what a turn adds to its parent) or ``whole`` (version 1)."""
EPOCH = datetime(2026, 1, 1, tzinfo=UTC)
TICK = timedelta(milliseconds=2)
COLUMNS = (*COPY_COLUMNS, "recorded_at")
TYPES = [*COPY_TYPES, "timestamptz"]
TOKENS_HEADER = struct.Struct("<4sIII")
MATERIALIZER_QUERY = (
    "SELECT position, stream, type, data, tokens, recorded_at FROM events WHERE position > %s "
    "ORDER BY position LIMIT {step}"
)
"""The baseline's read of one page: every column of the rows as stored."""


console = Console(width=None if sys.stdout.isatty() else 132)


# --- the schedule: which event of which episode each position holds ------------------------------


@dataclass(frozen=True, slots=True)
class Schedule:
    episode_at: array[int]
    """Per position - 1: the episode whose event it is."""
    index_at: array[int]
    """Per position - 1: that event's index in its episode (its stream version - 1)."""
    turns_of: array[int]
    """Per episode: its turns. An episode's events: started, its turns, reward, finished."""

    @property
    def events(self) -> int:
        return len(self.episode_at)

    @property
    def episodes(self) -> int:
        return len(self.turns_of)

    @property
    def turns(self) -> int:
        return sum(self.turns_of)


def make_schedule(turns: int, open_episodes: int, seed: int) -> Schedule:
    """Episodes start in order (a group's four one after another) whenever one finishes, so that
    ``open_episodes`` are open at once; each position records the next event of a random open one. At
    least ``turns`` turns: the last group is completed."""
    rng = random.Random(seed)
    episode_at, index_at, turns_of = array("l"), array("B"), array("B")
    running: list[list[int]] = []  # [episode, next event index, events]
    planned = 0

    def start() -> None:
        nonlocal planned
        if planned >= turns and len(turns_of) % GROUP_SIZE == 0:
            return
        count = rng.randint(1, MAX_TURNS)
        turns_of.append(count)
        planned += count
        running.append([len(turns_of) - 1, 0, count + 3])

    while len(running) < open_episodes and (planned < turns or len(turns_of) % GROUP_SIZE):
        start()
    while running:
        slot = rng.randrange(len(running))
        episode = running[slot]
        episode_at.append(episode[0])
        index_at.append(episode[1])
        episode[1] += 1
        if episode[1] == episode[2]:
            running[slot] = running[-1]
            running.pop()
            start()
    return Schedule(episode_at, index_at, turns_of)


# --- the events of one episode (pure: a function of the seed and the episode number) ---------------


@cache
def corpus() -> str:
    """Made-up prose to cut message texts from: compresses somewhat, like prose, but not trivially."""
    rng = random.Random(0)
    words = ["".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 10))) for _ in range(4_000)]
    return " ".join(rng.choices(words, k=50_000))


def text(rng: random.Random, chars: int) -> str:
    source = corpus()
    start = rng.randrange(len(source) - chars)
    return source[start : start + chars]


def token_ids(rng: random.Random, count: int) -> list[int]:
    return [value % VOCAB_SIZE for value in array("I", rng.randbytes(4 * count))]


def random_uuid(rng: random.Random) -> uuid.UUID:
    return uuid.UUID(int=rng.getrandbits(128), version=4)


def episode_id(seed: int, episode: int) -> str:
    return f"b{seed}-{episode // GROUP_SIZE:07d}-{episode % GROUP_SIZE}"


def episode_events(seed: int, episode: int, turns: int, wanted: Container[int]) -> dict[int, Event]:
    """The events of one episode at the indexes in ``wanted`` (the rest are drawn but not built, so an
    episode split between chunks is the same in each)."""
    rng = random.Random(seed * 1_000_003 + episode)
    group = episode // GROUP_SIZE
    event_ids = [random_uuid(rng) for _ in range(turns + 3)]
    events: dict[int, Event] = {}
    if 0 in wanted:
        events[0] = EpisodeStarted(
            event_id=event_ids[0], episode_id=episode_id(seed, episode), task={"id": f"task-{group}"},
            task_id=f"task-{group}", group_id=f"g{seed}-{group}", group_size=GROUP_SIZE, agent="bench.agent",
            policy=POLICY,
        )  # fmt: skip
    prompt = token_ids(rng, rng.randint(*FIRST_PROMPT))
    messages = [
        ChatMessage(role="system", content=text(rng, 600)),
        ChatMessage(role="user", content=text(rng, CHARS_PER_TOKEN * len(prompt) - 600)),
    ]
    parent: tuple[uuid.UUID, int, int] | None = None  # the previous turn: id, messages + reply, ids
    for index in range(1, turns + 1):
        completion = token_ids(rng, rng.randint(*COMPLETION))
        logprobs = [-rng.expovariate(2.0) for _ in completion]
        reply_text = text(rng, CHARS_PER_TOKEN * len(completion))
        call = ToolCall(
            id=f"call_{rng.getrandbits(48):012x}",
            function=FunctionCall(name="search_docs", arguments=f'{{"query": "{text(rng, 40)}"}}'),
        )
        calls = [call] if index < turns else []
        queued, first, total = rng.uniform(0, 50), rng.uniform(20, 200), rng.uniform(300, 3000)
        turn_id = random_uuid(rng)
        if index in wanted:
            # today's writer records what a turn adds to its parent; --layout whole, every turn whole (v1)
            delta = parent is not None and LAYOUT == "delta"
            events[index] = TurnCompleted(
                event_id=event_ids[index], turn_id=turn_id,
                parent_turn_id=parent[0] if parent is not None else None,
                prefix_messages=parent[1] if delta and parent else 0,
                prefix_tokens=parent[2] if delta and parent else 0,
                request=TurnRequest(messages=messages[parent[1]:] if delta and parent else list(messages)),
                reply=TurnReply(
                    text=reply_text, tool_calls=calls, finish_reason="tool_calls" if calls else "stop"
                ),
                prompt_token_ids=prompt[parent[2]:] if delta and parent else prompt,
                completion_token_ids=completion, completion_logprobs=logprobs,
                policy_version=group // GROUPS_PER_VERSION, engine_id="bench-engine-0",
                timings=Timings(queued_ms=queued, first_token_ms=first, total_ms=queued + total),
            )  # fmt: skip
        parent = (turn_id, len(messages) + 1, len(prompt) + len(completion))
        glue = token_ids(rng, rng.randint(*GLUE))
        messages += [
            ChatMessage(role="assistant", content=reply_text, tool_calls=calls or None),
            ChatMessage(role="tool", tool_call_id=call.id, content=text(rng, CHARS_PER_TOKEN * len(glue))),
        ]
        prompt = prompt + completion + glue
    value = rng.random()
    if turns + 1 in wanted:
        events[turns + 1] = RewardAssigned(event_id=event_ids[turns + 1], value=value)
    if turns + 2 in wanted:
        events[turns + 2] = EpisodeFinished(event_id=event_ids[turns + 2], termination="done")
    return events


# --- writing the log -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Chunk:
    seed: int
    first: int
    """The position of its first event."""
    episode_at: array[int]
    index_at: array[int]
    turns: dict[int, int]
    """The turns of each episode it holds events of."""


def chunks(schedule: Schedule, seed: int, size: int) -> Iterator[Chunk]:
    for start in range(0, schedule.events, size):
        episode_at = schedule.episode_at[start : start + size]
        index_at = schedule.index_at[start : start + size]
        turns = {episode: schedule.turns_of[episode] for episode in set(episode_at)}
        yield Chunk(seed, start + 1, episode_at, index_at, turns)


def encode_chunk(chunk: Chunk) -> list[tuple[Any, ...]]:
    """The chunk's rows for ``events`` (``COLUMNS``), in position order. Runs in a worker process."""
    wanted: dict[int, set[int]] = {}
    for episode, index in zip(chunk.episode_at, chunk.index_at, strict=True):
        wanted.setdefault(episode, set()).add(index)
    built = {
        episode: episode_events(chunk.seed, episode, chunk.turns[episode], indexes)
        for episode, indexes in wanted.items()
    }
    rows = []
    for offset, (episode, index) in enumerate(zip(chunk.episode_at, chunk.index_at, strict=True)):
        item = encode_event(built[episode][index])
        position = chunk.first + offset
        stream = f"episode-{episode_id(chunk.seed, episode)}"
        rows.append(
            (position, stream, index + 1, item.event_id, item.type, item.data, item.tokens, "{}",
             item.content_hash, EPOCH + position * TICK)
        )  # fmt: skip
    return rows


@dataclass(slots=True)
class LogStats:
    events: int = 0
    seconds: float = 0.0
    prompt_ids: int = 0
    completion_ids: int = 0
    bytes: int = 0


def write_log(url: str, schedule: Schedule, args: argparse.Namespace) -> LogStats:
    """Worker processes build and encode chunks of events; this process COPYs them in position order, so
    the table's pages are in position order as the store's appends leave them."""
    stats = LogStats()
    started = time.perf_counter()
    statement = f"COPY events ({', '.join(COLUMNS)}) FROM STDIN (FORMAT BINARY)"
    work = chunks(schedule, args.seed, args.chunk_events)
    with (
        ProcessPoolExecutor(args.workers, initializer=_set_layout, initargs=(args.layout,)) as pool,
        psycopg.connect(url) as connection,
    ):
        connection.adapters.register_dumper(JsonText, JsonTextBinaryDumper)
        # At most two chunks a worker in flight: the encoded rows of the whole log would not fit in memory.
        pending: deque[Future[list[tuple[Any, ...]]]] = deque(
            pool.submit(encode_chunk, chunk) for chunk in islice(work, 2 * args.workers)
        )
        while pending:
            rows = pending.popleft().result()
            chunk = next(work, None)
            if chunk is not None:
                pending.append(pool.submit(encode_chunk, chunk))
            with connection.transaction():
                connection.execute("SELECT pg_advisory_xact_lock(%s)", (APPEND_LOCK,))  # the append rule
                with connection.cursor().copy(statement) as copy:
                    copy.set_types(TYPES)
                    for row in rows:
                        copy.write_row(row)
            for row in rows:
                if row[6] is not None:
                    _, prompt, completion, _ = TOKENS_HEADER.unpack_from(row[6])
                    stats.prompt_ids += prompt
                    stats.completion_ids += completion
            stats.events += len(rows)
            if stats.events // args.chunk_events % 25 == 0:
                note(f"log: {stats.events:,} of {schedule.events:,} events written")
    stats.seconds = time.perf_counter() - started
    with psycopg.connect(url, autocommit=True) as connection:
        connection.execute("VACUUM (ANALYZE) events")
        checkpoint(connection)
        size = connection.execute("SELECT pg_total_relation_size('events')").fetchone()
        stats.bytes = int(size[0]) if size else 0
    return stats


# --- server, scratch database, process figures ---------------------------------------------------


def describe_server(url: str) -> str:
    with psycopg.connect(url) as connection:
        version, buffers = connection.execute(
            "SELECT current_setting('server_version'), current_setting('shared_buffers')"
        ).fetchone() or ("?", "?")
    return f"PostgreSQL {version}, shared_buffers={buffers}"


def proc_stat(pid: int) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None


def server_cpu(pid: int | None) -> float | None:
    """User + system CPU seconds of a server and all its processes, live and reaped (Linux /proc)."""
    fields = proc_stat(pid) if pid is not None else None
    if pid is None or fields is None:
        return None
    ticks = sum(int(value) for value in fields[11:15])
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        with suppress(OSError, ValueError):
            for child in task.read_text().split():
                child_fields = proc_stat(int(child))
                if child_fields is not None:
                    ticks += int(child_fields[11]) + int(child_fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def memory_kb(name: str) -> int | None:
    """A field of /proc/self/status in kB (VmRSS, VmHWM), or None off Linux."""
    try:
        found = re.search(rf"^{name}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.MULTILINE)
    except OSError:
        return None
    return int(found[1]) if found else None


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux 4.0+); False where that cannot be done."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


# --- the measurements ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Measurement:
    label: str
    step: int
    events: int
    turns: int
    seconds: float
    py_cpu: float
    pg_cpu: float | None
    rss_mb: float | None = None
    """The peak resident memory of this process during the timed part."""
    rss_growth_mb: float | None = None
    """That peak over the resident memory just before."""
    worker_cpu: float | None = None
    """CPU seconds of the fold's worker processes (part of ``py_cpu``; None: none ran)."""
    worker_rss_mb: float | None = None
    """The larger worker's peak resident memory (a fork of this process: it counts the pages it shares)."""

    @property
    def turn_rate(self) -> float:
        return self.turns / self.seconds

    @property
    def event_rate(self) -> float:
        return self.events / self.seconds


@dataclass(frozen=True, slots=True)
class Produced:
    turns: int
    with_parent: int
    episodes: int
    samples: int
    batches: int
    batched_samples: int
    outbox: int
    megabytes: float
    tally: WriteTally


@dataclass(slots=True)
class WriteTally:
    """What the rebuild's steps wrote, by kind of statement."""

    steps: int = 0
    copied: int = 0
    """Rows COPYed: new episodes, turns, samples, batches and outbox rows."""
    episode_updates: int = 0
    """Episodes finished in a later step than they started in: one UPDATE each."""
    sample_updates: int = 0
    """Samples inserted in an earlier step than their group became ready, or than their batch."""


class TallyingMaterializer(Materializer):
    """The materializer, counting the rows of each step's writes (a few ``len`` calls a step)."""

    def __init__(self, database_url: str, config: MaterializerConfig) -> None:
        super().__init__(database_url, config)
        self.tally = WriteTally()

    async def _commit(self, writes: Writes, position: int) -> None:
        tally = self.tally
        tally.steps += 1
        tally.copied += sum(
            len(rows)
            for rows in (writes.episodes, writes.turns, writes.samples, writes.batches, writes.outbox)
        )
        tally.episode_updates += len(writes.finished)
        tally.sample_updates += len(writes.ready) + len(writes.batched)
        await super()._commit(writes, position)


@dataclass(slots=True)
class StepResult:
    step: int
    measurements: list[Measurement] = field(default_factory=list)
    """In the order they ran: SELECT, rebuild, SELECT, ..."""
    produced: list[Produced] = field(default_factory=list)

    @property
    def baseline(self) -> Measurement:
        return max((m for m in self.measurements if m.label == "SELECT"), key=lambda scan: scan.turn_rate)

    @property
    def rebuilds(self) -> list[tuple[Measurement, Produced]]:
        timed = [m for m in self.measurements if m.label.startswith("rebuild")]
        return list(zip(timed, self.produced, strict=True))


async def scan(url: str, step: int, schedule: Schedule, server_pid: int | None) -> Measurement:
    """The baseline: the materializer's read, page after page, into tuples; nothing else."""
    query = MATERIALIZER_QUERY.format(step=int(step))
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as connection:
        py_cpu, pg_cpu = time.process_time(), server_cpu(server_pid)
        started = time.perf_counter()
        position, events = 0, 0
        while True:
            rows = await (await connection.execute(query, (position,))).fetchall()
            if not rows:
                break
            events += len(rows)
            position = rows[-1][0]
        seconds = time.perf_counter() - started
        pg_after = server_cpu(server_pid)
    if events != schedule.events:
        raise RuntimeError(f"the SELECT read {events:,} events; the log holds {schedule.events:,}")
    pg = None if pg_cpu is None or pg_after is None else pg_after - pg_cpu
    measurement = Measurement(
        "SELECT", step, events, schedule.turns, seconds, time.process_time() - py_cpu, pg
    )
    note(
        f"SELECT, step {step:,}: {events:,} rows in {seconds:.1f} s: {measurement.event_rate:,.0f} rows/s, "
        f"{measurement.turn_rate:,.0f} turns/s"
    )
    return measurement


FOLD_WORKER: dict[str, bool | None] = {"auto": None, "on": True, "off": False}
"""``--fold-worker``: ``Materializer.fold_worker`` (auto: worker processes when the log is far ahead)."""


def children_cpu() -> float:
    """CPU seconds of this process's children that have ended (the fold's workers, once joined)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


async def rebuild(
    url: str,
    step: int,
    schedule: Schedule,
    server_pid: int | None,
    name: str,
    profiler: cProfile.Profile | None = None,
    fold_worker: str = "auto",
    search_cost: bool = False,
) -> tuple[Measurement, Produced]:
    """``turnstile rematerialize --name NAME`` in this process; only ``catch_up()`` is timed. With
    ``search_cost``, then what its turns would add to the live materializer's search index (0023's way and
    0024's)."""
    materializer = TallyingMaterializer(url, MaterializerConfig(name=name, step_events=step))
    materializer.fold_worker = FOLD_WORKER[fold_worker]
    await materializer.open(create=True)
    try:
        gc.collect()
        rss_before = memory_kb("VmRSS")
        exact_peak = reset_peak_rss()
        children = children_cpu()
        py_cpu, pg_cpu = time.process_time(), server_cpu(server_pid)
        started = time.perf_counter()
        if profiler is not None:
            profiler.enable()
        events = await materializer.catch_up()
        if profiler is not None:
            profiler.disable()
        seconds = time.perf_counter() - started
        py_cpu, pg_after = time.process_time() - py_cpu, server_cpu(server_pid)
        worker_cpu = children_cpu() - children  # the workers are joined when catch_up returns
        peak = memory_kb("VmHWM") if exact_peak else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    finally:
        await materializer.close()
    if events != schedule.events:
        raise RuntimeError(f"the rebuild folded {events:,} events; the log holds {schedule.events:,}")
    peak_mb = None if peak is None else peak / 1024
    growth_mb = None if peak is None or rss_before is None else (peak - rss_before) / 1024
    pg = None if pg_cpu is None or pg_after is None else pg_after - pg_cpu
    worker_kb = materializer.worker_peak_rss_kb
    label = "rebuild" if fold_worker == "auto" else f"rebuild, worker {fold_worker}"
    measurement = Measurement(
        label, step, events, schedule.turns, seconds, py_cpu + worker_cpu, pg, peak_mb, growth_mb,
        worker_cpu if worker_kb is not None else None, None if worker_kb is None else worker_kb / 1024,
    )  # fmt: skip
    schema = MaterializerConfig(name=name).schema
    if search_cost:
        await measure_search_index(url, schema, step, seconds, server_pid)
    produced = await count_and_drop(url, schema, name, materializer.tally)
    note(
        f"rebuild, step {step:,}: {events:,} events in {seconds:.1f} s: {measurement.event_rate:,.0f} "
        f"events/s, {measurement.turn_rate:,.0f} turns/s; {produced.samples:,} samples, "
        f"{produced.batches:,} batches"
    )
    return measurement, produced


async def measure_search_index(
    url: str, schema: str, step: int, rebuild_seconds: float, server_pid: int | None
) -> None:
    """What the live materializer's search index costs it a turn, 0023's way against 0024's, on the rebuild's
    turns (``schema``), ``step`` turns a statement (a step's turns are fewer: ``step`` counts events), the
    three kinds alternating, each rolled back:

    - plain: the turns into a copy of ``turn_rows`` without a trigger (what writing them costs anyway);
    - 0023: into a copy with 0023's trigger (``turnstile_turn_search`` v1, renamed), which writes every
      turn's words into ``turn_search`` when its episode finishes;
    - 0024: ``turnstile_index_turns`` of the same turns (the tail, while their episodes run), then the turns
      into ``public.turn_rows``, whose trigger (v2) finds them indexed and passes over them; each statement
      timed on its own."""
    turns = sql.SQL("SELECT * FROM {}.turn_rows WHERE position > %s ORDER BY position LIMIT %s").format(
        sql.Identifier(schema)
    )
    old_trigger = sql_object("turnstile_turn_search", 1).replace(
        "turnstile_turn_search()", "bench_turn_search_v1()"
    )
    kinds = {
        "plain": [sql.SQL("INSERT INTO bench_turn_rows_plain ") + turns],
        "0023": [sql.SQL("INSERT INTO bench_turn_rows_v1 ") + turns],
        "0024": [
            sql.SQL("SELECT turnstile_index_turns(%s::bigint[])"),  # as the materializer calls it
            sql.SQL("INSERT INTO public.turn_rows ") + turns,
        ],
    }
    seconds = {kind: [0.0] * len(statements) for kind, statements in kinds.items()}
    pg_cpu = {kind: [0.0] * len(statements) for kind, statements in kinds.items()}
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as connection:
        await connection.execute(old_trigger)
        for table, trigger in (("plain", None), ("v1", "bench_turn_search_v1")):
            await connection.execute(
                f"CREATE TABLE bench_turn_rows_{table} (LIKE public.turn_rows INCLUDING ALL)"
            )
            if trigger:
                await connection.execute(
                    f"CREATE TRIGGER bench_search AFTER INSERT ON bench_turn_rows_{table} REFERENCING NEW "
                    f"TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION {trigger}()"
                )
        positions = [row[0] for row in await (await connection.execute(
            sql.SQL("SELECT position FROM {}.turn_rows ORDER BY position").format(sql.Identifier(schema))
        )).fetchall()]  # fmt: skip
        for start in range(0, len(positions), step):
            after = positions[start - 1] if start else 0
            for kind, statements in kinds.items():
                async with connection.transaction(force_rollback=True):
                    for number, statement in enumerate(statements):
                        tail = number == 0 and kind == "0024"
                        params = (positions[start : start + step],) if tail else (after, step)
                        started, cpu = time.perf_counter(), server_cpu(server_pid)
                        await connection.execute(statement, params)
                        seconds[kind][number] += time.perf_counter() - started
                        cpu_after = server_cpu(server_pid)
                        pg_cpu[kind][number] += 0.0 if cpu is None or cpu_after is None else cpu_after - cpu
        await connection.execute("DROP TABLE bench_turn_rows_plain, bench_turn_rows_v1")
        await connection.execute("DROP FUNCTION bench_turn_search_v1()")
    total = {kind: sum(values) for kind, values in seconds.items()}
    per_turn = {kind: sum(cpu) / len(positions) * 1e6 for kind, cpu in pg_cpu.items()}
    for kind in ("0023", "0024"):
        added = total[kind] - total["plain"]
        note(
            f"search index {kind}: {len(positions):,} turns written in {total[kind]:.2f} s, "
            f"{total['plain']:.2f} s without it: {added:.2f} s more, {added / rebuild_seconds:.1%} of the "
            f"rebuild's {rebuild_seconds:.1f} s; PostgreSQL CPU {per_turn[kind]:,.0f} us a turn, "
            f"{per_turn['plain']:,.0f} without (embedded server only)"
        )
    tail, finish = (cpu / len(positions) * 1e6 for cpu in pg_cpu["0024"])
    note(
        f"search index 0024, by statement: turnstile_index_turns {seconds['0024'][0]:.2f} s "
        f"({tail:,.0f} us of PostgreSQL a turn), then turn_rows with the trigger passing over them "
        f"{seconds['0024'][1]:.2f} s ({finish:,.0f} us a turn)"
    )
    summary(
        "materialize", "turn writes with the search index (0024)", f"{total['0024']:.2f} s",
        f"0023's trigger {total['0023']:.2f} s", total["0024"] / total["0023"], None,
    )  # fmt: skip
    summary(
        "materialize", "turn writes with the search trigger (0023)", f"{total['0023']:.2f} s",
        f"without it {total['plain']:.2f} s", total["0023"] / total["plain"], None,
    )  # fmt: skip
    added = total["0024"] - total["plain"]
    summary(
        "materialize", "rebuild time plus the search index's", f"{rebuild_seconds + added:.1f} s",
        f"the rebuild {rebuild_seconds:.1f} s", (rebuild_seconds + added) / rebuild_seconds, None,
    )  # fmt: skip


async def count_and_drop(url: str, schema: str, name: str, tally: WriteTally) -> Produced:
    """What a rebuild made; then its schema, registration and checkpoint go (they take gigabytes)."""

    def table(relation: str) -> sql.Composed:
        return sql.SQL("{}.{}").format(sql.Identifier(schema), sql.Identifier(relation))

    counts = sql.SQL(
        "SELECT (SELECT count(*) FROM {turns}), "
        "(SELECT count(*) FROM {turns} WHERE parent_turn_id IS NOT NULL), (SELECT count(*) FROM {episodes}), "
        "(SELECT count(*) FROM {samples}), (SELECT count(*) FROM {batches}), "
        "(SELECT coalesce(sum(samples), 0) FROM {batches}), (SELECT count(*) FROM {outbox})"
    ).format(
        turns=table("turns"),
        episodes=table("episodes"),
        samples=table("samples"),
        batches=table("batches"),
        outbox=table("batch_outbox"),
    )
    sizes = sql.SQL(" + ").join(
        sql.SQL("pg_total_relation_size({})").format(sql.Literal(f"{schema}.{t}")) for t in READ_MODEL_TABLES
    )
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as connection:
        row = await (await connection.execute(counts)).fetchone()
        size = await (await connection.execute(sql.SQL("SELECT {}").format(sizes))).fetchone()
        async with connection.transaction():
            await connection.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))
            await connection.execute("DELETE FROM materializers WHERE name = %s", (name,))
            await connection.execute("DELETE FROM checkpoints WHERE name = %s", (f"materializer:{name}",))
        with suppress(psycopg.errors.InsufficientPrivilege):
            await connection.execute("CHECKPOINT")
    assert row is not None
    assert size is not None
    turns, with_parent, episodes, samples, batches, batched, outbox = (int(value) for value in row)
    megabytes = int(size[0]) / 2**20
    return Produced(turns, with_parent, episodes, samples, batches, batched, outbox, megabytes, tally)


async def measure(
    url: str, schedule: Schedule, server_pid: int | None, args: argparse.Namespace
) -> list[StepResult]:
    results: list[StepResult] = []
    for step in args.step_events:
        result = StepResult(step)
        for round_ in range(args.repeat):
            result.measurements.append(await scan(url, step, schedule, server_pid))
            for mode in args.fold_worker:
                first = not results and not result.produced
                measurement, produced = await rebuild(
                    url, step, schedule, server_pid, f"bench_{step}_{round_}_{mode}", fold_worker=mode,
                    search_cost=first,
                )  # fmt: skip
                result.measurements.append(measurement)
                result.produced.append(produced)
        result.measurements.append(await scan(url, step, schedule, server_pid))
        results.append(result)
    if args.profile:
        step = args.step_events[0]
        profiler = cProfile.Profile()
        await rebuild(url, step, schedule, server_pid, "bench_profile", profiler)
        profiler.dump_stats(args.profile)
        for order in ("cumulative", "tottime"):
            print(f"\n--- cProfile of the rebuild at step {step:,}, top {args.profile_top} by {order} ---")
            stats = pstats.Stats(profiler, stream=sys.stdout)
            stats.strip_dirs().sort_stats(order).print_stats(args.profile_top)
        note(f"profile saved to {args.profile} (python -m pstats {args.profile})")
    return results


# --- the report ----------------------------------------------------------------------------------


def print_report(results: Sequence[StepResult], schedule: Schedule) -> None:
    table = Table(
        title=f"rebuild of {schedule.turns:,} turns ({schedule.events:,} events) against a raw SELECT",
        caption="x SELECT: turns/s ÷ the faster SELECT's turns/s at the same step; (+): over the RSS before",
    )
    columns = ["measurement", "step", "seconds", "events/s", "turns/s", "x SELECT", "peak RSS MB (+)"]
    for column in [*columns, "CPU s py", "of which worker", "worker RSS MB", "CPU s pg"]:
        table.add_column(column, justify="right")
    for result in results:
        baseline = result.baseline
        for item in result.measurements:
            table.add_row(
                item.label,
                f"{item.step:,}",
                f"{item.seconds:.1f}",
                f"{item.event_rate:,.0f}",
                f"{item.turn_rate:,.0f}",
                f"{item.turn_rate / baseline.turn_rate:.2f}",
                rss_text(item),
                f"{item.py_cpu:.1f}",
                "-" if item.worker_cpu is None else f"{item.worker_cpu:.1f}",
                "-" if item.worker_rss_mb is None else f"{item.worker_rss_mb:,.0f}",
                "-" if item.pg_cpu is None else f"{item.pg_cpu:.1f}",
            )
    console.print(table)
    for result in results:
        for measurement, made in result.rebuilds:
            print(
                f"rebuild at step {result.step:,} made {made.episodes:,} episodes, {made.turns:,} turns "
                f"({made.with_parent:,} with a parent), {made.samples:,} samples, {made.batches:,} batches "
                f"holding {made.batched_samples:,} samples, {made.outbox:,} outbox rows; read models "
                f"{made.megabytes:,.0f} MB ({made.megabytes * 2**20 / measurement.seconds / 1e6:,.1f} MB/s)"
            )
            tally = made.tally
            print(
                f"  its {tally.steps:,} steps COPYed {tally.copied:,} rows and UPDATEd "
                f"{tally.episode_updates:,} episodes and {tally.sample_updates:,} samples (set-based: one "
                "UPDATE per table and step)"
            )
    print(f"target: rebuild >= {TARGET_RATIO:.2f} x SELECT turns/s")
    for result in results:
        for measurement, _ in result.rebuilds:
            ratio = measurement.turn_rate / result.baseline.turn_rate
            verdict = "met" if ratio >= TARGET_RATIO else "NOT met"
            print(
                f"measured: {ratio:.2f} x SELECT at step {result.step:,} "
                f"({measurement.turn_rate:,.0f} vs {result.baseline.turn_rate:,.0f} turns/s): {verdict}"
            )


def rss_text(item: Measurement) -> str:
    if item.rss_mb is None:
        return "-"
    growth = "" if item.rss_growth_mb is None else f" (+{item.rss_growth_mb:,.0f})"
    return f"{item.rss_mb:,.0f}{growth}"


def describe_log(schedule: Schedule, log: LogStats) -> str:
    return (
        f"log: {schedule.events:,} events, {schedule.episodes:,} episodes, {schedule.turns:,} turns "
        f"(mean prompt {log.prompt_ids / schedule.turns:,.0f} ids, completion "
        f"{log.completion_ids / schedule.turns:,.0f} ids); events table {log.bytes / 2**20:,.0f} MB; "
        f"written in {log.seconds:.1f} s ({log.events / log.seconds:,.0f} events/s)"
    )


def parse_steps(text: str) -> list[int]:
    steps = [int(part) for part in text.split(",") if part.strip()]
    if not steps or min(steps) < 1:
        raise argparse.ArgumentTypeError("step sizes are positive integers, e.g. 500,2000,10000")
    return steps


def parse_modes(text: str) -> list[str]:
    modes = [part.strip() for part in text.split(",") if part.strip()]
    if not modes or any(mode not in FOLD_WORKER for mode in modes):
        raise argparse.ArgumentTypeError("fold worker modes are auto, on and off, e.g. on,off")
    return modes


def _set_layout(layout: str) -> None:
    global LAYOUT
    LAYOUT = layout


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    add = parser.add_argument
    add("--turns", type=int, default=1_000_000, help="turns in the log (default 1000000)")
    add("--quick", action="store_true", help="a smaller run: 50000 turns")
    default_step = MaterializerConfig().step_events
    add(
        "--step-events",
        type=parse_steps,
        default=[default_step],
        help=f"the materializer's step sizes to measure, e.g. 500,2000,10000 (default {default_step})",
    )
    add("--repeat", type=int, default=1, help="rebuilds per step size (default 1)")
    add(
        "--fold-worker",
        type=parse_modes,
        default=["auto"],
        help="the fold's worker processes: auto (the materializer's choice), on, off, or several, e.g. "
        "on,off (each rebuilds in turn)",
    )
    add("--open", type=int, default=256, help="episodes open at once as the log is recorded (default 256)")
    add("--workers", type=int, default=os.cpu_count() or 1, help="processes encoding the log (default: CPUs)")
    add("--chunk-events", type=int, default=20_000, help="events per encoded chunk and COPY (default 20000)")
    add("--profile", type=Path, default=None, help="one more rebuild under cProfile; its stats go to FILE")
    add("--profile-top", type=int, default=15, help="functions to print from the profile (default 15)")
    add("--seed", type=int, default=1234, help="seed of the log (default 1234)")
    add(
        "--layout",
        choices=("delta", "whole"),
        default="delta",
        help="turns as recorded today (delta: what each adds to its parent) or whole (version 1)",
    )
    add("--tmp-dir", type=Path, default=None, help="parent of the embedded server's temporary directory")
    args = parser.parse_args(argv)
    if args.quick:
        args.turns = 50_000
    if min(args.turns, args.repeat, args.open, args.workers, args.chunk_events, args.profile_top) < 1:
        parser.error("--turns, --repeat, --open, --workers, --chunk-events and --profile-top must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    note(
        f"Python {platform.python_version()}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} "
        "(other work on the machine skews every number)"
    )
    started = time.perf_counter()
    schedule = make_schedule(args.turns, args.open, args.seed)
    note(f"scheduled {schedule.events:,} events in {time.perf_counter() - started:.1f} s")
    with postgres_server(args.tmp_dir) as (server_url, server_pid), scratch_database(server_url) as url:
        note(describe_server(url))
        log = write_log(url, schedule, args)
        note(describe_log(schedule, log))
        results = asyncio.run(measure(url, schedule, server_pid, args))
    print_report(results, schedule)
    return 0


if __name__ == "__main__":
    sys.exit(main())
