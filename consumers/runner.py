"""Runner service: agents over tasks from a file (``turnstile run``) or from the ``TASKS`` work queue
(``turnstile serve runner``), with a runner lease and recovery of episodes that dead runners left open
(``consumers.runtime.episode_services``).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console

from consumers.runtime import METRICS_HOST, Connections, Runtime, episode_services, running, stop_on_signals
from pipeline.episodes import Agent, EpisodeOutcome, RewardFunction
from pipeline.runners import (
    Runner,
    RunnerConfig,
    RunStats,
    TaskLineError,
    TaskWorker,
    live_progress,
    read_tasks,
    run_tasks,
    stats_line,
    stats_table,
)
from pipeline.training import TrainerBacklog

log = logging.getLogger(__name__)


@dataclass
class RunResult:
    stats: RunStats
    outcomes: list[EpisodeOutcome] = field(default_factory=list)
    cancelled: bool = False
    recovered: list[str] = field(default_factory=list)


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

    async with episode_services(connections) as services:
        result.recovered = services.recovered
        if services.recovered:
            console.print(
                f"closed {len(services.recovered)} episodes left open by stopped runners as aborted"
            )
        runner = Runner(
            agent,
            store=services.store,
            llm=services.llm,
            config=config,
            reward_fn=reward_fn,
            runner_id=services.lease.runner_id,
            stats=stats,
        )
        work = asyncio.create_task(run_tasks(runner, read_tasks(tasks), on_task_error=bad_line))
        with stop_on_signals(work.cancel):
            async with live_progress(console, lambda: stats_table(stats), lambda: stats_line(stats)):
                try:
                    result.outcomes = await work
                except asyncio.CancelledError:
                    result.cancelled = True
        if result.cancelled:  # the summary counts what the log holds, not the outcomes returned
            await runner.count_cancelled()
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
    metrics_port: int | None = None,
    metrics_host: str = METRICS_HOST,
    max_batches_ahead: int | None = None,
    trainer: str = "trainer",
) -> TaskWorker:
    """``turnstile serve runner``: take tasks from ``tasks.<policy>`` until stopped (Ctrl-C, SIGTERM or
    ``stop``); every ``lease_timeout`` close episodes that dead runners left open. ``max_batches_ahead``:
    no new task while the trainer ``trainer`` has more batches than that waiting (``TrainerBacklog``)."""
    console = console or Console(stderr=True)
    async with (
        running("runner", stop=stop, metrics_port=metrics_port, metrics_host=metrics_host) as runtime,
        episode_services(connections, recover=True, runtime=runtime) as services,
    ):
        runner = Runner(
            agent,
            store=services.store,
            llm=services.llm,
            config=config,
            reward_fn=reward_fn,
            runner_id=services.lease.runner_id,
        )
        if max_batches_ahead is not None:
            runner.pace = TrainerBacklog(services.connection, trainer, max_batches_ahead)
        worker = TaskWorker(runner, services.connection, ack_wait=ack_wait)
        runtime.check("nats", lambda: services.connection.is_connected)
        instrument(runtime, runner.stats, worker, config.policy)
        console.print(
            f"runner [bold]{services.lease.runner_id}[/bold] taking tasks from tasks.{config.policy} "
            f"({config.concurrency} episodes at most)"
        )
        async with live_progress(
            console,
            lambda: stats_table(
                runner.stats, "turnstile serve runner", {"tasks done": str(worker.tasks_done)}
            ),
            lambda: f"tasks done {worker.tasks_done}; " + stats_line(runner.stats),
            every=10.0,
        ):
            await worker.run(runtime.stop)
    return worker


def instrument(runtime: Runtime, stats: RunStats, worker: TaskWorker, policy: str) -> None:
    """Episodes by outcome, turns, open episodes, tasks, and the reward of finished episodes (by policy)."""
    runtime.counter(
        "turnstile_runner_episodes_total",
        "episodes finished, by outcome (done: any ending but failure or cancellation)",
        lambda: {("done",): stats.done, ("failed",): stats.failed, ("cancelled",): stats.cancelled},
        ["outcome"],
    )
    runtime.counter(
        "turnstile_runner_episode_errors_total",
        "failed episodes by kind of error (the exception's name: messages would make a series each)",
        lambda: _by_kind(stats),
        ["kind"],
    )
    runtime.counter("turnstile_runner_turns_total", "LLM turns recorded", lambda: stats.turns)
    runtime.gauge("turnstile_runner_open_episodes", "episodes running now", lambda: stats.running)
    runtime.counter("turnstile_runner_tasks_total", "tasks done and acked", lambda: worker.tasks_done)
    runtime.counter(
        "turnstile_runner_tasks_refused_total", "tasks that could not be read", lambda: worker.tasks_refused
    )
    reward_metrics(runtime, stats, policy)


def reward_metrics(runtime: Runtime, stats: RunStats, policy: str) -> None:
    """The reward of finished episodes as two counters, the sum of positive rewards and the sum of negative
    ones' magnitudes, beside the count of rewarded episodes.

    Not one signed sum: a counter must never fall (Prometheus reads a fall as a restart, so ``rate()`` of a
    signed sum under negative rewards is nonsense: -2 where every reward was -1), and a histogram's
    ``_sum`` has the same flaw. The mean is (rate(positive) - rate(negative)) / rate(rewarded episodes), as
    Prometheus' documentation advises for observations that can be negative."""
    runtime.counter(
        "turnstile_runner_reward_total",
        "the sum of finished episodes' rewards of each sign, as magnitudes (negative: the sum of -reward "
        "over episodes whose reward was below 0), by policy",
        lambda: {(policy, "positive"): stats.reward_gained, (policy, "negative"): stats.reward_lost},
        ["policy", "sign"],
    )
    runtime.counter(
        "turnstile_runner_rewarded_episodes_total",
        "finished episodes with a reward, by policy",
        lambda: {(policy,): stats.rewards},
        ["policy"],
    )


def _by_kind(stats: RunStats) -> dict[tuple[str, ...], float]:
    kinds: dict[tuple[str, ...], float] = {}
    for cause, n in stats.causes.items():
        kind = (cause.split(":", 1)[0].strip()[:100] or "unknown",)
        kinds[kind] = kinds.get(kind, 0.0) + n
    return kinds
