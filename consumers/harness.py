"""``turnstile harness run`` and ``turnstile serve harness``: the harness (pipeline/harness) over tasks from
files or from the HARNESS_TASKS work queue, with live progress; Ctrl-C and SIGTERM end open sessions
``cancelled`` and stop every sandbox."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

from nats.aio.client import Client as NatsConnection
from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.api import ConsumerConfig
from nats.js.client import JetStreamContext
from pydantic import ValidationError
from rich.console import Console

from consumers.runtime import connect_nats, running, stop_on_signals
from pipeline.errors import ConfigError
from pipeline.harness import (
    Harness,
    HarnessConfig,
    HarnessStats,
    HarnessTask,
    Recovered,
    backend,
    opened_harness,
    queued_task,
    run_harness,
)
from pipeline.runners import (
    PASSING_FETCH_ERRORS,
    RunningTasks,
    Working,
    ensure_tasks_stream,
    harness_durable,
    live_progress,
    task_stream,
    task_subject,
)
from pipeline.settings import jetstream
from schemas import IGNORE, TOLERANT, TaskSubmitted

log = logging.getLogger(__name__)


@dataclass
class HarnessResult:
    stats: HarnessStats
    cancelled: bool = False


async def harness_run(
    config: HarnessConfig, tasks: list[HarnessTask], sandbox: str, console: Console
) -> HarnessResult:
    """Run every task x group size under ``sandbox``; stopped by a signal, it returns ``cancelled``."""
    stats = HarnessStats()
    result = HarnessResult(stats)

    def announce(_: object, recovered: Recovered) -> None:
        if recovered.sandboxes or recovered.sessions:
            console.print(
                f"removed {recovered.sandboxes} sandboxes and ended {recovered.sessions} sessions (aborted) "
                f"left by a stopped harness of owner {config.owner!r}"
            )
        console.print(
            f"harness {config.owner!r}: {len(tasks)} tasks x {config.group_size}, "
            f"agent {config.agent.name!r}, "
            f"sandbox {sandbox!r}, {config.concurrency} at a time, gateway {config.gateway}"
        )

    work = asyncio.create_task(run_harness(config, tasks, backend(sandbox), stats=stats, on_start=announce))
    with stop_on_signals(work.cancel):
        async with live_progress(console, stats.table, stats.line):
            try:
                await work
            except asyncio.CancelledError:
                result.cancelled = True
    return result


async def harness_tasks(
    connection: NatsConnection, policy: str, *, ack_wait: float
) -> JetStreamContext.PullSubscription:
    """The durable pull consumer every ``serve harness`` of ``policy`` shares, on ``harness.tasks.<policy>``
    in ``HARNESS_TASKS``: all the harness role may take (deploy/nats.conf)."""
    await ensure_tasks_stream(connection, harness=True)
    return await jetstream(connection).pull_subscribe(
        task_subject(policy, harness=True),
        durable=harness_durable(policy),
        stream=task_stream(harness=True),
        config=ConsumerConfig(ack_wait=ack_wait, max_deliver=20, max_ack_pending=-1),
    )


class HarnessQueue:
    """``turnstile serve harness``: groups from ``harness.tasks.<policy>`` (``turnstile submit --harness``),
    ``concurrency`` episodes at a time on this machine, any number of machines. A task is acked once its
    group's episodes all ended; while it runs the server is told so (``in_progress``) every third of
    ``ack_wait`` (``RunningTasks``). A harness that dies stops doing that, and the task goes to another
    harness after ``ack_wait``, which runs the whole group again as a new group (the dead one's episodes are
    ended ``aborted`` by the next start of its owner). A task delivered again to the harness still running
    it (its notes lost in an outage of NATS longer than ``ack_wait``) joins that run: one group, and the
    latest delivery is the one acked."""

    def __init__(self, harness: Harness, connection: NatsConnection, *, ack_wait: float = 60.0) -> None:
        self.harness = harness
        self.connection = connection
        self.ack_wait = ack_wait
        self.tasks_done = 0
        self.tasks_refused = 0
        self.running = RunningTasks(ack_wait)
        self._working = Working()

    async def run(self, stop: asyncio.Event) -> None:
        policy = self.harness.config.policy or ""
        subscription = await harness_tasks(self.connection, policy, ack_wait=self.ack_wait)
        try:
            # at the stop, each running group's episodes end cancelled; unacked, its task comes back to
            # another harness
            async with self._working.until(stop):
                while not stop.is_set():
                    if len(self._working) >= self.harness.config.concurrency:  # one group per slot at most
                        await self._working.wait()  # until a group finishes (or the stop)
                        continue
                    try:
                        messages = await subscription.fetch(1, timeout=1.0)
                    except (NatsTimeoutError, TimeoutError):
                        continue
                    except PASSING_FETCH_ERRORS as error:
                        log.warning("harness task queue: %s; trying again", error or type(error).__name__)
                        await asyncio.sleep(0.5)
                        continue
                    for message in messages:
                        self._working.start(self._work(message))
        finally:
            with contextlib.suppress(Exception):
                await subscription.unsubscribe()

    async def _work(self, message: Msg) -> None:
        try:
            submitted = TaskSubmitted.model_validate_json(message.data, context=TOLERANT, extra=IGNORE)
            task = queued_task(submitted.task, submitted.task_id)
        except (ValidationError, ConfigError) as error:
            self.tasks_refused += 1
            log.error("refused a task on %s: %s; it is dropped", message.subject, error)
            await message.term()
            return
        key = str(submitted.submission_id)
        if self.running.join(key, message):
            return
        async with self.running.kept_alive_then_acked(key, message):
            await self.harness.run_group(task, submitted.group_size)
        self.tasks_done += 1


async def serve_harness(
    config: HarnessConfig,
    sandbox: str,
    nats_url: str,
    console: Console,
    *,
    stop: asyncio.Event | None = None,
    ack_wait: float = 60.0,
    stats: HarnessStats | None = None,
) -> HarnessQueue | None:
    """Take harness tasks from the queue until stopped (SIGINT, SIGTERM or ``stop``); the owner's lock and
    clean-up as for ``turnstile harness run``."""
    async with (
        opened_harness(config, backend(sandbox), stats) as (harness, recovered),
        running("harness", stop=stop) as runtime,
    ):
        subject = task_subject(config.policy or "", harness=True)
        console.print(
            f"harness {config.owner!r} taking tasks from {subject} "
            f"({config.concurrency} episodes at most, sandbox {sandbox!r}); cleaned up "
            f"{recovered.sandboxes} sandboxes and {recovered.sessions} sessions of a stopped harness"
        )
        connection = await connect_nats(nats_url, stop=runtime.stop, runtime=runtime)
        if connection is None:  # stopped before NATS answered
            return None
        queue = HarnessQueue(harness, connection, ack_wait=ack_wait)
        try:
            async with live_progress(console, harness.stats.table, harness.stats.line, every=10.0):
                await queue.run(runtime.stop)
        finally:
            await connection.drain()
        return queue
