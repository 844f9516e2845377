"""Durable ingest throughput of the event store: TurnCompleted appends per second, against raw COPY.

What it measures, in one run on one PostgreSQL server (fsync on, so every commit is durable):

1. ``COPY`` baseline: the very rows the event store would write (data, tokens and hash encoded
   beforehand, so serialization is not timed) are COPYed, in the same binary COPY format the store uses, into
   a scratch table with the columns of ``events`` (their types and storage: whether PostgreSQL tries to
   compress a large value; ``--default-storage-baseline``: the types' default storage, as events had before
   migration 0015) but no indexes (``--indexed-baseline``: with them), one transaction per
   ``--copy-chunk`` rows: about as fast as one client can load these rows.
2. ``EventStore.append`` at each level of ``--levels``: that many asyncio tasks, each owning one
   ``episode-<uuid>`` stream and appending one event per call with its expected version. Timed: model
   encoding, the group-commit writer (append lock, one INSERT, commit: one round trip for a batch of up
   to 32 events; a COPY above that) and the waiting callers. ``--copy-path``: each level also with every
   batch COPYed (four round trips a transaction), the store before batches went out in one round trip.

Reading the table: "x COPY" is events/s divided by the rows/s of the COPY baseline measured in the same
round (``--repeat`` runs several rounds and shows the median one; on a small, shared machine the spread
between rounds is large, so prefer ``--repeat 3`` before drawing conclusions). 1.00 would mean the store
costs nothing over a bulk load; what is missing is the price of ordering (one append lock per batch),
the idempotency and version look-ups, encoding, and asyncio round trips. At concurrency 1 every append
is its own commit (one fsync each), so expect a small ratio there; at high concurrency the writer groups
hundreds of appends per transaction ("events/tx"). The target is a ratio of at least 0.70 at 512.

The payload per event: about 2,000 characters of chat messages (system, user, an assistant tool call and
a tool result; varied per event), 1,000 prompt token ids, 200 completion token ids and 200 logprobs,
from a fixed seed. ``--delta-turns T``: episodes of T turns as an agent records them (DESIGN.md, a turn
records what it adds to its parent): the first turn whole as above, each later one only its new tool result
(800 characters, ``DELTA_PROMPT_TOKENS`` new prompt ids) and its reply (a tool call, 200 completion ids and
logprobs); each appender then writes whole episodes, each a stream of its own, one after the other.
Every event is built before the clock starts; the same events are used by every measurement, and the
tables are truncated before each one so every level starts from an empty log.

After each measurement the table's size on disk (``pg_total_relation_size``: heap, TOAST and indexes) and
the WAL written are divided by the events recorded: "B/event" and "WAL B/event". ``--without-index NAME``:
each level again with that index of ``events`` dropped (created again after), what it costs the appends.

Server: ``TURNSTILE_DATABASE_URL`` if set, else an embedded PostgreSQL in a temporary directory (under
``--tmp-dir``; it should be on a real disk, since fsync on tmpfs is free). Either way the run works in
a scratch database ``bench_<random>`` that is dropped at the end.

    python bench/ingest.py                      # defaults: levels 1,64,512
    python bench/ingest.py --events 50000 --repeat 3 --levels 64,512
    python bench/ingest.py --levels 64,512 --delta-turns 32 --events 32768   # docs/scale.md
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import string
import sys
import time
import uuid
from array import array
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import psycopg
from rich.console import Console
from rich.table import Table

from consumers.runtime import run as run_service
from consumers.runtime import tune_gc
from pipeline.log import EventStore, encode_event
from pipeline.log.store import COPY_COLUMNS, COPY_TYPES, JsonText, JsonTextBinaryDumper
from schemas import ChatMessage, FunctionCall, ToolCall, TurnCompleted, TurnReply, TurnRequest

from common import CpuMeter, Processes, cpu_text, machine, note, postgres_server, scratch_database
from common import summary as print_summary

VOCAB_SIZE = 151_936
PROMPT_TOKENS = 1_000
COMPLETION_TOKENS = 200
DELTA_PROMPT_TOKENS = 250
"""New prompt ids of a turn that continues its parent: the chat template's glue and an 800-character tool
result."""
TARGET_RATIO = 0.70
TARGET_LEVEL = 512
BASELINE = "COPY"
BARE_COLUMNS = (
    "position bigint, stream text, version int, event_id uuid, type text, data jsonb, tokens bytea, "
    "metadata jsonb, content_hash bytea"
)
"""The columns of ``events`` that the store writes, with their types, without indexes or constraints."""
STORAGE_MODES = {"p": "PLAIN", "e": "EXTERNAL", "m": "MAIN", "x": "EXTENDED"}
"""``pg_attribute.attstorage`` codes and their names in ``ALTER TABLE ... SET STORAGE``."""

# Rich assumes 80 columns when the output is not a terminal; the table with --repeat needs more.
console = Console(width=None if sys.stdout.isatty() else 160)


@dataclass(frozen=True, slots=True)
class Measurement:
    label: str
    rows: int
    seconds: float
    transactions: int
    cpu_us: dict[str, float]
    """CPU microseconds per event (row) by process: this one, and PostgreSQL where it is embedded."""
    size: Size
    ratio: float = 1.0
    """events/s divided by the rows/s of the COPY baseline measured in the same round."""

    @property
    def rate(self) -> float:
        return self.rows / self.seconds


@dataclass(frozen=True, slots=True)
class Size:
    """What the rows of a measurement take, per row: on disk (heap, TOAST and indexes) and in the WAL."""

    total: float
    table: float
    """Heap and TOAST."""
    indexes: float
    wal: float


# --- payload -------------------------------------------------------------------------------------


def make_words(rng: random.Random, count: int = 4_000) -> list[str]:
    """A made-up vocabulary: text built from it compresses somewhat, like prose, but not trivially."""
    return ["".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 10))) for _ in range(count)]


def make_text(rng: random.Random, words: Sequence[str], chars: int) -> str:
    text = ""
    while len(text) < chars:  # words average 7 characters with their space: one round nearly always does
        text += " ".join(rng.choices(words, k=chars // 5 + 8)) + " "
    return text[:chars]


def make_messages(rng: random.Random, words: Sequence[str]) -> list[ChatMessage]:
    """A system prompt, a user task, an assistant tool call and its result: about 2,000 characters."""
    call_id = f"call_{rng.getrandbits(48):012x}"
    arguments = f'{{"query": "{make_text(rng, words, 60)}", "limit": {rng.randint(1, 50)}}}'
    call = ToolCall(id=call_id, function=FunctionCall(name="search_docs", arguments=arguments))
    return [
        ChatMessage(role="system", content=make_text(rng, words, 400)),
        ChatMessage(role="user", content=make_text(rng, words, 700)),
        ChatMessage(role="assistant", content=None, tool_calls=[call]),
        ChatMessage(role="tool", tool_call_id=call_id, content=make_text(rng, words, 800)),
    ]


def token_ids(rng: random.Random, count: int) -> list[int]:
    return [value % VOCAB_SIZE for value in array("I", rng.randbytes(4 * count))]


def make_turn(rng: random.Random, words: Sequence[str]) -> TurnCompleted:
    return TurnCompleted(
        request=TurnRequest(messages=make_messages(rng, words)),
        reply=TurnReply(text=make_text(rng, words, 120), finish_reason="stop"),
        prompt_token_ids=token_ids(rng, PROMPT_TOKENS),
        completion_token_ids=token_ids(rng, COMPLETION_TOKENS),
        completion_logprobs=[-rng.expovariate(2.0) for _ in range(COMPLETION_TOKENS)],
        policy_version=rng.randint(0, 100),
        engine_id="bench-engine-0",
        event_id=uuid.UUID(int=rng.getrandbits(128), version=4),
        turn_id=uuid.UUID(int=rng.getrandbits(128), version=4),
    )


def make_delta_turn(rng: random.Random, words: Sequence[str], parent: TurnCompleted) -> TurnCompleted:
    """A turn that continues ``parent`` after its tool call: only the tool's result and the new reply are
    recorded, the rest is counted in ``prefix_messages`` and ``prefix_tokens``."""
    call = ToolCall(
        id=f"call_{rng.getrandbits(48):012x}",
        function=FunctionCall(name="search_docs", arguments=f'{{"query": "{make_text(rng, words, 60)}"}}'),
    )
    previous_call = parent.reply.tool_calls[0].id if parent.reply.tool_calls else call.id
    return TurnCompleted(
        parent_turn_id=parent.turn_id,
        prefix_messages=parent.prefix_messages + len(parent.request.messages) + 1,
        prefix_tokens=parent.prefix_tokens + len(parent.prompt_token_ids) + len(parent.completion_token_ids),
        request=TurnRequest(
            messages=[
                ChatMessage(role="tool", tool_call_id=previous_call, content=make_text(rng, words, 800))
            ]
        ),
        reply=TurnReply(text=make_text(rng, words, 120), tool_calls=[call], finish_reason="tool_calls"),
        prompt_token_ids=token_ids(rng, DELTA_PROMPT_TOKENS),
        completion_token_ids=token_ids(rng, COMPLETION_TOKENS),
        completion_logprobs=[-rng.expovariate(2.0) for _ in range(COMPLETION_TOKENS)],
        policy_version=parent.policy_version,
        engine_id=parent.engine_id,
        event_id=uuid.UUID(int=rng.getrandbits(128), version=4),
        turn_id=uuid.UUID(int=rng.getrandbits(128), version=4),
    )


def make_events(count: int, seed: int, episode_turns: int = 0) -> list[TurnCompleted]:
    """``count`` turns; with ``episode_turns``, episodes of that many one after the other, each a whole
    turn followed by turns that continue it."""
    rng = random.Random(seed)
    words = make_words(rng)
    events: list[TurnCompleted] = []
    for index in range(count):
        whole = not episode_turns or index % episode_turns == 0
        events.append(make_turn(rng, words) if whole else make_delta_turn(rng, words, events[-1]))
    return events


def episodes_of(
    events: Sequence[TurnCompleted], concurrency: int, index: int, episode_turns: int
) -> list[Sequence[TurnCompleted]]:
    """What appender ``index`` of ``concurrency`` writes, one stream each: every ``concurrency``-th event
    in one stream, or with ``episode_turns`` every ``concurrency``-th episode."""
    if not episode_turns:
        return [events[index::concurrency]]
    episodes = [events[start : start + episode_turns] for start in range(0, len(events), episode_turns)]
    return episodes[index::concurrency]


# --- server and scratch database -----------------------------------------------------------------


def describe_server(url: str) -> str:
    with psycopg.connect(url) as connection:
        version, fsync, sync_commit = connection.execute(
            "SELECT current_setting('server_version'), current_setting('fsync'), "
            "current_setting('synchronous_commit')"
        ).fetchone() or ("?", "?", "?")
    return f"PostgreSQL {version}, fsync={fsync}, synchronous_commit={sync_commit}"


# --- the COPY baseline ---------------------------------------------------------------------------


def baseline_rows(events: Sequence[TurnCompleted], streams: int) -> list[tuple[Any, ...]]:
    """The rows the store would write for these events spread over ``streams`` streams (COPY_COLUMNS)."""
    names = [f"episode-{uuid.uuid4().hex}" for _ in range(streams)]
    rows = []
    for index, event in enumerate(events):
        item = encode_event(event)
        version = index // streams + 1
        rows.append(
            (
                index + 1,
                names[index % streams],
                version,
                item.event_id,
                item.type,
                item.data,
                item.tokens,
                "{}",
                item.content_hash,
            )
        )
    return rows


async def create_baseline_table(url: str, indexed: bool, default_storage: bool) -> None:
    columns = "LIKE events INCLUDING ALL" if indexed else BARE_COLUMNS
    if indexed and default_storage:
        columns += " EXCLUDING STORAGE"
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as connection:
        await connection.execute(f"CREATE TABLE copy_baseline ({columns})")
        if default_storage:
            return
        # Each column stored as in events (migration 0015 stores tokens without a compression attempt):
        # the baseline writes the same bytes the same way, so the ratio is the store's own overhead.
        storage = await connection.execute(
            "SELECT attname, attstorage FROM pg_attribute WHERE attrelid = 'events'::regclass "
            "AND attname = ANY(%s)",
            (list(COPY_COLUMNS),),
        )
        for column, code in await storage.fetchall():
            mode = STORAGE_MODES[code]
            await connection.execute(f"ALTER TABLE copy_baseline ALTER COLUMN {column} SET STORAGE {mode}")


async def wal_position(url: str) -> str:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as connection:
        row = await (await connection.execute("SELECT pg_current_wal_lsn()::text")).fetchone()
    return str(row[0]) if row else "0/0"


async def measure_size(url: str, table: str, rows: int, wal_before: str) -> Size:
    """Bytes per row of ``table`` on disk and of the WAL written since ``wal_before``."""
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as connection:
        cursor = await connection.execute(
            "SELECT pg_total_relation_size(%s), pg_table_size(%s), pg_indexes_size(%s), "
            "pg_wal_lsn_diff(pg_current_wal_lsn(), %s::pg_lsn)",
            (table, table, table, wal_before),
        )
        total, heap, indexes, wal = await cursor.fetchone() or (0, 0, 0, 0)
    return Size(*(float(value) / max(rows, 1) for value in (total, heap, indexes, wal)))


async def truncate(url: str, table: str) -> None:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as connection:
        await connection.execute(f"TRUNCATE {table}")
        try:  # so that no measurement pays for writing out the previous one's pages
            await connection.execute("CHECKPOINT")
        except psycopg.errors.InsufficientPrivilege:
            note("no CHECKPOINT between measurements (needs superuser or pg_checkpoint)")


async def copy_baseline(
    url: str, rows: Sequence[tuple[Any, ...]], chunk: int, meter: CpuMeter
) -> Measurement:
    await truncate(url, "copy_baseline")
    statement = f"COPY copy_baseline ({', '.join(COPY_COLUMNS)}) FROM STDIN (FORMAT BINARY)"
    transactions = 0
    wal_before = await wal_position(url)
    async with await psycopg.AsyncConnection.connect(url) as connection:
        connection.adapters.register_dumper(JsonText, JsonTextBinaryDumper)
        meter.start()
        started = time.perf_counter()
        for start in range(0, len(rows), chunk):
            async with connection.transaction(), connection.cursor().copy(statement) as copy:
                copy.set_types(COPY_TYPES)
                for row in rows[start : start + chunk]:
                    await copy.write_row(row)
            transactions += 1
        seconds = time.perf_counter() - started
    cpu_us = meter.per(len(rows))
    size = await measure_size(url, "copy_baseline", len(rows), wal_before)
    return Measurement(BASELINE, len(rows), seconds, transactions, cpu_us, size)


UNGUARDED = "without the append guard"
WITHOUT = "without"
COPIED = "COPY path"

# --- the event store -----------------------------------------------------------------------------


async def appender(store: EventStore, episodes: Sequence[Sequence[TurnCompleted]]) -> None:
    """One writer of one stream at a time: one event per append, each expecting the version the last one
    left."""
    for events in episodes:
        stream = f"episode-{uuid.uuid4().hex}"
        for version, event in enumerate(events):
            await store.append(stream, [event], expected_version=version)


async def warm_up(store: EventStore, event: TurnCompleted) -> None:
    """Start the writer and open its connection before the clock starts."""
    spare = event.model_copy(update={"event_id": uuid.uuid4()})
    await store.append(f"episode-warmup-{uuid.uuid4().hex}", [spare], expected_version=0)


async def store_level(
    url: str,
    events: Sequence[TurnCompleted],
    concurrency: int,
    meter: CpuMeter,
    *,
    guard: bool = True,
    one_round_trip: bool = True,
    episode_turns: int = 0,
) -> Measurement:
    await truncate(url, "events")
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as connection:
        state = "ENABLE" if guard else "DISABLE"
        await connection.execute(f"ALTER TABLE events {state} TRIGGER events_append_guard")
    store = await EventStore.connect(url, **({} if one_round_trip else {"one_round_trip_max_events": 0}))
    try:
        await warm_up(store, events[0])
        before = store.stats.transactions
        wal_before = await wal_position(url)
        meter.start()
        started = time.perf_counter()
        async with asyncio.TaskGroup() as group:
            for index in range(concurrency):
                group.create_task(appender(store, episodes_of(events, concurrency, index, episode_turns)))
        seconds = time.perf_counter() - started
        cpu_us = meter.per(len(events))
        transactions = store.stats.transactions - before
    finally:
        await store.close()
    size = await measure_size(url, "events", len(events) + 1, wal_before)  # + 1: the warm-up's event
    label = str(concurrency) if guard else f"{concurrency} {UNGUARDED}"
    if not one_round_trip:
        label = f"{label} {COPIED}"
    return Measurement(label, len(events), seconds, transactions, cpu_us, size)


@asynccontextmanager
async def index_dropped(url: str, index: str) -> AsyncIterator[None]:
    """The block without index ``index`` of ``events``; it is created again (as it was) after."""
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as connection:
        cursor = await connection.execute(
            "SELECT pg_get_indexdef(indexrelid) FROM pg_index WHERE indrelid = 'events'::regclass "
            "AND indexrelid::regclass::text = %s",
            (index,),
        )
        row = await cursor.fetchone()
        if row is None:
            raise SystemExit(f"--without-index {index}: events has no such index (\\d events lists them)")
        await connection.execute(f'DROP INDEX "{index}"')
        try:
            yield
        finally:
            await truncate(url, "events")  # so the index is built over an empty table
            await connection.execute(row[0])


# --- the run -------------------------------------------------------------------------------------


def level_size(level: int, args: argparse.Namespace) -> int:
    return int(args.events_at_1 if level == 1 else args.events)


async def measure(
    url: str, args: argparse.Namespace, events: Sequence[TurnCompleted], processes: Processes
) -> list[Measurement]:
    meter = CpuMeter(processes)
    rows = baseline_rows(events, streams=max(args.levels))
    tune_gc()  # as every `turnstile serve` process does: the payload built above is frozen with the rest
    await create_baseline_table(url, args.indexed_baseline, args.default_storage_baseline)
    results = []
    for round_ in range(args.repeat):
        baseline = await copy_baseline(url, rows, args.copy_chunk, meter)
        results.append(baseline)
        note(f"round {round_ + 1}: {BASELINE} {baseline.rate:,.0f} rows/s")
        for level in args.levels:
            size = level_size(level, args)
            result = await store_level(url, events[:size], level, meter, episode_turns=args.delta_turns)
            results.append(replace(result, ratio=result.rate / baseline.rate))
            note(f"round {round_ + 1}: {level} appenders {result.rate:,.0f} events/s")
            if args.copy_path:
                result = await store_level(
                    url, events[:size], level, meter, one_round_trip=False, episode_turns=args.delta_turns
                )
                results.append(replace(result, ratio=result.rate / baseline.rate))
                note(f"round {round_ + 1}: {level} appenders, {COPIED} {result.rate:,.0f} events/s")
            for index in args.without_index:
                async with index_dropped(url, index):
                    result = await store_level(
                        url, events[:size], level, meter, episode_turns=args.delta_turns
                    )
                results.append(
                    replace(result, label=f"{level} {WITHOUT} {index}", ratio=result.rate / baseline.rate)
                )
                note(f"round {round_ + 1}: {level} appenders without {index} {result.rate:,.0f} events/s")
        if args.guard_cost:
            level = max(args.levels)
            size = level_size(level, args)
            result = await store_level(
                url, events[:size], level, meter, guard=False, episode_turns=args.delta_turns
            )
            results.append(replace(result, ratio=result.rate / baseline.rate))
            note(f"round {round_ + 1}: {level} appenders {UNGUARDED} {result.rate:,.0f} events/s")
    return results


def median_by_label(results: Sequence[Measurement]) -> dict[str, tuple[Measurement, list[Measurement]]]:
    """Per label, its round with the median ratio (rate, for the baseline) and all its rounds in order."""
    summary = {}
    for label in dict.fromkeys(result.label for result in results):
        rounds = [result for result in results if result.label == label]
        ranked = sorted(rounds, key=lambda result: (result.ratio, result.rate))
        summary[label] = (ranked[(len(ranked) - 1) // 2], rounds)
    return summary


def print_report(results: Sequence[Measurement], args: argparse.Namespace) -> None:
    summary = median_by_label(results)
    several = args.repeat > 1
    table = Table(
        title="durable TurnCompleted ingest" + (f": median of {args.repeat} rounds" if several else ""),
        caption="x COPY: events/s ÷ COPY rows/s of the same round; CPU: µs per event (row) by process; "
        "B/event: the table on disk (heap + TOAST, indexes) per event; WAL: bytes written per event",
    )
    columns = ["level", "events", "seconds", "events/s", "x COPY", "tx", "events/tx", "CPU us/event"]
    for column in [*columns, "B/event (heap, indexes)", "WAL B/event"]:
        table.add_column(column, justify="right")
    if several:
        table.add_column("each round: events/s (x COPY)", justify="right")
    for label, (run, rounds) in summary.items():
        cells = [
            label,
            f"{run.rows:,}",
            f"{run.seconds:.2f}",
            f"{run.rate:,.0f}",
            f"{run.ratio:.2f}",
            f"{run.transactions:,}",
            f"{run.rows / run.transactions:.1f}",
            cpu_text(run.cpu_us),
            f"{run.size.total:,.0f} ({run.size.table:,.0f}, {run.size.indexes:,.0f})",
            f"{run.size.wal:,.0f}",
        ]
        each = "  ".join(f"{one.rate:,.0f} ({one.ratio:.2f})" for one in rounds)
        table.add_row(*cells, *([each] if several else []))
    console.print(table)
    print(f"target: >= {TARGET_RATIO:.2f} of COPY at {TARGET_LEVEL}")
    for label in (str(level) for level in args.levels if level > 1):
        run = summary[label][0]
        baseline = run.rate / run.ratio
        print_summary(
            "ingest", f"x COPY at {label} appenders", f"{run.rate:,.0f} events/s",
            f"COPY {baseline:,.0f} rows/s", run.ratio, f">= {TARGET_RATIO:.2f}", run.ratio >= TARGET_RATIO,
        )  # fmt: skip
    level = str(max(args.levels))
    if f"{level} {UNGUARDED}" in summary:
        guarded, unguarded = summary[level][0].ratio, summary[f"{level} {UNGUARDED}"][0].ratio
        print(f"append guard (migration 0007) at {level}: {guarded / unguarded:.2f} of the rate without it")


def describe_payload(events: Sequence[TurnCompleted]) -> str:
    sample = events[:1024]
    encoded = [encode_event(event) for event in sample]
    data = statistics.mean(len(item.data) for item in encoded)
    tokens = statistics.mean(len(item.tokens or b"") for item in encoded)
    chars = statistics.mean(sum(len(m.content or "") for m in event.request.messages) for event in sample)
    whole = sum(1 for event in sample if event.parent_turn_id is None)
    return (
        f"{chars:,.0f} message chars, {data:,.0f} B JSON + {tokens:,.0f} B tokens per event; "
        f"{whole / len(sample):.0%} whole turns"
    )


def parse_levels(text: str) -> list[int]:
    levels = [int(part) for part in text.split(",") if part.strip()]
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError("levels are positive integers, e.g. 1,64,512")
    return levels


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    add = parser.add_argument
    add("--events", type=int, default=20_000, help="events per level above 1 (default 20000)")
    add("--events-at-1", type=int, default=2_000, help="events at concurrency 1 (default 2000)")
    add("--levels", type=parse_levels, default=[1, 64, 512], help="appender counts (default 1,64,512)")
    add("--repeat", type=int, default=1, help="rounds; the table shows the median round (default 1)")
    add("--copy-chunk", type=int, default=1_000, help="rows per baseline COPY transaction (default 1000)")
    add(
        "--default-storage-baseline",
        action="store_true",
        help="COPY into columns with their types' default storage (events before migration 0015: PostgreSQL "
        "tries to compress the token arrays) instead of the storage events has",
    )
    add(
        "--indexed-baseline",
        action="store_true",
        help="COPY into a table LIKE events INCLUDING ALL (with its indexes) instead of a bare one",
    )
    add(
        "--delta-turns",
        type=int,
        default=0,
        help="episodes of this many turns, each after the first recording only what it adds (0: every turn "
        "whole, each appender one stream)",
    )
    add(
        "--without-index",
        action="append",
        default=[],
        metavar="NAME",
        help="also measure each level with this index of events dropped (repeatable), e.g. events_turn_text",
    )
    add("--seed", type=int, default=1234, help="seed of the payload (default 1234)")
    add(
        "--guard-cost",
        action="store_true",
        help="also measure the largest level with the append guard trigger disabled (its cost)",
    )
    add(
        "--copy-path",
        action="store_true",
        help="also measure each level with every batch COPYed (the store before a batch went out in one "
        "round trip), right after the default",
    )
    add("--tmp-dir", type=Path, default=None, help="parent of the embedded server's temporary directory")
    args = parser.parse_args(argv)
    if min(args.events, args.events_at_1, args.repeat, args.copy_chunk) < 1:
        parser.error("--events, --events-at-1, --repeat and --copy-chunk must be at least 1")
    if args.delta_turns < 0:
        parser.error("--delta-turns must be 0 (off) or more")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    count = max(level_size(level, args) for level in args.levels)
    started = time.perf_counter()
    events = make_events(count, args.seed, args.delta_turns)
    elapsed = time.perf_counter() - started
    note(f"built {count:,} events in {elapsed:.1f} s: {describe_payload(events)}")
    with postgres_server(args.tmp_dir) as (server_url, postgres_pid), scratch_database(server_url) as url:
        note(f"{describe_server(url)}; {machine()}")
        processes: Processes = {"bench": None}
        if postgres_pid is None:
            note("PostgreSQL from TURNSTILE_DATABASE_URL: its CPU time is not reported")
        else:
            processes["postgres"] = postgres_pid
        # a service's event loop (uvloop), for both
        results = run_service(measure(url, args, events, processes))
    print_report(results, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
