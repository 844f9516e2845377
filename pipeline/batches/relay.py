"""The outbox relay: training batches from ``batch_outbox`` to the JetStream stream ``BATCHES``.

The materializer writes each batch to ``batch_outbox`` in the transaction that makes it, and NOTIFYs
``turnstile_batches``. The relay publishes it on its subject (``batches.<policy>``) with ``Nats-Msg-Id`` =
batch id, and sets ``published_at`` (in the outbox and in ``batches``) only after JetStream's PubAck.

Once in the stream. Outbox rows are taken ``FOR UPDATE SKIP LOCKED``, so two relays never publish the
same row at the same time. A batch that was published but not marked (the relay died, or lost
PostgreSQL, between the PubAck and its commit) is published again later under the same ``Nats-Msg-Id``,
and JetStream drops that copy: the stream deduplicates message ids within its ``duplicate_window``.

Any size. A payload that fits in one message (the server's ``max_payload`` less room for the headers)
goes inline. A larger one is put in the object store bucket ``BATCH_PAYLOADS`` under the batch id, and the
stream gets a small message with the header ``Turnstile-Object: BATCH_PAYLOADS/<batch id>`` instead.
Subscribers call ``read_batch_message`` (or ``fetch_training_batch``), which reads either kind.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import logging
import math
import struct
from typing import Any, Final

import psycopg
import sqlalchemy as sa
from nats.aio.client import Client as NatsConnection
from nats.errors import Error as NatsError
from nats.js.api import ObjectStoreConfig, RetentionPolicy, StreamConfig
from nats.js.errors import BadRequestError, BucketNotFoundError, DigestMismatchError, NotFoundError
from psycopg import sql
from sqlalchemy.ext.asyncio import AsyncEngine

from pipeline.batches.format import BATCHES_CHANNEL, TrainingBatch, decode_batch
from pipeline.errors import ConfigError, TurnstileError
from pipeline.log import is_connection_error
from pipeline.settings import jetstream, libpq_url

log = logging.getLogger(__name__)

BATCHES_STREAM: Final = "BATCHES"
BATCH_PAYLOADS_BUCKET: Final = "BATCH_PAYLOADS"

DUPLICATE_WINDOW: Final = 24 * 3600.0
"""Seconds within which JetStream drops a re-published batch id. A day, not minutes: a re-publish follows
a database outage that may last hours, and at a few batches a minute the server's id set stays small."""

HEADER_HEADROOM: Final = 4096
"""Bytes of ``max_payload`` left for the headers (about 150 bytes are used) of an inline batch."""

BATCH_HEADER: Final = "Turnstile-Batch"
OBJECT_HEADER: Final = "Turnstile-Object"
SIZE_HEADER: Final = "Turnstile-Size"


class BatchNotPublished(TurnstileError):
    """JetStream did not acknowledge a batch (or its payload could not be stored); it stays unpublished."""


class BatchPayloadError(TurnstileError):
    """A delivered batch message whose payload cannot be read."""


def batch_subject(policy: str) -> str:
    return f"batches.{policy}"


async def ensure_batches_stream(connection: NatsConnection, *, replicas: int = 1) -> Any:
    """Create the ``BATCHES`` stream if it does not exist (``replicas`` copies on a JetStream cluster: 3
    survives the loss of a node); its ``StreamInfo``. An existing one is kept as it is."""
    js = jetstream(connection)
    config = StreamConfig(
        name=BATCHES_STREAM,
        subjects=["batches.>"],
        retention=RetentionPolicy.LIMITS,
        duplicate_window=DUPLICATE_WINDOW,
        num_replicas=replicas,
    )
    try:
        return await js.add_stream(config)
    except BadRequestError as error:
        # Exists with another configuration (e.g. made or tuned by an operator): keep it.
        try:
            info = await js.stream_info(BATCHES_STREAM)
        except NotFoundError:
            raise ConfigError(f"JetStream refused to create stream {BATCHES_STREAM}: {error}") from None
        window = info.config.duplicate_window or 0.0
        if window < DUPLICATE_WINDOW:
            log.warning(
                "stream %s deduplicates for %.0f s only; a batch re-published after a longer outage "
                "is stored twice (trainers can drop it by its %s header)",
                BATCHES_STREAM,
                window,
                BATCH_HEADER,
            )
        return info


async def ensure_payload_store(connection: NatsConnection, bucket: str = BATCH_PAYLOADS_BUCKET) -> Any:
    """The object store bucket for batches too large for one message, created if missing."""
    js = jetstream(connection)
    try:
        return await js.object_store(bucket)
    except BucketNotFoundError:
        # Two relays creating it at once is fine: the server accepts an identical stream twice.
        config = ObjectStoreConfig(description="Turnstile training batches larger than max_payload")
        return await js.create_object_store(bucket, config=config)


def object_digest(payload: bytes) -> str:
    """The digest the object store records for ``payload`` (``SHA-256=<urlsafe base64>``)."""
    return "SHA-256=" + base64.urlsafe_b64encode(hashlib.sha256(payload).digest()).decode()


def _outbox_table(schema: str) -> sa.TableClause:
    return sa.table(
        "batch_outbox",
        sa.column("batch_id", sa.Text),
        sa.column("subject", sa.Text),
        sa.column("payload", sa.LargeBinary),
        sa.column("created_at", sa.DateTime(timezone=True)),
        sa.column("published_at", sa.DateTime(timezone=True)),
        schema=schema,
    )


def _batches_table(schema: str) -> sa.TableClause:
    return sa.table(
        "batches",
        sa.column("batch_id", sa.Text),
        sa.column("published_at", sa.DateTime(timezone=True)),
        schema=schema,
    )


class OutboxRelay:
    """Publishes the batches of ``<schema>.batch_outbox`` to JetStream, oldest first.

    ``await relay.publish_pending()`` publishes what is pending now; ``await relay.run(stop)`` keeps doing
    so, woken by the materializer's NOTIFY (``poll_interval`` bounds the wait should one be lost), through
    NATS and PostgreSQL outages, until ``stop`` is set.
    """

    def __init__(
        self,
        engine: AsyncEngine,
        connection: NatsConnection,
        *,
        schema: str = "public",
        poll_interval: float = 1.0,
        batch_limit: int = 50,
        bucket: str = BATCH_PAYLOADS_BUCKET,
        publish_timeout: float = 10.0,
        max_backoff: float = 5.0,
        retention: float = math.inf,
    ) -> None:
        if poll_interval <= 0 or batch_limit < 1:
            raise ConfigError(
                f"poll_interval must be > 0 and batch_limit >= 1 ({poll_interval}, {batch_limit})"
            )
        self.engine = engine
        self.connection = connection
        self.schema = schema
        self.poll_interval = poll_interval
        self.batch_limit = batch_limit
        self.bucket = bucket
        self.publish_timeout = publish_timeout
        self.max_backoff = max_backoff
        if not retention >= 0:
            raise ConfigError(f"the outbox retention is seconds, 0 or more (inf: keep), got {retention}")
        self.retention = retention
        """Seconds a published payload stays in the outbox; then it is deleted (the log rebuilds it)."""
        self.released = 0
        """Published payloads this relay deleted from the outbox."""
        self.published = 0
        """Batches acknowledged by JetStream and marked published by this relay."""
        self.passes = 0
        """Completed ``publish_pending`` calls."""
        self._outbox = _outbox_table(schema)
        self._batches = _batches_table(schema)
        self._stream_max_msg_size: int | None = None
        self._payload_store: Any = None

    @property
    def inline_limit(self) -> int:
        """The largest payload sent inline: the connected server's ``max_payload`` (or the stream's
        ``max_msg_size``, if smaller) less ``HEADER_HEADROOM``."""
        limit = int(self.connection.max_payload)
        if self._stream_max_msg_size is not None and self._stream_max_msg_size > 0:
            limit = min(limit, self._stream_max_msg_size)
        return limit - HEADER_HEADROOM

    async def outbox_depth(self) -> int:
        """Batches committed to the outbox and not yet published (the relay service's depth gauge)."""
        outbox = self._outbox
        query = sa.select(sa.func.count()).select_from(outbox).where(outbox.c.published_at.is_(None))
        async with self.engine.connect() as db:
            return int(await db.scalar(query) or 0)

    async def publish_pending(self) -> int:
        """Publish every unpublished batch, in ``created_at, batch_id`` order; the number published.

        Raises ``BatchNotPublished`` when JetStream does not acknowledge one: the batches acknowledged
        before it are marked published, it and the ones after it stay pending.
        """
        total = 0
        while True:
            published, more = await self._publish_chunk()
            total += published
            if not more:
                await self.release_published()
                self.passes += 1
                return total

    async def release_published(self) -> int:
        """Delete the payloads published more than ``retention`` seconds ago; how many. ``batches`` keeps
        each one's size and sha256, and ``turnstile rematerialize`` rebuilds the same bytes from the log."""
        if math.isinf(self.retention):
            return 0
        outbox = self._outbox
        async with self.engine.begin() as db:
            result = await db.execute(
                sa.delete(outbox).where(
                    outbox.c.published_at
                    < sa.func.clock_timestamp() - sa.func.make_interval(0, 0, 0, 0, 0, 0, self.retention)
                )
            )
        released = int(result.rowcount or 0)
        self.released += released
        return released

    async def publish_next(self) -> int:
        """Publish up to ``batch_limit`` unpublished batches, the oldest first (what one pass of
        ``publish_pending`` does); the number published."""
        published, _ = await self._publish_chunk()
        return published

    async def _publish_chunk(self) -> tuple[int, bool]:
        outbox, batches = self._outbox, self._batches
        failure: BatchNotPublished | None = None
        cause: Exception | None = None
        published = 0
        # One transaction holds the row locks while the chunk is published, and records the batches that
        # were acknowledged. SKIP LOCKED: another relay takes the rows after these meanwhile, so batches are
        # in order per relay; with one relay running (the usual case) they are in order in the stream.
        async with self.engine.begin() as db:
            pending = (
                await db.execute(
                    sa.select(outbox.c.batch_id, outbox.c.subject)
                    .where(outbox.c.published_at.is_(None))
                    .order_by(outbox.c.created_at, outbox.c.batch_id)
                    .limit(self.batch_limit)
                    .with_for_update(skip_locked=True)
                )
            ).all()
            if not pending:
                return 0, False
            await self._prepare()
            for batch_id, subject in pending:
                payload = (
                    await db.execute(sa.select(outbox.c.payload).where(outbox.c.batch_id == batch_id))
                ).scalar_one()
                try:
                    await self._publish(batch_id, subject, bytes(payload))
                except Exception as error:
                    # Never marked without a PubAck. The ones after it wait too: order is kept.
                    self._stream_max_msg_size, self._payload_store = None, None  # ensure them again
                    failure = BatchNotPublished(
                        f"batch {batch_id} ({subject}) not published: {error or type(error).__name__}"
                    )
                    cause = error
                    break
                # A crash from here to the commit loses this mark, not the batch: it is published again
                # under the same Nats-Msg-Id, and JetStream drops the copy (duplicate_window).
                stamp = await db.scalar(
                    sa.update(outbox)
                    .where(outbox.c.batch_id == batch_id)
                    .values(published_at=sa.func.clock_timestamp())
                    .returning(outbox.c.published_at)
                )
                await db.execute(
                    sa.update(batches).where(batches.c.batch_id == batch_id).values(published_at=stamp)
                )
                published += 1
        self.published += published
        if failure is not None:
            raise failure from cause
        return published, len(pending) == self.batch_limit

    async def _prepare(self) -> None:
        if self._stream_max_msg_size is None:
            info = await ensure_batches_stream(self.connection)
            self._stream_max_msg_size = int(info.config.max_msg_size or -1)

    async def _publish(self, batch_id: str, subject: str, payload: bytes) -> None:
        headers = {"Nats-Msg-Id": batch_id, BATCH_HEADER: batch_id}
        body = payload
        if len(payload) > self.inline_limit:
            await self._put_object(batch_id, payload)
            headers[OBJECT_HEADER] = f"{self.bucket}/{batch_id}"
            headers[SIZE_HEADER] = str(len(payload))
            body = b""
        js = jetstream(self.connection)
        # stream=: the server refuses the message unless it lands in BATCHES, so the PubAck is BATCHES's.
        ack = await js.publish(
            subject, body, timeout=self.publish_timeout, stream=BATCHES_STREAM, headers=headers
        )
        if ack.duplicate:
            log.info(
                "batch %s was in %s already (seq %s); JetStream dropped the copy",
                batch_id,
                ack.stream,
                ack.seq,
            )

    async def _put_object(self, name: str, payload: bytes) -> None:
        if self._payload_store is None:
            self._payload_store = await ensure_payload_store(self.connection, self.bucket)
        store = self._payload_store
        # Idempotent: a retry after a lost PubAck finds the same bytes stored under the same name.
        with contextlib.suppress(NotFoundError):
            info = await store.get_info(name)
            if info.size == len(payload) and info.digest == object_digest(payload):
                return
        await store.put(name, payload)

    async def run(self, stop: asyncio.Event) -> None:
        """Publish pending batches until ``stop`` is set; each outage is logged and retried with backoff."""
        listener: psycopg.AsyncConnection[Any] | None = None
        delay = 0.1
        try:
            while not stop.is_set():
                wait = self.poll_interval
                # LISTEN before the pass: a NOTIFY during the pass wakes the next wait at once.
                try:
                    if listener is None or listener.closed:
                        listener = await self._listen()
                except Exception as error:
                    log.warning("relay: cannot LISTEN %s (%s); polling meanwhile", BATCHES_CHANNEL, error)
                    listener = None
                try:
                    count = await self.publish_pending()
                    if count:
                        log.info("relay: published %d batches", count)
                    delay = 0.1
                except Exception as error:
                    expected = isinstance(error, (BatchNotPublished, NatsError, TimeoutError))
                    log.log(
                        logging.WARNING if expected or is_connection_error(error) else logging.ERROR,
                        "relay: %s; retrying in %.1f s",
                        error or type(error).__name__,
                        delay,
                        exc_info=not (expected or is_connection_error(error)),
                    )
                    wait, delay = delay, min(delay * 2, self.max_backoff)
                await self._wait(listener, stop, wait)
        finally:
            await _close_quietly(listener)

    async def _listen(self) -> psycopg.AsyncConnection[Any]:
        url = libpq_url(self.engine.url.render_as_string(hide_password=False))
        listener = await psycopg.AsyncConnection.connect(url, autocommit=True)
        await listener.execute(sql.SQL("LISTEN {}").format(sql.Identifier(BATCHES_CHANNEL)))
        return listener

    async def _wait(
        self, listener: psycopg.AsyncConnection[Any] | None, stop: asyncio.Event, seconds: float
    ) -> None:
        """Until a NOTIFY, ``stop`` or ``seconds`` pass; ``stop`` is looked at every quarter of a second."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        while not stop.is_set() and (left := deadline - loop.time()) > 0:
            if listener is None or listener.closed:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), left)
                return
            try:
                async for _ in listener.notifies(timeout=min(left, 0.25), stop_after=1):
                    return
            except psycopg.Error:
                await _close_quietly(listener)  # run() connects a new one
                return


async def read_batch_message(connection_or_js: Any, message: Any) -> bytes:
    """The payload of a delivered ``BATCHES`` message (a subscription's ``Msg`` or a ``RawStreamMsg``),
    read from the object store when the relay put it there: subscribers need not know which."""
    headers = message.headers or {}
    reference = headers.get(OBJECT_HEADER)
    if reference is None:
        return bytes(message.data or b"")
    batch = headers.get(BATCH_HEADER, "?")
    bucket, _, name = str(reference).partition("/")
    if not bucket or not name:
        raise BatchPayloadError(
            f"batch {batch}: bad {OBJECT_HEADER} header {reference!r} (expected bucket/name)"
        )
    js = jetstream(connection_or_js) if isinstance(connection_or_js, NatsConnection) else connection_or_js
    try:
        store = await js.object_store(bucket)
        result = await store.get(name)
    except NotFoundError:
        raise BatchPayloadError(
            f"batch {batch}: its payload {reference} is not in the object store (deleted, or the bucket "
            "was removed); rematerialize to make it again"
        ) from None
    except DigestMismatchError:
        raise BatchPayloadError(f"batch {batch}: its payload {reference} does not match its digest") from None
    data = bytes(result.data or b"")
    expected = headers.get(SIZE_HEADER)
    if expected is not None and str(len(data)) != str(expected):
        raise BatchPayloadError(
            f"batch {batch}: payload {reference} is {len(data)} bytes, expected {expected}"
        )
    return data


async def fetch_training_batch(connection_or_js: Any, message: Any) -> TrainingBatch:
    """The ``TrainingBatch`` a delivered ``BATCHES`` message carries; ``BatchPayloadError`` when it carries
    something else (not a batch, truncated, a payload gone from the object store)."""
    return (await fetch_batch_payload(connection_or_js, message))[1]


async def fetch_batch_payload(connection_or_js: Any, message: Any) -> tuple[bytes, TrainingBatch]:
    """``fetch_training_batch`` and the payload's bytes (safetensors: tensors load from them directly)."""
    data = await read_batch_message(connection_or_js, message)
    try:
        return data, decode_batch(data)
    except (ValueError, KeyError, TypeError, IndexError, struct.error) as error:
        subject = getattr(message, "subject", "?")
        raise BatchPayloadError(
            f"the message on {subject} is not a readable training batch ({type(error).__name__}: {error})"
        ) from None


async def _close_quietly(connection: psycopg.AsyncConnection[Any] | None) -> None:
    if connection is not None:
        try:
            await connection.close()
        except Exception:
            log.debug("closing the LISTEN connection failed", exc_info=True)
