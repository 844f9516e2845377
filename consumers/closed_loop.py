"""``turnstile demo``: the closed loop on one machine, in one command.

Embedded PostgreSQL and NATS, the tiny model, an inference consumer, the materializer, the batch relay and
the trainer as processes of their own (the same ``turnstile serve ...`` commands a deployment runs), and a
runner in this process feeding the demo task (``pipeline.examples.digits_or_capitals``) to the policy
``demo``. A live table shows the loop; at the end a summary compares the reward of the first and the last
episodes, a reward curve and the standard plots (``turnstile plot``) are saved as PNG, and ``summary.json``
holds the figures. The data stays in the data directory: ``turnstile up`` brings the servers back for
``turnstile sql``, and running the demo again resumes where it stopped (the trainer from its last
version, the materializer from its checkpoint).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table

from consumers.runtime import stop_on_signals
from pipeline.dev import (
    CHART_NAMES,
    NO_MATPLOTLIB,
    POLICY,
    TRY_QUERIES,
    EmbeddedServers,
    ServiceProcesses,
    Summary,
    batches_trained,
    curve_chart,
    draw,
    have_matplotlib,
    log_head,
    loop_status,
    read_charts,
    summarize,
)
from pipeline.episodes import RunnerLease, close_abandoned_episodes
from pipeline.examples import DigitsOrCapitalsAgent, demo_tasks
from pipeline.inference import NatsLLMClient
from pipeline.log import EventStore, make_logins, migrate
from pipeline.runners import Runner, RunnerConfig, TaskSpec, run_tasks
from pipeline.settings import SERVERS_FILE
from pipeline.training import TrainerBacklog
from schemas import SamplingParams


@dataclass(frozen=True)
class DemoConfig:
    data_dir: Path
    minutes: float = 3.0
    until_batches: int | None = None  # stop once this many batches are trained in this run (minutes bound it)
    seed: int = 0
    group_size: int = 8
    concurrency: int = 64
    max_tokens: int = 8
    batch_samples: int = 64
    lr: float = 3e-3
    max_staleness: int = 4
    max_batches_ahead: int | None = 0  # rollouts paced to the learner (TrainerBacklog); None: never wait
    window: int = 200


def _status_line(status: dict[str, Any]) -> str:
    mean = status["mean_reward_recent"]
    shown = "-" if mean is None else f"{mean:.3f}"
    return (
        f"{status['elapsed']:.0f} s: {status['episodes']} episodes, {status['turns_per_s']:.0f} turns/s, "
        f"{status['batches_trained']} batches trained, policy version {status['policy_version']}, "
        f"mean reward (last 200) {shown}"
    )


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
                    agent_name="pipeline.examples.digits_or_capitals:DigitsOrCapitalsAgent",
                    group_size=config.group_size,
                    concurrency=config.concurrency,
                    sampling=SamplingParams(temperature=1.0, max_tokens=config.max_tokens),
                    retries=0,
                ),
                runner_id=lease.runner_id,
            )
            if config.max_batches_ahead is not None:
                runner.pace = TrainerBacklog(
                    llm.connection, "trainer", config.max_batches_ahead, wait_for_trainer=True
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
    """Run the closed loop for ``config.minutes``, or until ``config.until_batches`` batches are trained, or
    until Ctrl-C; then summarize it."""
    config.data_dir.mkdir(parents=True, exist_ok=True)
    console.print(f"starting PostgreSQL and NATS in {config.data_dir.absolute()} ...")
    with EmbeddedServers(config.data_dir) as servers:
        database_url, nats_url = servers.postgres.url, servers.nats.url
        migrate(database_url)
        servers_file = config.data_dir / SERVERS_FILE
        logins = make_logins(database_url)  # the services and `turnstile sql` log in as everyday users
        servers_file.write_text(servers.exports(logins))
        model = config.data_dir / "models" / "tiny"
        if not (model / "config.json").is_file():
            from pipeline.inference.tinymodel import build_tiny_model

            console.print("building the tiny model ...")
            build_tiny_model(model)
        env = {k: v for k, v in os.environ.items() if not k.startswith("TURNSTILE_")}
        env.update(TURNSTILE_DATABASE_URL=logins.services, TURNSTILE_NATS_URL=nats_url, HF_HUB_OFFLINE="1")
        services = ServiceProcesses(env, config.data_dir / "logs")
        since = log_head(database_url)
        trained_before = batches_trained(database_url)
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
                str(config.max_staleness), "--seed", str(config.seed), "--micro-batch-tokens", "1024",
            )  # fmt: skip
            console.print(
                f"services started (logs in {services.logs}); `turnstile sql` works from this directory "
                "while the demo runs. Ctrl-C stops everything."
            )
            asyncio.run(_drive(config, console, database_url, nats_url, since, trained_before, services))
        finally:
            services.stop()
            servers_file.unlink(missing_ok=True)
        summary = summarize(database_url, since, started_wall, config.window)
        # the standard plots of every run on this data (the reward curve above is this run's), read as
        # `turnstile plot` reads them: through the reader login
        plots = config.data_dir / "plots"
        if have_matplotlib():  # else report() says how to get it
            for chart in read_charts(logins.reader, POLICY, [n for n in CHART_NAMES if n != "reward_curve"]):
                draw(chart, plots / f"{chart.name}.png")
            summary.plots = str(plots)
    return summary


async def _drive(
    config: DemoConfig,
    console: Console,
    database_url: str,
    nats_url: str,
    since: int,
    trained_before: int,
    services: ServiceProcesses,
) -> None:
    stop = asyncio.Event()
    with stop_on_signals(stop.set):
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
                    status = await asyncio.to_thread(loop_status, database_url, since, started)
                    wanted = config.until_batches
                    if wanted is not None and status["batches_trained"] - trained_before >= wanted:
                        break
                    if live is not None:
                        live.update(_status_table(status, config.minutes))
                    elif time.monotonic() - last_line >= 10:
                        last_line = time.monotonic()
                        console.print(_status_line(status))
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), 1.0)

        finally:
            # the runner closes its open episodes (cancelled) while the event store's writers still run
            stop.set()
            await runner


def _share(skipped: int, trained: int) -> str:
    taken = skipped + trained
    return f"{skipped} of {taken} ({skipped / taken:.0%})" if taken else "0"


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
        "batches skipped as stale": _share(summary.batches_skipped, summary.batches_trained),
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
    if not have_matplotlib():
        console.print(f"[yellow]{NO_MATPLOTLIB}[/yellow]")
    elif summary.curve:
        png = draw(curve_chart(summary.curve, policy=POLICY), config.data_dir / "reward_curve.png")
        console.print(f"reward curve (mean reward per turn by episodes finished): {png}")
    if summary.plots:
        console.print(
            f"plots of the whole run (`turnstile plot` draws them again at any time): {summary.plots}"
        )
    (config.data_dir / "summary.json").write_text(
        json.dumps({**asdict(summary), "improved": summary.improved}, indent=2)
    )
    console.print("\nthe data stays; bring the servers back with `turnstile up` and try:")
    for sql_text in TRY_QUERIES:
        console.print(f'  turnstile sql "{sql_text}"', soft_wrap=True, highlight=False)
