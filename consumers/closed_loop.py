"""``turnstile demo``: the closed loop on one machine, in one command.

Embedded PostgreSQL and NATS, the tiny model, an inference consumer, the materializer, the batch relay and
the trainer as processes of their own (the same ``turnstile serve ...`` commands a deployment runs), and a
runner in this process feeding the demo task (``pipeline.examples.digits_or_capitals``) to the policy
``demo``. With ``--harness`` the agent is a black box instead: a gateway process, and the harness in this
process running a command agent (``examples/harness_shell_agent.py``) per episode in a sandbox on the task
directories of ``examples/harness-demo``, each scored by its verifier, on the long-context tiny model and the
policy ``harness-demo``.

A live table shows the loop; at the end a summary compares the reward of the first and the last
episodes, a reward curve and the standard plots (``turnstile plot``) are saved as PNG, and ``summary.json``
holds the figures. The data stays in the data directory: ``turnstile up`` brings the servers back for
``turnstile sql``, and running the demo again resumes where it stopped (the trainer from its last
version, the materializer from its checkpoint).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import secrets
import shutil
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table

from consumers.runtime import stop_on_signals
from pipeline.dev import (
    CHART_NAMES,
    HARNESS_POLICY,
    NO_MATPLOTLIB,
    POLICY,
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
    try_queries,
)
from pipeline.episodes import RunnerLease, close_abandoned_episodes
from pipeline.examples import DigitsOrCapitalsAgent, demo_tasks
from pipeline.harness import HarnessConfig, agent_spec, backend, load_tasks, opened_harness, python_mounts
from pipeline.inference import NatsLLMClient
from pipeline.log import EventStore, make_logins, migrate
from pipeline.runners import Runner, RunnerConfig, TaskSpec, run_tasks
from pipeline.settings import SERVERS_FILE
from pipeline.training import TrainerBacklog
from schemas import SamplingParams

REPOSITORY = Path(__file__).resolve().parents[1]
HARNESS_TASKS = REPOSITORY / "examples" / "harness-demo"
"""The closed loop's task directories (Harbor's format): a verifier whose reward a random policy earns a
little of and a trained one more."""
HARNESS_AGENT = "$python $examples/harness_shell_agent.py --answer answer.txt"
"""The black-box agent of ``--harness``: the openai SDK's chat loop, its final reply left for the verifier."""
GATEWAY_URL = r" on (http://[\d.]+:\d+): "
"""How the gateway names the URL it bound (``--port 0``) in its log."""


@dataclass(frozen=True)
class HarnessDemo:
    """``turnstile demo --harness``: the tasks and the sandbox backend its agents run in."""

    tasks: Path = HARNESS_TASKS
    sandbox: str = "none"


def default_sandbox() -> str:
    """bwrap where Debian's bubblewrap is installed (isolated, no daemon), else the process sandbox."""
    return "bwrap" if shutil.which("bwrap") else "none"


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
    harness: HarnessDemo | None = None  # a black-box agent under the harness instead of the runner's agent

    @property
    def policy(self) -> str:
        return POLICY if self.harness is None else HARNESS_POLICY

    @property
    def checkpoints(self) -> Path:
        return (
            self.data_dir / "checkpoints"
            if self.harness is None
            else self.data_dir / "checkpoints" / HARNESS_POLICY
        )

    @property
    def durable(self) -> str:
        """The trainer's name: one per policy, so both demos may share a data directory."""
        return "trainer" if self.harness is None else f"trainer-{HARNESS_POLICY}"


def _status_line(status: dict[str, Any]) -> str:
    mean = status["mean_reward_recent"]
    shown = "-" if mean is None else f"{mean:.3f}"
    return (
        f"{status['elapsed']:.0f} s: {status['episodes']} episodes, {status['turns_per_s']:.1f} turns/s, "
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
                    policy=config.policy,
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
            await _until(run_tasks(runner, tasks), stop)
    finally:
        await llm.close()
        await store.close()


async def _run_harness_loop(
    config: DemoConfig, nats_url: str, gateway_url: str, admin_key: str, stop: asyncio.Event
) -> None:
    """The harness over ``config.harness.tasks`` in groups, paced to the learner, until ``stop``: stopped,
    its open sessions end ``cancelled`` and every sandbox is removed."""
    assert config.harness is not None
    harness_config = HarnessConfig(
        gateway=gateway_url, admin_key=admin_key, agent=agent_spec("command", HARNESS_AGENT),
        owner=_owner(config.data_dir), state_dir=config.data_dir / "harness",
        group_size=config.group_size, concurrency=config.concurrency, policy=HARNESS_POLICY,
        mounts=python_mounts(), sampling=SamplingParams(temperature=1.0, max_tokens=config.max_tokens),
    )  # fmt: skip
    tasks = load_tasks([config.harness.tasks])
    llm = await NatsLLMClient.connect(nats_url, wait_for_consumer=120.0)  # NATS, for the trainer's backlog
    try:
        async with opened_harness(harness_config, backend(config.harness.sandbox)) as (harness, _):
            pace = None
            if config.max_batches_ahead is not None:
                pace = TrainerBacklog(
                    llm.connection, config.durable, config.max_batches_ahead, wait_for_trainer=True
                )
            await _until(harness.run_continuously(tasks, pace), stop)
    finally:
        await llm.close()


def _owner(data_dir: Path) -> str:
    """The demo harness's owner: one per data directory, so that a demo's start-up sweep (which removes what
    a killed harness of its owner left) never touches another data directory's sandboxes."""
    return f"{HARNESS_POLICY}-{hashlib.sha256(str(data_dir.resolve()).encode()).hexdigest()[:8]}"


async def _until(work: Awaitable[object], stop: asyncio.Event) -> None:
    """``work`` until it ends or ``stop`` is set; then cancelled and awaited (its clean-up done)."""
    working = asyncio.ensure_future(work)
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait({working, stopping}, return_when=asyncio.FIRST_COMPLETED)
    working.cancel()
    stopping.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await working


def _model(config: DemoConfig, console: Console) -> Path:
    """The tiny model (the long-context one for ``--harness``: agents' prompts), built on first use."""
    from pipeline.inference.tinymodel import build_long_model, build_tiny_model

    name, build = ("tiny", build_tiny_model) if config.harness is None else ("long", build_long_model)
    model = config.data_dir / "models" / name
    if not (model / "config.json").is_file():
        console.print(f"building the {name} model ...")
        build(model)
    return model


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
        model = _model(config, console)
        env = {k: v for k, v in os.environ.items() if not k.startswith("TURNSTILE_")}
        env.update(TURNSTILE_DATABASE_URL=logins.services, TURNSTILE_NATS_URL=nats_url, HF_HUB_OFFLINE="1")
        env.update(COLUMNS="400")  # log lines unwrapped: the gateway's URL is read from its log
        services = ServiceProcesses(env, config.data_dir / "logs")
        since = log_head(database_url)
        trained_before = batches_trained(database_url)
        started_wall = time.time()
        try:
            policy = config.policy
            services.start("inference", "serve", "inference", "--policy", policy, "--model", str(model),
                           "--max-batch", "64")  # fmt: skip
            services.start(
                "materializer", "serve", "materializer", "--discount", "0.5", "--batch-samples",
                str(config.batch_samples), "--max-staleness", str(config.max_staleness),
                "--group-timeout", "60",
            )  # fmt: skip
            services.start("relay", "serve", "relay")
            services.start(
                "trainer", "serve", "trainer", "--policy", policy, "--model", str(model), "--checkpoints",
                str(config.checkpoints),
                "--durable", config.durable, "--lr", str(config.lr), "--max-staleness",
                str(config.max_staleness), "--seed", str(config.seed), "--micro-batch-tokens", "1024",
            )  # fmt: skip
            loop = _loop(config, services, database_url, nats_url)
            console.print(
                f"services started (logs in {services.logs}); `turnstile sql` works from this directory "
                "while the demo runs. Ctrl-C stops everything."
            )
            asyncio.run(_drive(config, console, database_url, since, trained_before, services, loop))
        finally:
            services.stop()
            servers_file.unlink(missing_ok=True)
        summary = summarize(database_url, since, started_wall, config.window, config.policy)
        # the standard plots of every run on this data (the reward curve above is this run's), read as
        # `turnstile plot` reads them: through the reader login
        plots = config.data_dir / "plots"
        if have_matplotlib():  # else report() says how to get it
            names = [n for n in CHART_NAMES if n != "reward_curve"]
            for chart in read_charts(logins.reader, config.policy, names):
                draw(chart, plots / f"{chart.name}.png")
            summary.plots = str(plots)
    return summary


Loop = Callable[[asyncio.Event], Coroutine[Any, Any, None]]
"""What feeds the loop episodes until the event is set: the runner, or the harness."""


def _loop(config: DemoConfig, services: ServiceProcesses, database_url: str, nats_url: str) -> Loop:
    """The runner on the demo task; with ``--harness``, a gateway process and the harness before it."""
    if config.harness is None:
        return lambda stop: _run_loop(config, database_url, nats_url, stop)
    admin_key = secrets.token_hex(32)
    services.start(
        "gateway", "serve", "gateway", "--port", "0", "--policy-default", HARNESS_POLICY,
        "--max-open-sessions", str(4 * config.concurrency), env={"TURNSTILE_ADMIN_KEY": admin_key},
    )  # fmt: skip
    gateway_url = services.wait_for_log("gateway", GATEWAY_URL).group(1)
    return lambda stop: _run_harness_loop(config, nats_url, gateway_url, admin_key, stop)


async def _drive(
    config: DemoConfig,
    console: Console,
    database_url: str,
    since: int,
    trained_before: int,
    services: ServiceProcesses,
    loop: Loop,
) -> None:
    stop = asyncio.Event()
    with stop_on_signals(stop.set):
        started = time.monotonic()
        deadline = started + config.minutes * 60
        runner = asyncio.create_task(loop(stop))
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
                    status = await asyncio.to_thread(loop_status, database_url, since, started, config.policy)
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
        png = draw(curve_chart(summary.curve, policy=config.policy), config.data_dir / "reward_curve.png")
        console.print(f"reward curve (mean reward per turn by episodes finished): {png}")
    if summary.plots:
        console.print(
            f"plots of the whole run (`turnstile plot` draws them again at any time): {summary.plots}"
        )
    (config.data_dir / "summary.json").write_text(
        json.dumps({**asdict(summary), "improved": summary.improved}, indent=2)
    )
    console.print("\nthe data stays; bring the servers back with `turnstile up` and try:")
    for sql_text in try_queries(config.policy):
        console.print(f'  turnstile sql "{sql_text}"', soft_wrap=True, highlight=False)
