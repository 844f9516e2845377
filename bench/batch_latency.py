"""Batch latency: from the commit of the episode that completes a batch to that batch on JetStream
``BATCHES``, p50 and p99, with the real materializer and relay services.

What it does, on PostgreSQL and a nats-server (``TURNSTILE_DATABASE_URL``/``TURNSTILE_NATS_URL``, or
embedded ones) in a scratch database of its own:

1. ``turnstile serve materializer --batch-samples B`` and ``turnstile serve relay`` in processes of their
   own, as deployed.
2. Groups of ``G`` (``--group-size``) one-turn episodes, one group every ``--interval`` ms, appended
   through ``EventStore`` by this process: each episode's EpisodeStarted (group id and size),
   TurnCompleted and RewardAssigned first, then the group's EpisodeFinished events one after another.
   Groups are kept whole in batches, so a batch of ``B`` samples (``--batch-samples``) is complete when the
   last episode of its ``B / G``-th group finishes: ``--batches`` of them are timed.
3. This process subscribes to ``batches.<policy>`` and notes when each batch arrives. Its latency is
   arrival minus the moment the append of its last EpisodeFinished returned (committed), both on this
   process's clock. The first ``--warmup`` batches are not counted (processes starting, caches filling).

The figure: p50 and p99 over the counted batches, against the target p50 <= 50 ms (issue 21). The
baseline beside it is the round trip of one JetStream publish of 16 kB from this process to a
subscription (what moving a batch costs at the least). The split shows where the time goes: finish ->
the materializer's commit of the batch (when its NOTIFY, which wakes the relay, reaches this process too)
and from there to arrival (the relay's pass and the publish). CPU us/batch: the materializer's and the
relay's processes over the counted batches.

Environment: ``BENCH_PROFILE_DIR`` makes both services write cProfile stats (``<name>.prof``) there;
``BENCH_SERVICE_PGOPTIONS`` is passed to them as ``PGOPTIONS`` (e.g. ``-c synchronous_commit=off``, to see
what the commits' fsync costs; on the 2-core machine of issue 21 the difference was within the noise).

    python bench/batch_latency.py                     # 100 batches of 8 samples (groups of 8), every 100 ms
    python bench/batch_latency.py --batch-samples 64  # batches of 8 groups
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import nats
import psycopg
from nats.aio.msg import Msg

from pipeline.batches import decode_batch
from pipeline.batches.format import BATCHES_CHANNEL
from pipeline.batches.relay import BATCH_HEADER, batch_subject, ensure_batches_stream, read_batch_message
from pipeline.dev.embedded import scratch_dir
from pipeline.log import EventStore
from schemas import (
    ChatMessage,
    EpisodeFinished,
    EpisodeStarted,
    RewardAssigned,
    TurnCompleted,
    TurnReply,
    TurnRequest,
)

from common import REPO, CpuMeter, machine, note, percentile, scratch_database, servers, summary

TARGET_P50_MS = 50.0
ARRIVAL_TIMEOUT_S = 30.0
TURNSTILE = [sys.executable, "-m", "consumers.cli"]
PROFILE_DIR = os.environ.get("BENCH_PROFILE_DIR")
"""Where the services write cProfile stats of their whole life (``<name>.prof``), if set."""


@dataclass
class Tracker:
    """When each episode's finish committed and each batch arrived (``time.time()``), by id."""

    finished: dict[str, float] = field(default_factory=dict)
    arrived: dict[str, float] = field(default_factory=dict)
    episodes: dict[str, list[str]] = field(default_factory=dict)
    """The episodes of each arrived batch."""
    notified: list[float] = field(default_factory=list)
    """When the materializer's NOTIFY of a committed batch reached this process."""
    signal: asyncio.Event = field(default_factory=asyncio.Event)

    def latency_ms(self, batch_id: str) -> float:
        last = max(self.finished[episode] for episode in self.episodes[batch_id])
        return (self.arrived[batch_id] - last) * 1000


# --- the episodes --------------------------------------------------------------------------------


def opening(episode_id: str, group_id: str, size: int, policy: str, seed: int) -> list[object]:
    """EpisodeStarted, one TurnCompleted and a reward: everything of an episode but its end."""
    tokens = [(seed * 31 + n) % 50_000 for n in range(64)]
    return [
        EpisodeStarted(
            episode_id=episode_id, task_id=group_id, agent="bench:Agent", policy=policy,
            group_id=group_id, group_size=size,
        ),
        TurnCompleted(
            request=TurnRequest(messages=[ChatMessage(role="user", content=f"task {group_id}")]),
            reply=TurnReply(text="answer", finish_reason="stop"),
            prompt_token_ids=tokens[:48], completion_token_ids=tokens[48:],
            completion_logprobs=[-0.5] * 16, policy_version=0, engine_id="bench",
        ),
        RewardAssigned(value=float(seed % 3), source="bench"),
    ]  # fmt: skip


async def run_group(store: EventStore, tracker: Tracker, policy: str, size: int, index: int) -> None:
    """One group: all openings at once, then the finishes one by one (the last completes the batch)."""
    group_id = f"g{index:05d}-{uuid.uuid4().hex[:6]}"
    streams = {f"{group_id}-{n}": f"episode-{group_id}-{n}" for n in range(size)}
    await asyncio.gather(
        *(
            store.append(
                stream, opening(episode, group_id, size, policy, index * size + n), expected_version=0
            )
            for n, (episode, stream) in enumerate(streams.items())
        )
    )
    for episode, stream in streams.items():
        await store.append(stream, [EpisodeFinished(termination="done")], expected_version=3)
        tracker.finished[episode] = time.time()


# --- arrivals ------------------------------------------------------------------------------------


async def subscribe(connection: nats.NATS, policy: str, tracker: Tracker) -> None:
    async def arrived(message: Msg) -> None:
        now = time.time()
        batch = decode_batch(await read_batch_message(connection, message))
        batch_id = (message.headers or {}).get(BATCH_HEADER, batch.batch_id)
        tracker.arrived[batch_id] = now
        tracker.episodes[batch_id] = sorted({sample.episode_id for sample in batch.samples})
        tracker.signal.set()

    await connection.subscribe(batch_subject(policy), cb=arrived)


async def listen(database_url: str, tracker: Tracker) -> None:
    """Note when each NOTIFY the materializer sends with a committed batch arrives (what wakes the relay)."""
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as connection:
        await connection.execute(f"LISTEN {BATCHES_CHANNEL}")
        async for _ in connection.notifies():
            tracker.notified.append(time.time())


def committed_before(notified: Sequence[float], arrived: float) -> float | None:
    """The last NOTIFY before a batch arrived: its materializer commit (batches arrive seconds apart)."""
    earlier = [stamp for stamp in notified if stamp <= arrived]
    return earlier[-1] if earlier else None


async def publish_round_trips(connection: nats.NATS, count: int) -> list[float]:
    """The baseline: ms from a JetStream publish of a small batch-sized message to its arrival."""
    subject = f"batches.bench-baseline-{uuid.uuid4().hex[:8]}"
    got: asyncio.Queue[float] = asyncio.Queue()

    async def arrived(message: Msg) -> None:
        got.put_nowait(time.perf_counter())

    subscription = await connection.subscribe(subject, cb=arrived)
    js = connection.jetstream()
    payload = os.urandom(16_000)
    times = []
    for _ in range(count):
        started = time.perf_counter()
        await js.publish(subject, payload, headers={"Nats-Msg-Id": uuid.uuid4().hex})
        times.append((await asyncio.wait_for(got.get(), ARRIVAL_TIMEOUT_S) - started) * 1000)
    await subscription.unsubscribe()
    return times


async def wait_for_batches(tracker: Tracker, wanted: int) -> None:
    deadline = time.monotonic() + ARRIVAL_TIMEOUT_S
    while len(tracker.arrived) < wanted:
        tracker.signal.clear()
        left = deadline - time.monotonic()
        if left <= 0:
            raise SystemExit(f"only {len(tracker.arrived)} of {wanted} batches arrived; see the service logs")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(tracker.signal.wait(), left)


# --- services ------------------------------------------------------------------------------------


@contextlib.contextmanager
def services(database_url: str, nats_url: str, batch_samples: int, logs: Path) -> Iterator[dict[str, int]]:
    """The materializer and the relay as ``turnstile serve`` processes; their pids by name."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TURNSTILE_")}
    env.update(TURNSTILE_DATABASE_URL=database_url, TURNSTILE_NATS_URL=nats_url)
    if os.environ.get("BENCH_SERVICE_PGOPTIONS"):
        env["PGOPTIONS"] = os.environ["BENCH_SERVICE_PGOPTIONS"]
    commands = {
        "materializer": ["serve", "materializer", "--batch-samples", str(batch_samples)],
        "relay": ["serve", "relay"],
    }

    def command(name: str, argv: list[str]) -> list[str]:
        if PROFILE_DIR:
            profile = ["-m", "cProfile", "-o", str(Path(PROFILE_DIR) / f"{name}.prof")]
            return [sys.executable, *profile, "-m", "consumers.cli", *argv]
        return [*TURNSTILE, *argv]

    processes = {
        name: subprocess.Popen(
            command(name, argv), env=env, cwd=REPO, stdout=(logs / f"{name}.log").open("ab"),
            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )
        for name, argv in commands.items()
    }  # fmt: skip
    try:
        yield {name: process.pid for name, process in processes.items()}
    finally:
        for process in processes.values():
            process.terminate()
        for process in processes.values():
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


# --- the run -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Report:
    latencies: list[float]
    to_commit: list[float]
    to_arrival: list[float]
    baseline: list[float]
    cpu_us: dict[str, float]


async def measure(args: argparse.Namespace, database_url: str, nats_url: str, pids: dict[str, int]) -> Report:
    policy = f"lat{uuid.uuid4().hex[:8]}"
    tracker = Tracker()
    connection = await nats.connect(nats_url)
    store = await EventStore.connect(database_url)
    try:
        await ensure_batches_stream(connection)
        await subscribe(connection, policy, tracker)
        listener = asyncio.create_task(listen(database_url, tracker))
        baseline = await publish_round_trips(connection, 50)
        per_batch = args.batch_samples // args.group_size
        for index in range(args.warmup * per_batch):
            await run_group(store, tracker, policy, args.group_size, index)
        await wait_for_batches(tracker, args.warmup)
        note(f"warmed up: {args.warmup} batches arrived")
        counted_from = len(tracker.arrived)
        meter = CpuMeter({name: pid for name, pid in pids.items()})
        meter.start()
        loop = asyncio.get_running_loop()
        first = args.warmup * per_batch
        for index in range(first, first + args.batches * per_batch):
            started = loop.time()
            await run_group(store, tracker, policy, args.group_size, index)
            await asyncio.sleep(max(0.0, args.interval / 1000 - (loop.time() - started)))
        await wait_for_batches(tracker, args.warmup + args.batches)
        cpu = meter.per(args.batches)
        listener.cancel()
    finally:
        await store.close()
        await connection.close()
    counted = list(tracker.arrived)[counted_from:]
    last = {batch: max(tracker.finished[e] for e in tracker.episodes[batch]) for batch in counted}
    commits = {batch: committed_before(tracker.notified, tracker.arrived[batch]) for batch in counted}
    known = [batch for batch in counted if (commits[batch] or 0) >= last[batch]]
    return Report(
        [tracker.latency_ms(batch) for batch in counted],
        [((commits[batch] or 0) - last[batch]) * 1000 for batch in known],
        [(tracker.arrived[batch] - (commits[batch] or 0)) * 1000 for batch in known],
        baseline,
        cpu,
    )


def print_report(report: Report, args: argparse.Namespace) -> None:
    def line(label: str, values: list[float]) -> str:
        return (
            f"{label:<36} p50 {percentile(values, 50):8.2f} ms  p99 {percentile(values, 99):8.2f} ms  "
            f"max {max(values, default=float('nan')):8.2f} ms  (n={len(values)})"
        )

    print(
        f"batch latency: {args.batches} batches of {args.batch_samples} samples, groups of {args.group_size} "
        f"one every {args.interval:g} ms"
    )
    print(line("finish committed -> batch arrived", report.latencies))
    print(line("  finish -> materializer commit", report.to_commit))
    print(line("  commit -> arrived (the relay)", report.to_arrival))
    print(line("baseline: JetStream publish -> arrived", report.baseline))
    print("CPU us/batch: " + "  ".join(f"{name} {value:,.0f}" for name, value in report.cpu_us.items()))
    p50 = percentile(report.latencies, 50)
    summary(
        "batch_latency", "p50 finish -> batch on BATCHES",
        f"p50 {p50:.1f} ms, p99 {percentile(report.latencies, 99):.1f} ms",
        f"JetStream publish p50 {percentile(report.baseline, 50):.2f} ms",
        p50 / percentile(report.baseline, 50), f"p50 <= {TARGET_P50_MS:g} ms", p50 <= TARGET_P50_MS,
    )  # fmt: skip


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    add = parser.add_argument
    add("--batches", type=int, default=100, help="timed batches (default 100)")
    add("--group-size", type=int, default=8, help="episodes per group (default 8)")
    add("--batch-samples", type=int, default=8, help="the materializer's --batch-samples (default 8)")
    add("--interval", type=float, default=100.0, help="ms from one group's start to the next's (default 100)")
    add("--warmup", type=int, default=5, help="untimed batches first (default 5)")
    add("--tmp-dir", type=Path, default=None, help="parent of the embedded servers' temporary directory")
    args = parser.parse_args(argv)
    if min(args.batches, args.group_size, args.batch_samples, args.warmup) < 1 or args.interval < 0:
        parser.error("--batches, --group-size, --batch-samples, --warmup: at least 1; --interval: 0 or more")
    if args.batch_samples % args.group_size:
        parser.error("--batch-samples must be a multiple of --group-size (groups are kept whole)")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    note(machine())
    with (
        servers(args.tmp_dir) as found,
        scratch_database(found.database_url) as database_url,
        scratch_dir("turnstile-bench-logs-", args.tmp_dir) as logs,
        services(database_url, found.nats_url, args.batch_samples, Path(logs)) as pids,
    ):
        report = asyncio.run(measure(args, database_url, found.nats_url, pids))
    print_report(report, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
