"""Runner service: agents over tasks from a file (``turnstile run``) or from the ``TASKS`` work queue
(``turnstile serve runner``), with a runner lease and recovery of episodes that dead runners left open.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import nats
from nats.aio.client import Client as NatsConnection
from rich.console import Console

from pipeline.episodes import Agent, EpisodeOutcome, RewardFunction
from pipeline.episodes.leases import RunnerLease, close_abandoned_episodes
from pipeline.inference.client import NatsLLMClient
from pipeline.log import EventStore
from pipeline.runners.progress import live_progress, stats_line, stats_table
from pipeline.runners.runner import Runner, RunnerConfig, RunStats, TaskLineError, read_tasks, run_tasks
from pipeline.runners.taskqueue import TaskWorker

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Connections:
    database_url: str
    nats_url: str
    heartbeat_timeout: float = 15.0
    lease_timeout: float = 30.0


@dataclass
class RunResult:
    stats: RunStats
    outcomes: list[EpisodeOutcome] = field(default_factory=list)
    cancelled: bool = False
    recovered: list[str] = field(default_factory=list)


@contextlib.asynccontextmanager
async def runner_services(
    connections: Connections,
) -> AsyncIterator[tuple[EventStore, NatsConnection, NatsLLMClient, RunnerLease, list[str]]]:
    """The store, a NATS connection, an LLM client and a runner lease; episodes left open by dead runners
    are closed first (``aborted``)."""
    store = await EventStore.connect(connections.database_url)
    connection = await nats.connect(connections.nats_url, max_reconnect_attempts=-1, reconnect_time_wait=0.5)
    llm = NatsLLMClient(connection, heartbeat_timeout=connections.heartbeat_timeout)
    try:
        recovered = await close_abandoned_episodes(store, lease_timeout=connections.lease_timeout)
        async with RunnerLease(store, interval=connections.lease_timeout / 6) as lease:
            yield store, connection, llm, lease, recovered
    finally:
        await llm.close()
        with contextlib.suppress(Exception):
            await connection.drain()
        await store.close()


def _on_interrupt(callback: Callable[[], object]) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, callback)


async def run_task_file(
    connections: Connections,
    agent: Agent,
    config: RunnerConfig,
    tasks: Path,
    *,
    reward_fn: RewardFunction | None = None,
    console: Console | None = None,
) -> RunResult:
    """``turnstile run``: every task of the file, ``group_size`` episodes each. Ctrl-C (or SIGTERM) cancels:
    open episodes are recorded as ``cancelled``."""
    console = console or Console(stderr=True)
    stats = RunStats()
    result = RunResult(stats)

    def bad_line(error: TaskLineError) -> None:
        console.print(f"[red]task file {tasks}, {error}[/red] (skipped; the other tasks run)")

    async with runner_services(connections) as (store, _, llm, lease, recovered):
        result.recovered = recovered
        if recovered:
            console.print(f"closed {len(recovered)} episodes left open by stopped runners as aborted")
        runner = Runner(
            agent,
            store=store,
            llm=llm,
            config=config,
            reward_fn=reward_fn,
            runner_id=lease.runner_id,
            stats=stats,
        )
        work = asyncio.create_task(run_tasks(runner, read_tasks(tasks), on_task_error=bad_line))
        _on_interrupt(work.cancel)
        async with live_progress(console, lambda: stats_table(stats), lambda: stats_line(stats)):
            try:
                result.outcomes = await work
            except asyncio.CancelledError:
                result.cancelled = True
    return result


async def serve_runner(
    connections: Connections,
    agent: Agent,
    config: RunnerConfig,
    *,
    reward_fn: RewardFunction | None = None,
    ack_wait: float = 60.0,
    stop: asyncio.Event | None = None,
    console: Console | None = None,
) -> TaskWorker:
    """``turnstile serve runner``: take tasks from ``tasks.<policy>`` until stopped (Ctrl-C, SIGTERM or
    ``stop``); every ``lease_timeout`` close episodes that dead runners left open."""
    console = console or Console(stderr=True)
    stop = stop or asyncio.Event()
    _on_interrupt(stop.set)
    async with runner_services(connections) as (store, connection, llm, lease, _):
        runner = Runner(
            agent, store=store, llm=llm, config=config, reward_fn=reward_fn, runner_id=lease.runner_id
        )
        worker = TaskWorker(runner, connection, ack_wait=ack_wait)
        console.print(
            f"runner [bold]{lease.runner_id}[/bold] taking tasks from tasks.{config.policy} "
            f"({config.concurrency} episodes at most)"
        )

        async def recover() -> None:
            while True:
                await asyncio.sleep(connections.lease_timeout)
                try:
                    await close_abandoned_episodes(store, lease_timeout=connections.lease_timeout)
                except Exception as error:
                    log.warning(
                        "recovery pass failed (%s); next pass in %.0f s", error, connections.lease_timeout
                    )

        recovery = asyncio.create_task(recover())
        try:
            async with live_progress(
                console,
                lambda: stats_table(
                    runner.stats, "turnstile serve runner", {"tasks done": str(worker.tasks_done)}
                ),
                lambda: f"tasks done {worker.tasks_done}; " + stats_line(runner.stats),
                every=10.0,
            ):
                await worker.run(stop)
        finally:
            recovery.cancel()
    return worker
