"""The ``TASKS`` work queue: ``turnstile submit`` puts tasks on it, runners on any machine take them
(harness tasks, ``turnstile submit --harness``, have a work queue of their own: ``HARNESS_TASKS``).

A JetStream stream with work-queue retention (a message is gone once acked) and one durable pull consumer
per policy shared by every runner. A runner acks a task only after all of its group's episodes are
finished and recorded; while it works it tells the server so (``in_progress``) every third of
``ack_wait``. A runner that dies stops doing that, and after ``ack_wait`` the task goes to another runner,
which resumes the group from what the log holds (see ``pipeline.runners.runner``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import AsyncIterator, Coroutine, Iterable
from typing import Any, Final

import stamina
from nats.aio.client import Client as NatsConnection
from nats.aio.msg import Msg
from nats.errors import ConnectionClosedError, NoServersError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.api import ConsumerConfig, RetentionPolicy, StreamConfig
from nats.js.errors import BadRequestError, NotFoundError, ServiceUnavailableError
from pydantic import ValidationError

from pipeline.errors import ConfigError, describe_validation_error
from pipeline.runners.runner import Runner, TaskSpec
from pipeline.settings import jetstream
from schemas import IGNORE, TOLERANT, TaskSubmitted

log = logging.getLogger(__name__)

TASKS_STREAM: Final = "TASKS"
HARNESS_TASKS_STREAM: Final = "HARNESS_TASKS"
OLD_HARNESS_SUBJECTS: Final = "tasks.harness.>"
"""Where harness tasks were queued before ``HARNESS_TASKS``: on ``TASKS``, where no harness takes them now."""
ACK_ATTEMPTS: Final = 5
PASSING_FETCH_ERRORS: Final = (ConnectionClosedError, NoServersError, NotFoundError, ServiceUnavailableError)
"""What a pull from a task queue may meet that passes: a server gone, or (on a cluster) the stream's or
consumer's leader moving. The worker waits half a second and pulls again."""


def task_subject(policy: str, *, harness: bool = False) -> str:
    """``tasks.<policy>`` for runners; ``harness.tasks.<policy>`` for harnesses (a harness task is another
    kind: a task directory or a verifier)."""
    return f"harness.tasks.{policy}" if harness else f"tasks.{policy}"


def task_stream(*, harness: bool = False) -> str:
    """The work queue of a kind of task. One stream per kind, because a pull (``CONSUMER.MSG.NEXT``) and an
    ack (``$JS.ACK``) name the stream and the consumer, and a NATS permission's wildcard matches whole
    tokens only: it cannot tell ``runners-<policy>`` from ``harness-<policy>``, but it can tell streams
    apart, so each role may pull and ack on its own stream only (deploy/nats.conf)."""
    return HARNESS_TASKS_STREAM if harness else TASKS_STREAM


def runner_durable(policy: str) -> str:
    return _durable("runners", policy)


def harness_durable(policy: str) -> str:
    return _durable("harness", policy)


def _durable(kind: str, policy: str) -> str:
    """The durable consumer every worker of ``kind`` for ``policy`` shares (a name NATS takes)."""
    return f"{kind}-" + re.sub(r"[^A-Za-z0-9_-]", "_", policy)


async def ensure_tasks_stream(
    connection: NatsConnection, *, replicas: int = 1, harness: bool = False
) -> None:
    """Create the work queue of runners' tasks (or harnesses') if it does not exist (``replicas`` copies on
    a JetStream cluster: 3 survives the loss of a node); an existing one is kept as it is."""
    js = jetstream(connection)
    name = task_stream(harness=harness)
    config = StreamConfig(
        name=name,
        subjects=[task_subject(">", harness=harness)],
        retention=RetentionPolicy.WORK_QUEUE,
        duplicate_window=600.0,
        num_replicas=replicas,
    )
    try:
        await js.add_stream(config)
    except BadRequestError:
        # Exists with another configuration (e.g. made by an operator): keep it if it is a work queue.
        info = await js.stream_info(name)
        if info.config.retention != RetentionPolicy.WORK_QUEUE:
            raise ConfigError(
                f"JetStream stream {name} exists but is not a work queue; delete it "
                f"(`nats stream rm {name}`) and let Turnstile create it"
            ) from None


async def old_harness_tasks(connection: NatsConnection) -> dict[str, int]:
    """Harness tasks still waiting where they were queued before ``HARNESS_TASKS`` (``tasks.harness.<policy>``
    on ``TASKS``), by subject: no harness takes them any more, so the operator is told (``turnstile submit
    --harness``). Empty if there is no ``TASKS``."""
    try:
        info = await jetstream(connection).stream_info(TASKS_STREAM, subjects_filter=OLD_HARNESS_SUBJECTS)
    except NotFoundError:
        return {}
    return dict(info.state.subjects or {})


async def submit_tasks(
    connection: NatsConnection,
    policy: str,
    tasks: Iterable[TaskSpec],
    *,
    group_size: int = 1,
    harness: bool = False,
) -> list[TaskSubmitted]:
    """Publish each task (for runners, or for harnesses) and wait for JetStream to store it; the messages
    sent."""
    await ensure_tasks_stream(connection, harness=harness)
    js = jetstream(connection)
    sent = []
    for spec in tasks:
        message = TaskSubmitted(policy=policy, task=spec.task, task_id=spec.task_id, group_size=group_size)
        await js.publish(
            task_subject(policy, harness=harness),
            message.model_dump_json().encode(),
            headers={"Nats-Msg-Id": str(message.submission_id)},
        )
        sent.append(message)
    return sent


class RunningTasks:
    """The tasks a worker is running, by submission id, each with its latest delivery.

    While a task runs, its latest delivery is told ``in_progress`` every third of ``ack_wait``. If no such
    note reaches the server for ``ack_wait`` (an outage of NATS or of the worker's connection), the task is
    delivered again; when it comes back to the worker still running it, it ``join``s that run, which keeps
    it alive and acks it, the latest, instead of running the task again."""

    def __init__(self, ack_wait: float) -> None:
        self.ack_wait = ack_wait
        self.joined = 0
        """Deliveries that joined a run of their task already here."""
        self._latest: dict[str, Msg] = {}

    def join(self, key: str, message: Msg) -> bool:
        """Whether task ``key`` runs here already; if so, ``message`` becomes its latest delivery."""
        if key not in self._latest:
            return False
        self._latest[key] = message
        self.joined += 1
        log.info("task %s delivered again while running here: the run goes on", key)
        return True

    @contextlib.asynccontextmanager
    async def kept_alive_then_acked(self, key: str, message: Msg) -> AsyncIterator[None]:
        """Task ``key`` (delivered as ``message``) running here while the block runs, kept alive; once the
        block ends without an error, its latest delivery is acked (``ack_retrying``). A block that raises (a
        stop, a crash) leaves it unacked, for the server to deliver again."""
        self._latest[key] = message
        keepalive = asyncio.create_task(self._keep_alive(key))
        try:
            yield
        finally:
            keepalive.cancel()
            latest = self._latest.pop(key)
        await ack_retrying(latest)

    async def _keep_alive(self, key: str) -> None:
        while True:
            await asyncio.sleep(self.ack_wait / 3)
            with contextlib.suppress(Exception):  # a lost one only risks an early redelivery
                await self._latest[key].in_progress()


class Working:
    """The tasks a queue's worker runs at once. Each says itself when it finishes (``wait`` returns), so
    a full worker waits for a slot at a cost that does not grow with the concurrency, as an ``asyncio.wait``
    over every task in flight did (a callback put on each and taken off again per finished task)."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[None]] = set()
        self._freed = asyncio.Event()

    def __len__(self) -> int:
        return len(self._tasks)

    def start(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        self._freed.set()

    async def wait(self) -> None:
        """Until a task finishes, or the stop of ``until``."""
        self._freed.clear()
        await self._freed.wait()

    @contextlib.asynccontextmanager
    async def until(self, stop: asyncio.Event) -> AsyncIterator[asyncio.Future[Any]]:
        """The worker's loop: while the block runs, ``stop`` being set also ends a ``wait`` (the future that
        says so is yielded, for the worker's other waits); after it, every task still running is cancelled
        and waited for."""
        stopping = asyncio.ensure_future(stop.wait())
        stopping.add_done_callback(lambda _: self._freed.set())
        try:
            yield stopping
        finally:
            stopping.cancel()
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)


class TaskWorker:
    """Takes tasks for ``runner.config.policy`` off the queue and runs them, ``concurrency`` episodes at
    most. ``await worker.run(stop)`` until ``stop`` is set; tasks in progress are then left unacked
    (their episodes end ``cancelled``) for another runner."""

    def __init__(
        self,
        runner: Runner,
        connection: NatsConnection,
        *,
        ack_wait: float = 60.0,
        max_deliver: int = 20,
        fetch_timeout: float = 1.0,
    ) -> None:
        self.runner = runner
        self.connection = connection
        self.ack_wait = ack_wait
        self.max_deliver = max_deliver
        self.fetch_timeout = fetch_timeout
        self.tasks_done = 0
        self.tasks_refused = 0
        self.running = RunningTasks(ack_wait)
        self._episodes_in_flight = 0
        self._working = Working()

    @property
    def policy(self) -> str:
        return self.runner.config.policy

    async def subscribe(self) -> Any:
        await ensure_tasks_stream(self.connection)
        js = jetstream(self.connection)
        config = ConsumerConfig(ack_wait=self.ack_wait, max_deliver=self.max_deliver, max_ack_pending=-1)
        return await js.pull_subscribe(
            task_subject(self.policy), durable=runner_durable(self.policy), stream=TASKS_STREAM, config=config
        )

    async def run(self, stop: asyncio.Event) -> None:
        subscription = await self.subscribe()
        capacity = self.runner.config.concurrency
        try:
            async with self._working.until(stop) as stopping:
                while not stop.is_set():
                    room = capacity - self._episodes_in_flight
                    if room < self.runner.config.group_size and self._working:
                        await self._working.wait()  # full: until a task finishes (or the stop)
                        continue
                    if self.runner.pace is not None:  # the learner's backlog full: no new task yet
                        pacing = asyncio.ensure_future(self.runner.pace())
                        await asyncio.wait({pacing, stopping}, return_when=asyncio.FIRST_COMPLETED)
                        if not pacing.done():
                            pacing.cancel()
                            continue
                    try:
                        messages = await subscription.fetch(
                            max(1, room // self.runner.config.group_size), timeout=self.fetch_timeout
                        )
                    except (NatsTimeoutError, TimeoutError):
                        continue
                    except PASSING_FETCH_ERRORS as error:
                        log.warning("task queue: %s; trying again", error or type(error).__name__)
                        await asyncio.sleep(0.5)
                        continue
                    for message in messages:
                        self._working.start(self._work(message))
        finally:
            with contextlib.suppress(Exception):  # else draining the connection waits on its pull requests
                await subscription.unsubscribe()

    async def _work(self, message: Msg) -> None:
        try:
            submitted = TaskSubmitted.model_validate_json(message.data, context=TOLERANT, extra=IGNORE)
        except ValidationError as error:
            self.tasks_refused += 1
            problem = describe_validation_error(error)
            log.error("refused a task on %s: %s; it is dropped", message.subject, problem)
            await message.term()
            return
        key = str(submitted.submission_id)
        if self.running.join(key, message):
            return
        size = submitted.group_size
        self._episodes_in_flight += size
        try:
            async with self.running.kept_alive_then_acked(key, message):
                spec = TaskSpec(task=submitted.task, task_id=submitted.task_id)
                await self.runner.run_group(spec, key, size, resume=message.metadata.num_delivered > 1)
            self.tasks_done += 1
        finally:
            self._episodes_in_flight -= size


async def ack_retrying(message: Msg) -> None:
    """Ack a task's delivery, confirmed by the server (``ack_sync``: a task is not reported done while its
    ack is lost), trying ``ACK_ATTEMPTS`` times. If the ack is lost anyway (the server restarting), the task
    comes back: a runner resumes it as all finished, a harness runs it again as a new group."""
    try:
        async for attempt in stamina.retry_context(
            on=Exception, attempts=ACK_ATTEMPTS, timeout=None, wait_initial=0.2, wait_max=4.0
        ):
            with attempt:
                await message.ack_sync(timeout=5.0)
    except Exception as error:
        log.warning("task ack failed %d times (%s); the task will come back", ACK_ATTEMPTS, error)
