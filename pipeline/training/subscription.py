"""The trainer's side of the pipeline: batches from JetStream ``BATCHES`` as torch tensors, exactly once in
effect, and publishing new policy versions.

    async with await BatchSubscription.open(nats, store, policy="main", durable="trainer") as batches:
        async for delivered in batches:
            loss = step(delivered.tensors())              # your training step
            if time_for_a_checkpoint:
                save(checkpoint_dir)                       # durable first ...
                await batches.commit(pending, version)     # ... then recorded as trained, then acked
                await publish_policy_version(store, nats, "main", version, checkpoint_dir)

Why this order: a batch is acked only after it is recorded in ``trained_batches`` with the version whose
checkpoint holds its update, and that row is written only after the checkpoint is on disk. A trainer that
dies before that gets the batch again (JetStream redelivers unacked messages after ``ack_wait``) and,
restarting from the last recorded version, trains it again; a batch already recorded (a redelivery after
the commit, or a duplicate from the relay) is acked and skipped. While a batch waits for its checkpoint the
subscription tells JetStream it is still being worked on. A message that is not a readable training batch
of this policy is quarantined: logged with its stream sequence, counted (``quarantined``) and terminated,
so JetStream never delivers it again (and publishes a MSG_TERMINATED advisory); the trainer goes on.
PostgreSQL going away (a restart, fast or kill -9) ends nothing: every read and write here waits for it and
tries again (``through_outages``), however long it is away, since the trainer has no other work to do.

``trained_batches`` is queried here, through the store's engine and the trainer's login, not through the store
port: it is the trainer's own record of what it trained (its checkpoint in the offline stack), not the event
log, and nothing in the online stack that the port serves reads it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Final, TypeVar

import sqlalchemy as sa
import stamina
from nats.aio.client import Client as NatsConnection
from nats.errors import ConnectionClosedError, NoServersError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import ServiceUnavailableError
from sqlalchemy.dialects.postgresql import insert as pg_insert

from pipeline.batches import (
    BATCHES_STREAM,
    BatchPayloadError,
    TrainingBatch,
    batch_subject,
    ensure_batches_stream,
    fetch_batch_payload,
    is_safetensors,
)
from pipeline.errors import DuplicateEventConflict, StoreUnavailable, TurnstileError
from pipeline.log import EventStore, Store, is_connection_error
from pipeline.log import trained_batches_table as trained_batches
from pipeline.settings import jetstream
from pipeline.training.tensors import BatchTensors, payload_tensors, to_tensors
from pipeline.versions import ensure_versions_stream, versions_subject
from schemas import PolicyVersionPublished

log = logging.getLogger(__name__)

VERSION_NAMESPACE: Final = uuid.UUID("0b7f1f6e-93a1-4f0c-8d1e-6d2f3c4b5a69")
OUTAGE_WAIT_MAX: Final = 5.0
"""Seconds, at most, between the trainer's attempts while PostgreSQL is away."""

T = TypeVar("T")


def _outage(error: BaseException) -> bool:
    return isinstance(error, StoreUnavailable) or is_connection_error(error)


async def through_outages(what: str, call: Callable[[], Awaitable[T]]) -> T:
    """``call()``, attempted again (jittered backoff up to ``OUTAGE_WAIT_MAX`` s, without end) for as long as
    PostgreSQL is unreachable; any other error is raised. Each call must be safe to repeat: a write whose
    commit was lost with its connection may have landed."""
    async for attempt in stamina.retry_context(
        on=_outage, attempts=None, timeout=None, wait_initial=0.1, wait_max=OUTAGE_WAIT_MAX
    ):
        with attempt:
            if attempt.num == 2:
                log.warning("trainer: PostgreSQL unreachable while %s; waiting for it", what)
            result = await call()
            if attempt.num > 1:
                log.info("trainer: PostgreSQL back after %d attempts at %s", attempt.num, what)
            return result
    raise AssertionError("unreachable: the retry loop returns or raises")


@dataclass
class DeliveredBatch:
    batch: TrainingBatch
    message: Any = field(repr=False)
    payload: bytes | None = field(default=None, repr=False)  # as delivered: tensors load from it directly

    @property
    def batch_id(self) -> str:
        return self.batch.batch_id

    @property
    def min_policy_version(self) -> int:
        return min((s.policy_version for s in self.batch.samples), default=0)

    def tensors(self, pad_id: int = 0) -> BatchTensors:
        if self.payload is not None and is_safetensors(self.payload):
            return payload_tensors(self.payload, pad_id)
        return to_tensors(self.batch, pad_id)


class BatchSubscription:
    """A durable pull consumer on ``batches.<policy>``; ``async for`` yields batches not yet trained."""

    def __init__(
        self,
        connection: NatsConnection,
        store: EventStore,
        *,
        policy: str,
        durable: str,
        ack_wait: float = 120.0,
        fetch_timeout: float = 1.0,
    ) -> None:
        self.connection = connection
        self.store = store
        self.policy = policy
        self.durable = durable
        self.ack_wait = ack_wait
        self.fetch_timeout = fetch_timeout
        self.duplicates = 0
        self.quarantined = 0  # messages that were not a training batch of this policy (terminated)
        self._subscription: Any = None
        self._waiting: dict[str, DeliveredBatch] = {}
        self._keepalive: asyncio.Task[None] | None = None

    @classmethod
    async def open(cls, connection: NatsConnection, store: EventStore, **options: Any) -> BatchSubscription:
        subscription = cls(connection, store, **options)
        await ensure_batches_stream(connection)
        config = ConsumerConfig(
            durable_name=subscription.durable,
            ack_policy=AckPolicy.EXPLICIT,
            deliver_policy=DeliverPolicy.ALL,
            ack_wait=subscription.ack_wait,
            max_deliver=-1,
            max_ack_pending=10_000,
        )
        subscription._subscription = await jetstream(connection).pull_subscribe(
            batch_subject(subscription.policy),
            durable=subscription.durable,
            stream=BATCHES_STREAM,
            config=config,
        )
        subscription._keepalive = asyncio.create_task(subscription._keep_alive())
        return subscription

    async def __aenter__(self) -> BatchSubscription:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        await self.close()

    async def close(self) -> None:
        if self._keepalive is not None:
            self._keepalive.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._keepalive
        if self._subscription is not None:
            with contextlib.suppress(Exception):
                await self._subscription.unsubscribe()
            self._subscription = None

    def __aiter__(self) -> AsyncIterator[DeliveredBatch]:
        return self._batches()

    async def _batches(self) -> AsyncIterator[DeliveredBatch]:
        while True:
            try:
                messages = await self._subscription.fetch(1, timeout=self.fetch_timeout)
            except (NatsTimeoutError, TimeoutError):
                continue
            except (ConnectionClosedError, NoServersError, ServiceUnavailableError) as error:
                # a server gone, or (on a cluster) the stream's or consumer's leader moving: it passes
                log.warning("batch stream: %s; trying again", error or type(error).__name__)
                await asyncio.sleep(0.5)
                continue
            for message in messages:
                try:
                    payload, batch = await fetch_batch_payload(self.connection, message)
                    if batch.policy != self.policy:
                        raise BatchPayloadError(f"batch {batch.batch_id} is for policy {batch.policy!r}")
                except BatchPayloadError as error:
                    await self._quarantine(message, error)
                    continue
                if await self._recorded(batch.batch_id):
                    self.duplicates += 1
                    with contextlib.suppress(Exception):  # unacked, it comes again and is skipped again
                        await message.ack_sync(timeout=10.0)
                    continue
                delivered = DeliveredBatch(batch, message, payload)
                self._waiting[batch.batch_id] = delivered
                yield delivered

    async def _quarantine(self, message: Any, error: BatchPayloadError) -> None:
        self.quarantined += 1
        sequence = message.metadata.sequence.stream if message.metadata else "?"
        log.error(
            "quarantined message %s on %s (stream %s): %s; terminated, it will not be delivered again",
            sequence,
            message.subject,
            BATCHES_STREAM,
            error,
        )
        await message.term()

    async def _recorded(self, batch_id: str) -> bool:
        query = (
            sa.select(sa.func.count())
            .select_from(trained_batches)
            .where(trained_batches.c.trainer == self.durable, trained_batches.c.batch_id == batch_id)
        )
        return bool(await self._scalar(f"looking up batch {batch_id}", query))

    async def commit(
        self,
        delivered: Sequence[DeliveredBatch],
        version: int,
        *,
        outcome: str = "trained",
        losses: Sequence[float | None] | None = None,
    ) -> None:
        """Record the batches as trained into ``version`` (call after its checkpoint is on disk), then ack."""
        if not delivered:
            return
        rows = [
            {
                "trainer": self.durable,
                "batch_id": d.batch_id,
                "policy": self.policy,
                "policy_version": version,
                "outcome": outcome,
                "loss": losses[i] if losses else None,
            }
            for i, d in enumerate(delivered)
        ]
        # a commit whose answer was lost with its connection may have landed: the retry finds the rows there
        insert = pg_insert(trained_batches).on_conflict_do_nothing(index_elements=["trainer", "batch_id"])

        async def record() -> None:
            async with self.store.engine.begin() as connection:
                await connection.execute(insert, rows)

        await through_outages(f"recording {len(rows)} batches into version {version}", record)
        for d in delivered:
            self._waiting.pop(d.batch_id, None)
            with contextlib.suppress(Exception):  # recorded: a redelivery would be skipped anyway
                await d.message.ack_sync(timeout=10.0)

    async def trained_version(self) -> int:
        """The newest policy version this trainer recorded batches into (0: none yet)."""
        query = sa.select(sa.func.coalesce(sa.func.max(trained_batches.c.policy_version), 0)).where(
            trained_batches.c.trainer == self.durable
        )
        return int(await self._scalar("reading the newest version trained", query) or 0)

    async def trained_count(self) -> int:
        """Batches this trainer has trained (not counting skipped ones)."""
        query = (
            sa.select(sa.func.count())
            .select_from(trained_batches)
            .where(trained_batches.c.trainer == self.durable, trained_batches.c.outcome == "trained")
        )
        return int(await self._scalar("counting the batches trained", query) or 0)

    async def trained_into(self, version: int) -> list[str]:
        """The ids of the batches trained into ``version``."""
        query = sa.select(trained_batches.c.batch_id).where(
            trained_batches.c.trainer == self.durable,
            trained_batches.c.policy_version == version,
            trained_batches.c.outcome == "trained",
        )

        async def batch_ids() -> list[str]:
            async with self.store.engine.connect() as connection:
                return sorted((await connection.scalars(query)).all())

        return await through_outages(f"reading the batches of version {version}", batch_ids)

    async def _scalar(self, what: str, query: sa.Select[Any]) -> Any:
        async def scalar() -> Any:
            async with self.store.engine.connect() as connection:
                return await connection.scalar(query)

        return await through_outages(what, scalar)

    async def _keep_alive(self) -> None:
        while True:
            await asyncio.sleep(self.ack_wait / 3)
            for delivered in list(self._waiting.values()):
                with contextlib.suppress(Exception):
                    await delivered.message.in_progress()


def version_event_id(policy: str, version: int) -> uuid.UUID:
    """The same event id for the same version: publishing a version again after a crash is idempotent."""
    return uuid.uuid5(VERSION_NAMESPACE, f"{policy}/{version}")


async def publish_policy_version(
    store: Store,
    connection: NatsConnection,
    policy: str,
    version: int,
    checkpoint: str,
    *,
    batches_consumed: Sequence[str] = (),
) -> PolicyVersionPublished:
    """Append PolicyVersionPublished to ``policy-<policy>`` and broadcast it on ``policy.<policy>.versions``,
    where inference consumers load it (stream ``POLICY_VERSIONS`` keeps it for those that start later). Safe
    to call again for the same version (idempotent), also when the checkpoint directory is spelled another
    way (a symlink, a relative path): the recorded event stands."""
    event = PolicyVersionPublished(
        event_id=version_event_id(policy, version),
        policy=policy,
        version=version,
        checkpoint=checkpoint,
        batches_consumed=sorted(batches_consumed),
    )
    try:
        await through_outages(
            f"recording policy version {version}", lambda: store.append(f"policy-{policy}", [event])
        )
    except DuplicateEventConflict:
        event = await through_outages(
            f"reading policy version {version}", lambda: _recorded_version(store, event, checkpoint)
        )
    # The stream keeps the newest version for consumers that subscribe after this publish (made here, before
    # the publish it has to capture; kept as it is when it exists).
    await ensure_versions_stream(connection)
    await connection.publish(versions_subject(policy), event.model_dump_json().encode())
    await connection.flush()
    return event


async def _recorded_version(
    store: Store, wanted: PolicyVersionPublished, checkpoint: str
) -> PolicyVersionPublished:
    """The recorded event of ``wanted``'s version when it names the same checkpoint directory; else a clear
    error (a version cannot be recorded twice with different weights)."""
    for recorded in await store.read_stream(f"policy-{wanted.policy}"):
        event = recorded.event
        if isinstance(event, PolicyVersionPublished) and event.event_id == wanted.event_id:
            if _same_directory(event.checkpoint, checkpoint):
                return event
            raise TurnstileError(
                f"policy {wanted.policy!r} version {wanted.version} is recorded with checkpoint "
                f"{event.checkpoint!r}, not {checkpoint!r}: a version is published once; point --checkpoints "
                "at the directory that holds it (or use a new policy name)"
            )
    raise TurnstileError(f"policy {wanted.policy!r} version {wanted.version}: not in its stream")


def _same_directory(first: str, second: str) -> bool:
    try:
        return os.path.samefile(first, second)
    except OSError:  # one of them is gone: only the same spelling is the same
        return first == second


async def published_version(store: Store, policy: str) -> PolicyVersionPublished | None:
    """The newest version of ``policy`` in the log."""
    newest = None
    for recorded in await store.read_stream(f"policy-{policy}"):
        if isinstance(recorded.event, PolicyVersionPublished) and (
            newest is None or recorded.event.version > newest.version
        ):
            newest = recorded.event
    return newest
