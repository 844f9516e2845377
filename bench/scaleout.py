"""How the recorded path scales out: turns/s with 1, 2 and 4 runner processes and 1 and 2 inference
consumer processes, each the real service (`turnstile serve runner`, `turnstile serve inference --backend
scripted`), on one PostgreSQL and one NATS (or a 3-node cluster with ``--nats-cluster 3``).

For each combination, ``--tasks`` tasks of ``tests.support.agents.ThreeTurnAgent`` (three turns each) are put
on the work queue and the runners take them; the figure is turns recorded per second from the first
``EpisodeStarted`` to the last ``EpisodeFinished`` (log time), after the processes are up. "x base" divides
by the 1 runner / 1 consumer row measured in the same run. The scripted backend answers instantly, so
what scales is the price of running and recording episodes. On a 2-core machine every process competes for
the same two cores (PostgreSQL and nats-server too): expect the figures to stop growing early, and read
them as how the work divides, not as what more machines would give.

    python bench/scaleout.py                        # 1,2,4 runners x 1,2 consumers, 600 tasks each
    python bench/scaleout.py --runners 1,2 --consumers 1 --tasks 200
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

import psycopg
from rich.console import Console
from rich.table import Table

from pipeline.dev.embedded import EmbeddedNats, EmbeddedNatsCluster, scratch_dir

from common import machine, postgres_server, scratch_database, summary

REPO = Path(__file__).resolve().parent.parent
TURNSTILE = [sys.executable, "-m", "consumers.cli"]


def spawn(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [*TURNSTILE, *args], env=env, cwd=REPO, stdout=log.open("ab"), stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip


def count(url: str, query: str, *params: object) -> int:
    with psycopg.connect(url) as connection:
        row = connection.execute(query, params).fetchone()
    return int(row[0]) if row and row[0] is not None else 0


def one(url: str, nats_url: str, runners: int, consumers: int, args: argparse.Namespace, logs: Path) -> float:
    """Turns/s recorded by ``runners`` runner processes served by ``consumers`` consumer processes."""
    policy = f"scale{uuid.uuid4().hex[:8]}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TURNSTILE_")}
    env.update(TURNSTILE_DATABASE_URL=url, TURNSTILE_NATS_URL=nats_url, PYTHONPATH=str(REPO))
    processes = [
        spawn(["serve", "inference", "--policy", policy, "--backend", "scripted"], env, logs / f"i{n}.log")
        for n in range(consumers)
    ] + [
        spawn(
            [
                "serve",
                "runner",
                "--agent",
                "tests.support.agents:ThreeTurnAgent",
                "--policy",
                policy,
                "--concurrency",
                str(args.concurrency),
            ],
            env,
            logs / f"r{n}.log",
        )
        for n in range(runners)
    ]
    tasks = logs / f"{policy}.jsonl"
    tasks.write_text("".join(json.dumps({"id": f"t{n}"}) + "\n" for n in range(args.tasks)))
    try:
        subprocess.run([*TURNSTILE, "submit", str(tasks), "--policy", policy], env=env, check=True,
                       capture_output=True, cwd=REPO)  # fmt: skip
        finished = (
            "SELECT count(*) FROM events f JOIN events s ON s.stream = f.stream "
            "AND s.type = 'EpisodeStarted' WHERE f.type = 'EpisodeFinished' AND s.data->>'policy' = %s"
        )
        deadline = time.monotonic() + args.timeout
        while count(url, finished, policy) < args.tasks:
            if time.monotonic() > deadline or any(p.poll() is not None for p in processes):
                raise SystemExit(f"{runners} runners x {consumers} consumers did not finish; logs in {logs}")
            time.sleep(0.5)
        span = (
            "SELECT extract(epoch FROM max(f.recorded_at) - min(s.recorded_at)) FROM events s "
            "JOIN events f ON f.stream = s.stream AND f.type = 'EpisodeFinished' "
            "WHERE s.type = 'EpisodeStarted' AND s.data->>'policy' = %s"
        )
        with psycopg.connect(url) as connection:
            row = connection.execute(span, (policy,)).fetchone()
        seconds = float(row[0]) if row and row[0] else float("nan")
        return 3 * args.tasks / seconds
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            process.wait(timeout=30)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ints = lambda text: [int(x) for x in text.split(",")]  # noqa: E731
    parser.add_argument("--runners", type=ints, default=[1, 2, 4])
    parser.add_argument("--consumers", type=ints, default=[1, 2])
    parser.add_argument("--tasks", type=int, default=600)
    parser.add_argument("--concurrency", type=int, default=64, help="episodes each runner runs at once")
    parser.add_argument("--nats-cluster", type=int, default=1, help="nats-servers (3: a cluster)")
    parser.add_argument("--timeout", type=float, default=600.0)
    args = parser.parse_args(argv)
    console = Console(width=160)
    console.print(f"{machine()} at the start")
    with (
        postgres_server(None) as (server_url, _),
        scratch_database(server_url) as url,
        scratch_dir("turnstile-scaleout-") as directory,
    ):
        nats: EmbeddedNats | EmbeddedNatsCluster = (
            EmbeddedNats(directory / "nats")
            if args.nats_cluster == 1
            else EmbeddedNatsCluster(directory / "nats", args.nats_cluster)
        )
        nats.start()
        try:
            if isinstance(nats, EmbeddedNatsCluster):
                asyncio.run(nats.replicate_streams())
            results = {
                (r, c): one(url, nats.url, r, c, args, directory)
                for c in args.consumers
                for r in args.runners
            }
        finally:
            nats.stop()
    base = results.get((1, 1)) or next(iter(results.values()))
    table = Table(title=f"recorded turns/s by processes ({args.tasks} tasks of 3 turns each)")
    for column in ("runners", "consumers", "turns/s", "x base (1 runner, 1 consumer)"):
        table.add_column(column, justify="right")
    for (runners, consumers), rate in results.items():
        table.add_row(str(runners), str(consumers), f"{rate:,.0f}", f"{rate / base:.2f}")
    console.print(table)
    (runners, consumers), best = max(results.items(), key=lambda item: item[1])
    summary(
        "scaleout", f"best: {runners} runners x {consumers} consumers", f"{best:,.0f} turns/s",
        f"1 x 1 {base:,.0f} turns/s", best / base, None,
    )  # fmt: skip


if __name__ == "__main__":
    main()
