"""``turnstile demo``: the closed loop on one machine, in one command.

Embedded PostgreSQL and NATS, the tiny model, an inference consumer, the materializer, the batch relay and
the trainer as processes of their own (the same ``turnstile serve ...`` commands a deployment runs), and a
runner in this process feeding the demo task (``pipeline.examples.demo``) to the policy ``demo``. A live
table shows the loop; at the end a summary compares the reward of the first and the last episodes, a
reward curve is saved as PNG, and ``summary.json`` holds the figures. The data stays in the data
directory: ``turnstile up`` brings the servers back for ``turnstile sql``, and running the demo again
resumes where it stopped (the trainer from its last version, the materializer from its checkpoint).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final

import psycopg
from rich.console import Console
from rich.live import Live
from rich.table import Table

from pipeline.dev.embedded import EmbeddedServers
from pipeline.dev.plot import line_chart
from pipeline.episodes.leases import RunnerLease, close_abandoned_episodes
from pipeline.examples.demo import DigitsOrCapitalsAgent, demo_tasks
from pipeline.inference.client import NatsLLMClient
from pipeline.log import EventStore
from pipeline.log.db import migrate
from pipeline.runners.runner import Runner, RunnerConfig, TaskSpec, run_tasks
from pipeline.settings import SERVERS_FILE, libpq_url
from schemas import SamplingParams

POLICY: Final = "demo"
TRY_QUERIES: Final = (
    "SELECT policy_version, episodes, round(mean_reward::numeric, 3) AS mean_reward "
    "FROM reward_by_policy_version WHERE policy = 'demo' ORDER BY policy_version",
    "SELECT b.batch_id, t.policy_version AS trained_into, b.samples, b.groups, b.min_policy_version "
    "FROM trained_batches t JOIN batches b USING (batch_id) ORDER BY t.trained_at DESC LIMIT 5",
    "SELECT * FROM turn_latency_by_consumer",
)


@dataclass(frozen=True)
class DemoConfig:
    data_dir: Path
    minutes: float = 3.0
    seed: int = 0
    group_size: int = 8
    concurrency: int = 64
    max_tokens: int = 8
    batch_samples: int = 64
    lr: float = 3e-3
    max_staleness: int = 4
    window: int = 200


@dataclass
class Summary:
    episodes: int = 0
    turns: int = 0
    seconds: float = 0.0
    batches_trained: int = 0
    policy_version: int = 0
    first_update_s: float | None = None
    first_window: tuple[float, float, int] = (0.0, 0.0, 0)
    last_window: tuple[float, float, int] = (0.0, 0.0, 0)
    curve: list[tuple[int, float, float]] = field(default_factory=list)

    @property
    def improved(self) -> bool:
        (first, first_ci, _), (last, last_ci, _) = self.first_window, self.last_window
        return last - last_ci > first + first_ci


def mean_ci(values: list[float]) -> tuple[float, float, int]:
    """Mean, 95% confidence half-width (normal approximation) and count."""
    n = len(values)
    if n == 0:
        return 0.0, 0.0, 0
    mean = sum(values) / n
    variance = sum((v - mean) ** 2 for v in values) / (n - 1) if n > 1 else 0.0
    return mean, 1.96 * math.sqrt(variance / n), n


class Services:
    """The service processes, stopped with SIGTERM (then SIGKILL) on exit."""

    def __init__(self, env: dict[str, str], logs: Path) -> None:
        self.env, self.logs = env, logs
        self.processes: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, *args: str) -> None:
        self.logs.mkdir(parents=True, exist_ok=True)
        log = (self.logs / f"{name}.log").open("ab")
        self.processes[name] = subprocess.Popen(
            [sys.executable, "-m", "consumers.cli", *args],
            env=self.env,
            stdout=log,
            stderr=log,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # Ctrl-C reaches the demo; the demo stops them in order
        )

    def check(self) -> None:
        for name, process in self.processes.items():
            if process.poll() is not None:
                raise RuntimeError(
                    f"the {name} process exited ({process.returncode}); see {self.logs}/{name}.log"
                )

    def stop(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.processes.values():
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _query(database_url: str, sql: str, *params: Any) -> list[tuple[Any, ...]]:
    with psycopg.connect(libpq_url(database_url)) as connection:
        return connection.execute(sql, params).fetchall()


def _rewards_since(database_url: str, since_position: int) -> list[float]:
    """Mean reward per turn of each finished episode recorded after ``since_position``, in finish order."""
    rows = _query(
        database_url,
        "SELECT reward / turns FROM episodes WHERE policy = %s AND status = 'finished' "
        "AND termination IN ('done', 'truncated', 'max_turns') AND turns > 0 AND started_position > %s "
        "ORDER BY finished_position",
        POLICY,
        since_position,
    )
    return [float(r[0] or 0.0) for r in rows]


def _status(database_url: str, since_position: int, started: float) -> dict[str, Any]:
    rewards = _rewards_since(database_url, since_position)
    trained = _query(database_url, "SELECT count(*) FROM trained_batches WHERE outcome = 'trained'")[0][0]
    version = _query(
        database_url,
        "SELECT coalesce(max((data->>'version')::int), 0) FROM events WHERE stream = %s",
        f"policy-{POLICY}",
    )[0][0]
    turns = _query(
        database_url,
        "SELECT count(*) FROM events WHERE type = 'TurnCompleted' AND position > %s",
        since_position,
    )[0][0]
    recent = rewards[-200:]
    elapsed = time.monotonic() - started
    return {
        "episodes": len(rewards),
        "turns": int(turns),
        "turns_per_s": turns / max(elapsed, 1e-9),
        "batches_trained": int(trained),
        "policy_version": int(version),
        "mean_reward_recent": sum(recent) / len(recent) if recent else None,
        "elapsed": elapsed,
    }


def _status_table(status: dict[str, Any], minutes: float) -> Table:
    table = Table(title=f"turnstile demo ({minutes:g} min)", show_header=False, min_width=48)
    table.add_column(style="bold")
    table.add_column(justify="right")
    mean = status["mean_reward_recent"]
    rows = {
        "episodes finished": str(status["episodes"]),
        "turns": str(status["turns"]),
        "turns/s": f"{status['turns_per_s']:.1f}",
        "batches trained": str(status["batches_trained"]),
        "policy version": str(status["policy_version"]),
        "mean reward (last 200 episodes)": "-" if mean is None else f"{mean:.3f}",
        "elapsed": f"{status['elapsed']:.0f} s",
    }
    for name, value in rows.items():
        table.add_row(name, value)
    return table


async def _run_loop(config: DemoConfig, database_url: str, nats_url: str, stop: asyncio.Event) -> None:
    store = await EventStore.connect(database_url)
    llm = await NatsLLMClient.connect(nats_url, wait_for_consumer=120.0)
    try:
        await close_abandoned_episodes(store, lease_timeout=30)
        async with RunnerLease(store) as lease:
            runner = Runner(
                DigitsOrCapitalsAgent(),
                store=store,
                llm=llm,
                config=RunnerConfig(
                    policy=POLICY,
                    agent_name="pipeline.examples.demo:DigitsOrCapitalsAgent",
                    group_size=config.group_size,
                    concurrency=config.concurrency,
                    sampling=SamplingParams(temperature=1.0, max_tokens=config.max_tokens),
                    retries=0,
                ),
                runner_id=lease.runner_id,
            )
            # the same task stream for the same seed; sampling and the trainer take their own seeds
            stream = demo_tasks(config.seed)
            tasks: Iterator[TaskSpec] = (TaskSpec(task=task, task_id=task["id"]) for task in stream)
            work = asyncio.create_task(run_tasks(runner, tasks))
            stopping = asyncio.create_task(stop.wait())
            await asyncio.wait({work, stopping}, return_when=asyncio.FIRST_COMPLETED)
            work.cancel()
            stopping.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await work
    finally:
        await llm.close()
        await store.close()


def run_demo(config: DemoConfig, console: Console) -> Summary:
    """Run the closed loop for ``config.minutes`` (or until Ctrl-C) and summarize it."""
    config.data_dir.mkdir(parents=True, exist_ok=True)
    console.print(f"starting PostgreSQL and NATS in {config.data_dir.absolute()} ...")
    with EmbeddedServers(config.data_dir) as servers:
        database_url, nats_url = servers.postgres.url, servers.nats.url
        migrate(database_url)
        servers_file = config.data_dir / SERVERS_FILE
        servers_file.write_text(servers.exports())
        model = config.data_dir / "models" / "tiny"
        if not (model / "config.json").is_file():
            from pipeline.inference.tinymodel import build_tiny_model

            console.print("building the tiny model ...")
            build_tiny_model(model)
        env = {k: v for k, v in os.environ.items() if not k.startswith("TURNSTILE_")}
        env.update(TURNSTILE_DATABASE_URL=database_url, TURNSTILE_NATS_URL=nats_url, HF_HUB_OFFLINE="1")
        services = Services(env, config.data_dir / "logs")
        since = int(_query(database_url, "SELECT coalesce(max(position), 0) FROM events")[0][0])
        started_wall = time.time()
        try:
            services.start("inference", "serve", "inference", "--policy", POLICY, "--model", str(model),
                           "--max-batch", "64")  # fmt: skip
            services.start(
                "materializer", "serve", "materializer", "--discount", "0.5", "--batch-samples",
                str(config.batch_samples), "--max-staleness", str(config.max_staleness),
                "--group-timeout", "60",
            )  # fmt: skip
            services.start("relay", "serve", "relay")
            services.start(
                "trainer", "serve", "trainer", "--policy", POLICY, "--model", str(model), "--checkpoints",
                str(config.data_dir / "checkpoints"), "--lr", str(config.lr), "--max-staleness",
                str(config.max_staleness), "--seed", str(config.seed),
            )  # fmt: skip
            console.print(
                f"services started (logs in {services.logs}); `turnstile sql` works from this directory "
                "while the demo runs. Ctrl-C stops everything."
            )
            asyncio.run(_drive(config, console, database_url, nats_url, since, services))
        finally:
            services.stop()
            servers_file.unlink(missing_ok=True)
        summary = _summarize(config, database_url, since, started_wall)
    return summary


async def _drive(
    config: DemoConfig, console: Console, database_url: str, nats_url: str, since: int, services: Services
) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    started = time.monotonic()
    deadline = started + config.minutes * 60
    runner = asyncio.create_task(_run_loop(config, database_url, nats_url, stop))
    render = console.is_terminal
    try:
        with (
            Live(console=console, refresh_per_second=2, transient=False)
            if render
            else contextlib.nullcontext() as live
        ):
            last_line = 0.0
            while not stop.is_set() and time.monotonic() < deadline and not runner.done():
                services.check()
                status = await asyncio.to_thread(_status, database_url, since, started)
                if live is not None:
                    live.update(_status_table(status, config.minutes))
                elif time.monotonic() - last_line >= 10:
                    last_line = time.monotonic()
                    mean = status["mean_reward_recent"]
                    shown = "-" if mean is None else f"{mean:.3f}"
                    console.print(
                        f"{status['elapsed']:.0f} s: {status['episodes']} episodes, "
                        f"{status['turns_per_s']:.0f} turns/s, {status['batches_trained']} batches trained, "
                        "policy version "
                        f"{status['policy_version']}, mean reward (last 200) {shown}"
                    )
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), 1.0)

    finally:
        # the runner closes its open episodes (cancelled) while the event store's writers still run
        stop.set()
        await runner


def _summarize(config: DemoConfig, database_url: str, since: int, started_wall: float) -> Summary:
    rewards = _rewards_since(database_url, since)
    summary = Summary(episodes=len(rewards))
    summary.turns = int(
        _query(
            database_url, "SELECT count(*) FROM events WHERE type = 'TurnCompleted' AND position > %s", since
        )[0][0]
    )
    window = min(config.window, max(len(rewards) // 3, 1))
    summary.first_window = mean_ci(rewards[:window])
    summary.last_window = mean_ci(rewards[-window:])
    bucket = max(len(rewards) // 30, 1)
    for start in range(0, len(rewards), bucket):
        mean, ci, _ = mean_ci(rewards[start : start + bucket])
        summary.curve.append((start + bucket, mean, ci))
    summary.batches_trained = int(
        _query(
            database_url,
            "SELECT count(*) FROM trained_batches "
            "WHERE outcome = 'trained' AND trained_at >= to_timestamp(%s)",
            started_wall,
        )[0][0]
    )
    versions = _query(
        database_url,
        "SELECT (data->>'version')::int, extract(epoch FROM recorded_at) FROM events WHERE stream = %s "
        "AND position > %s ORDER BY position",
        f"policy-{POLICY}",
        since,
    )
    if versions:
        summary.policy_version = int(versions[-1][0])
        summary.first_update_s = float(versions[0][1]) - started_wall
    first_row = _query(
        database_url,
        "SELECT extract(epoch FROM min(recorded_at)), extract(epoch FROM max(recorded_at)) FROM events "
        "WHERE type = 'TurnCompleted' AND position > %s",
        since,
    )[0]
    if first_row[0] is not None:
        summary.seconds = float(first_row[1]) - float(first_row[0])
    return summary


def report(summary: Summary, config: DemoConfig, console: Console) -> None:
    table = Table(title="turnstile demo: summary", show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    (first, first_ci, n_first), (last, last_ci, n_last) = summary.first_window, summary.last_window
    rows = {
        "episodes": str(summary.episodes),
        "turns": str(summary.turns),
        "episodes/s": f"{summary.episodes / max(summary.seconds, 1e-9):.1f}",
        "turns/s": f"{summary.turns / max(summary.seconds, 1e-9):.1f}",
        "batches trained": str(summary.batches_trained),
        "policy version": str(summary.policy_version),
        "first policy update after": "-"
        if summary.first_update_s is None
        else f"{summary.first_update_s:.0f} s",
        f"reward, first {n_first} episodes": f"{first:.3f} ± {first_ci:.3f}",
        f"reward, last {n_last} episodes": f"{last:.3f} ± {last_ci:.3f}",
        "learning": "[green]yes: the intervals do not overlap[/green]"
        if summary.improved
        else "[yellow]not measurable in this run[/yellow]",
    }
    for name, value in rows.items():
        table.add_row(name, value)
    console.print(table)
    if summary.curve:
        png = line_chart(
            config.data_dir / "reward_curve.png",
            [x for x, _, _ in summary.curve],
            [y for _, y, _ in summary.curve],
            low=[y - ci for _, y, ci in summary.curve],
            high=[y + ci for _, y, ci in summary.curve],
        )
        console.print(f"reward curve (mean reward per turn by episodes finished): {png}")
    (config.data_dir / "summary.json").write_text(
        json.dumps({**asdict(summary), "improved": summary.improved}, indent=2)
    )
    console.print("\nthe data stays; bring the servers back with `turnstile up` and try:")
    for query in TRY_QUERIES:
        console.print(f'  turnstile sql "{query}"', soft_wrap=True, highlight=False)
