"""Episodes/s and turns/s of the full recorded path at 1,000 concurrent episodes, and the runner's memory
per open episode.

Everything runs over the instant ``ScriptedBackend``, so the model costs nothing and what is measured is
the price of running and recording episodes. Servers: PostgreSQL (``TURNSTILE_DATABASE_URL``) and a
nats-server (``TURNSTILE_NATS_URL``), or embedded ones in a temporary directory; the run gets a migrated
scratch database of its own, dropped at the end. An inference consumer (``create_app`` with the scripted
backend) runs in a process of its own, so it does not share this process's event loop or core.

Throughput, after ``--warmup`` untimed episodes of each path:

- ``bare NATS`` (the baseline): ``--concurrency`` asyncio workers make ``--episodes`` conversations of
  three turns each, every turn one ``NatsLLMClient`` call (an ``LLMRequest`` with the episode id, so later
  turns go to the sticky subject). No session, no recording.
- ``recorded``: a ``Runner`` at ``--concurrency`` runs ``--episodes`` episodes of ``ThreeTurnAgent``
  (three turns, each extending the conversation) through ``run_tasks``: ``EpisodeSession`` ->
  ``NatsLLMClient`` -> consumer -> ``TurnCompleted`` appended to PostgreSQL before the agent sees the
  reply; plus ``EpisodeStarted``, ``RewardAssigned`` and ``EpisodeFinished``: six events an episode.
- ``unwritten`` (with ``--unwritten``, an ablation): the recorded path on a store whose appends cost
  nothing (``common.UnwrittenStore``: nothing validated, encoded or written). Its CPU per turn is what the
  runner would cost if recording were free: the least that any store could bring the runner to.

"x bare" is recorded turns/s ÷ bare turns/s: what recording costs (1.00 would be free). "CPU us/turn"
is the user + system CPU each process spent per timed turn (``bench``: this process; ``consumer``;
``nats`` and ``postgres`` when embedded, postgres with its backends; from /proc, Linux only, in 10 ms
ticks): on a small machine the processes fight for cores, and this says whose work a turn is. The
event-store line gives its group commit over the recorded run: transactions and events per transaction.

Memory per open episode: ``--open`` episodes are run by a Runner whose agent, after its first turn,
waits on one asyncio.Event; once all are waiting, the Python memory this process holds (tracemalloc,
after ``gc.collect()``, counted from before the runner started) is divided by ``--open``. The baseline
is ``--open`` bare asyncio tasks waiting on the same event, measured the same way; "overhead" is the
difference, i.e. what the session, its events, the runner's bookkeeping, the agent's conversation and
the client's per-episode state (its sticky-consumer entry) cost on top of a task, against the target.
``--top`` lists the source lines that hold the most of the open episodes' memory.

    python bench/episodes.py                   # defaults: 3000 episodes at concurrency 1000, 1000 open
    python bench/episodes.py --quick           # a smoke run: 200 episodes at concurrency 100, 100 open
    python bench/episodes.py --unwritten       # also the recorded path with appends that cost nothing
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import sys
import time
import tracemalloc
import uuid
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from consumers.runtime import run, tune_gc
from pipeline.episodes import EpisodeLLM
from pipeline.inference.client import NatsLLMClient
from pipeline.log import EventStore
from pipeline.runners.runner import Runner, RunnerConfig, TaskSpec, run_tasks
from schemas import ChatMessage, LLMRequest, SamplingParams

from common import (  # bench/common.py
    CpuMeter,
    Processes,
    Servers,
    UnwrittenStore,
    consumer,
    cpu_text,
    machine,
    note,
    profiled,
    scratch_database,
    servers,
    summary,
)

POLICY = "bench"
AGENT_NAME = "bench.episodes:ThreeTurnAgent"
TURNS = 3
MAX_TOKENS = 6
TARGET_KB = 50.0
TARGET_RATIO = 0.6
TARGET_RUNNER_US = 150.0
"""The runner process's (this one's) CPU per recorded turn (issue 35)."""
SCRIPT = str(Path(__file__).resolve())

console = Console(width=None if sys.stdout.isatty() else 132)


@dataclass(frozen=True, slots=True)
class Throughput:
    path: str
    episodes: int
    turns: int
    seconds: float
    cpu_us: dict[str, float]
    """CPU time per timed turn of each process, in microseconds."""

    @property
    def episode_rate(self) -> float:
        return self.episodes / self.seconds

    @property
    def turn_rate(self) -> float:
        return self.turns / self.seconds


@dataclass(frozen=True, slots=True)
class Memory:
    what: str
    count: int
    traced_bytes: int
    top: list[str]

    @property
    def kb_each(self) -> float:
        return self.traced_bytes / self.count / 1024


@dataclass(frozen=True, slots=True)
class StoreStats:
    transactions: int
    appends: int
    events: int


# --- the agent -----------------------------------------------------------------------------------


class Gate:
    """Where held episodes (or bare tasks) wait: ``arrived`` is set once ``expected`` of them are in."""

    def __init__(self, expected: int) -> None:
        self.expected = expected
        self.waiting = 0
        self.arrived = asyncio.Event()
        self.release = asyncio.Event()

    async def __call__(self) -> None:
        self.waiting += 1
        if self.waiting >= self.expected:
            self.arrived.set()
        await self.release.wait()


class ThreeTurnAgent:
    """Three turns, each extending the conversation with the reply and a new user message (so turns two
    and three continue the recorded one token-exactly); ``pause``, if given, is awaited after turn one."""

    def __init__(self, pause: Callable[[], Awaitable[None]] | None = None) -> None:
        self.pause = pause

    async def run(self, task: dict[str, Any], llm: EpisodeLLM) -> float:
        messages = first_messages(task)
        for n in range(TURNS):
            reply = await llm.chat(messages, max_tokens=MAX_TOKENS)
            messages += [reply.message, ChatMessage(role="user", content=f"now say {n + 2}")]
            if n == 0 and self.pause is not None:
                await self.pause()
        return 1.0


def first_messages(task: dict[str, Any]) -> list[ChatMessage]:
    return [ChatMessage(role="user", content=f"task {task.get('id', '?')}: count to three")]


def make_tasks(count: int, tag: str) -> Iterator[TaskSpec]:
    for index in range(count):
        yield TaskSpec(task={"id": f"{tag}-{index}"}, task_id=f"{tag}-{index}")


def runner_config(concurrency: int) -> RunnerConfig:
    return RunnerConfig(policy=POLICY, agent_name=AGENT_NAME, concurrency=concurrency, retries=0)


# --- the two paths -------------------------------------------------------------------------------


async def bare_conversation(llm: NatsLLMClient, episode_id: str) -> None:
    """What ThreeTurnAgent sends, as plain client calls: no session, no recording."""
    messages = first_messages({"id": episode_id})
    sampling = SamplingParams(max_tokens=MAX_TOKENS)
    for n in range(TURNS):
        request = LLMRequest(policy=POLICY, episode_id=episode_id, messages=messages, sampling=sampling)
        reply = await llm(request)
        assistant = ChatMessage(role="assistant", content=reply.text, tool_calls=reply.tool_calls or None)
        messages = [*messages, assistant, ChatMessage(role="user", content=f"now say {n + 2}")]


async def run_bare(llm: NatsLLMClient, episodes: int, concurrency: int) -> tuple[int, int]:
    """``episodes`` conversations, ``concurrency`` at a time; (episodes, turns) made."""
    tag = uuid.uuid4().hex[:8]
    next_index = iter(range(episodes))

    async def worker() -> None:
        for index in next_index:
            await bare_conversation(llm, f"bare-{tag}-{index}")

    async with asyncio.TaskGroup() as group:
        for _ in range(min(concurrency, episodes)):
            group.create_task(worker())
    return episodes, episodes * TURNS


async def run_recorded(
    store: EventStore, llm: NatsLLMClient, episodes: int, concurrency: int
) -> tuple[int, int]:
    """``episodes`` recorded episodes through a Runner; (episodes, turns) made. Raises unless all are done."""
    runner = Runner(ThreeTurnAgent(), store=store, llm=llm, config=runner_config(concurrency))
    outcomes = await run_tasks(runner, make_tasks(episodes, uuid.uuid4().hex[:8]))
    failed = [outcome for outcome in outcomes if outcome.termination != "done"]
    if failed:
        first = failed[0]
        raise RuntimeError(
            f"{len(failed)} of {len(outcomes)} episodes did not finish 'done'; the first ended "
            f"{first.termination!r}: {(first.error or '').strip().splitlines()[-1:]}"
        )
    return len(outcomes), runner.stats.turns


async def timed(path: str, run: Callable[[], Awaitable[tuple[int, int]]], processes: Processes) -> Throughput:
    meter = CpuMeter(processes)
    meter.start()
    started = time.perf_counter()
    episodes, turns = await run()
    seconds = time.perf_counter() - started
    result = Throughput(path, episodes, turns, seconds, meter.per(turns))
    note(
        f"{path}: {episodes:,} episodes, {turns:,} turns in {seconds:.2f} s: "
        f"{result.episode_rate:,.0f} episodes/s, {result.turn_rate:,.0f} turns/s; "
        f"CPU us/turn: {cpu_text(result.cpu_us)}"
    )
    return result


# --- memory --------------------------------------------------------------------------------------


async def traced_hold(
    what: str, count: int, start: Callable[[Gate], Awaitable[asyncio.Task[Any]]], top: int
) -> Memory:
    """The Python memory held while ``count`` waiters started by ``start`` all wait on one gate."""
    gate = Gate(count)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot() if top else None
        base = tracemalloc.get_traced_memory()[0]
        running = await start(gate)
        await gate.arrived.wait()
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - base
        lines = top_lines(before, tracemalloc.take_snapshot(), top, count) if before else []
    finally:
        tracemalloc.stop()
    gate.release.set()
    await running
    note(f"{what}: {count:,} waiting hold {held / 1024:,.0f} KB, {held / count / 1024:.2f} KB each")
    return Memory(what, count, held, lines)


def top_lines(before: tracemalloc.Snapshot, after: tracemalloc.Snapshot, top: int, count: int) -> list[str]:
    grown = [stat for stat in after.compare_to(before, "lineno") if stat.size_diff > 0][:top]
    lines = []
    for stat in grown:
        frame = stat.traceback[0]
        lines.append(f"{stat.size_diff / count:8,.0f} B  {short_path(frame.filename)}:{frame.lineno}")
    return lines


def short_path(filename: str) -> str:
    if "/site-packages/" in filename:
        return filename.rpartition("/site-packages/")[2]
    if "/lib/python3" in filename:  # the standard library: drop ".../lib/python3.11/"
        return filename.rpartition("/lib/python3")[2].partition("/")[2]
    with contextlib.suppress(ValueError):
        return str(Path(filename).relative_to(Path(SCRIPT).parent.parent))
    return filename


async def measure_memory(
    store: EventStore, llm: NatsLLMClient, count: int, top: int
) -> tuple[Memory, Memory]:
    async def bare_tasks(gate: Gate) -> asyncio.Task[Any]:
        async def hold_all() -> None:
            await asyncio.gather(*(gate() for _ in range(count)))  # a task per waiter, as a runner has

        return asyncio.create_task(hold_all())

    async def open_episodes(gate: Gate) -> asyncio.Task[Any]:
        runner = Runner(ThreeTurnAgent(pause=gate), store=store, llm=llm, config=runner_config(count))
        return asyncio.create_task(run_tasks(runner, make_tasks(count, f"open-{uuid.uuid4().hex[:8]}")))

    tasks = await traced_hold("bare tasks", count, bare_tasks, 0)
    episodes = await traced_hold("open episodes", count, open_episodes, top)
    return tasks, episodes


# --- the run -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Report:
    bare: Throughput
    recorded: Throughput
    store: StoreStats
    tasks: Memory
    episodes: Memory
    unwritten: Throughput | None = None


async def measure(args: argparse.Namespace, found: Servers, database_url: str) -> Report:
    async with consumer(found.nats_url, POLICY) as (consumer_pid, _):
        processes: Processes = {"bench": None, "consumer": consumer_pid, **found.pids}
        store = await EventStore.connect(database_url)
        llm = await NatsLLMClient.connect(found.nats_url)
        try:
            warmup = min(args.warmup, args.episodes)
            if warmup:
                await run_bare(llm, warmup, args.concurrency)
                await run_recorded(store, llm, warmup, args.concurrency)
                note(f"warmed up with {warmup:,} episodes of each path")
            bare = await timed("bare NATS", lambda: run_bare(llm, args.episodes, args.concurrency), processes)
            before = StoreStats(store.stats.transactions, store.stats.appends, store.stats.events)
            with profiled(args.profile):
                recorded = await timed(
                    "recorded", lambda: run_recorded(store, llm, args.episodes, args.concurrency), processes
                )
            stats = StoreStats(
                store.stats.transactions - before.transactions,
                store.stats.appends - before.appends,
                store.stats.events - before.events,
            )
            unwritten = None
            if args.unwritten:
                free = UnwrittenStore(store.engine)
                if warmup:
                    await run_recorded(free, llm, warmup, args.concurrency)
                unwritten = await timed(
                    "unwritten", lambda: run_recorded(free, llm, args.episodes, args.concurrency), processes
                )
            tasks, episodes = await measure_memory(store, llm, args.open, args.top)
        finally:
            await llm.close()
            await store.close()
    return Report(bare, recorded, stats, tasks, episodes, unwritten)


def print_report(report: Report, args: argparse.Namespace) -> None:
    bare, recorded = report.bare, report.recorded
    table = Table(
        title=f"episodes of {TURNS} turns at concurrency {args.concurrency:,}, instant scripted backend",
        caption="x bare: turns/s ÷ bare NATS turns/s of the same run",
    )
    for column in ["path", "episodes", "turns", "seconds", "episodes/s", "turns/s", "x bare"]:
        table.add_column(column, justify="right")
    table.add_column("CPU us/turn", justify="left")
    for result in (bare, recorded, *filter(None, [report.unwritten])):
        table.add_row(
            result.path,
            f"{result.episodes:,}",
            f"{result.turns:,}",
            f"{result.seconds:.2f}",
            f"{result.episode_rate:,.0f}",
            f"{result.turn_rate:,.0f}",
            f"{result.turn_rate / bare.turn_rate:.2f}",
            cpu_text(result.cpu_us),
        )
    console.print(table)
    stats = report.store
    print(
        f"event store (recorded run): {stats.events:,} events in {stats.appends:,} appends and "
        f"{stats.transactions:,} transactions: {stats.events / max(stats.transactions, 1):.1f} events/tx, "
        f"{stats.appends / max(stats.transactions, 1):.1f} appends/tx"
    )

    tasks, episodes = report.tasks, report.episodes
    overhead = episodes.kb_each - tasks.kb_each
    memory = Table(title=f"Python memory held while {args.open:,} wait (tracemalloc)")
    for column in ["waiting", "count", "KB total", "KB each", "x bare task"]:
        memory.add_column(column, justify="right")
    for row in (tasks, episodes):
        memory.add_row(
            row.what,
            f"{row.count:,}",
            f"{row.traced_bytes / 1024:,.0f}",
            f"{row.kb_each:.2f}",
            f"{row.kb_each / tasks.kb_each:.1f}" if tasks.kb_each > 0 else "-",
        )
    console.print(memory)
    verdict = "met" if overhead < TARGET_KB else "NOT met"
    print(
        f"memory per open episode: {overhead:.2f} KB over a bare task; target < {TARGET_KB:g} KB "
        f"({overhead / TARGET_KB:.2f} of it: {verdict})"
    )
    if episodes.top:
        print("largest holders per open episode (tracemalloc, by line):")
        for line in episodes.top:
            print(f"  {line}")
    ratio = recorded.turn_rate / bare.turn_rate
    summary(
        "episodes",
        f"recorded turns/s at {args.concurrency:,}",
        f"{recorded.turn_rate:,.0f} turns/s, bench CPU {recorded.cpu_us.get('bench', 0):,.0f} us/turn",
        f"bare NATS {bare.turn_rate:,.0f} turns/s, {bare.cpu_us.get('bench', 0):,.0f} us/turn",
        ratio,
        f">= {TARGET_RATIO:g}x bare",
        ratio >= TARGET_RATIO,
    )
    runner_us, bare_us = recorded.cpu_us.get("bench", 0.0), bare.cpu_us.get("bench", 0.0)
    summary(
        "episodes",
        f"runner CPU us/turn at {args.concurrency:,}",
        f"recorded {runner_us:,.0f} us/turn",
        f"bare NATS {bare_us:,.0f} us/turn",
        runner_us / bare_us if bare_us else float("nan"),
        f"<= {TARGET_RUNNER_US:g} us/turn",
        runner_us <= TARGET_RUNNER_US,
    )
    if report.unwritten is not None:
        free_us = report.unwritten.cpu_us.get("bench", 0.0)
        summary(
            "episodes",
            f"runner CPU us/turn at {args.concurrency:,} with appends that cost nothing (--unwritten; the "
            f"recorded path's target: <= {TARGET_RUNNER_US:g})",
            f"unwritten {free_us:,.0f} us/turn",
            f"recorded {runner_us:,.0f} us/turn, bare NATS {bare_us:,.0f}",
            free_us / runner_us if runner_us else float("nan"),
            None,  # an ablation: what no store can go below, not a figure with a target of its own
        )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    add = parser.add_argument
    add("--episodes", type=int, default=3_000, help="timed episodes per path (default 3000)")
    add("--concurrency", type=int, default=1_000, help="episodes in flight (default 1000)")
    add("--warmup", type=int, default=1_000, help="untimed episodes per path first (default 1000)")
    add("--open", type=int, default=1_000, help="episodes held open for the memory figure (default 1000)")
    add("--top", type=int, default=8, help="source lines to list that hold open episodes' memory (default 8)")
    add("--quick", action="store_true", help="a smoke run: 200 episodes, concurrency 100, 100 open")
    add("--tmp-dir", type=Path, default=None, help="parent of the embedded servers' temporary directory")
    add("--profile", type=Path, default=None, help="write cProfile stats (CPU time) of the recorded run here")
    add(
        "--unwritten",
        action="store_true",
        help="also run the recorded path on a store whose appends cost nothing (an ablation: the runner's "
        "CPU if recording were free)",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.episodes, args.concurrency, args.warmup, args.open = 200, 100, 100, 100
    if min(args.episodes, args.concurrency, args.open) < 1 or min(args.warmup, args.top) < 0:
        parser.error("--episodes, --concurrency and --open must be at least 1, --warmup and --top 0 or more")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    tune_gc()  # as every `turnstile serve` process does (consumers.runtime.running): both paths get it
    note(
        f"{machine()}; {args.episodes:,} episodes per path at concurrency {args.concurrency:,} "
        f"after {args.warmup:,} warm-up; {args.open:,} held open"
    )
    with servers(args.tmp_dir) as found, scratch_database(found.database_url) as database_url:
        report = run(measure(args, found, database_url))  # the runner service's event loop (uvloop)
    print_report(report, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
