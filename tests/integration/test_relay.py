"""The outbox relay on real servers: batches from ``batch_outbox`` to JetStream ``BATCHES``, each exactly
once, inline or through the object store, through a NATS outage, woken by NOTIFY; the CLI service."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import nats
import nats.errors
import psycopg
import pytest
from nats.aio.client import Client as NatsConnection
from sqlalchemy.ext.asyncio import AsyncEngine

from pipeline.batches.format import BatchSample, TrainingBatch, encode_batch
from pipeline.batches.relay import (
    BATCH_HEADER,
    BATCH_PAYLOADS_BUCKET,
    BATCHES_CHANNEL,
    BATCHES_STREAM,
    OBJECT_HEADER,
    BatchNotPublished,
    BatchPayloadError,
    OutboxRelay,
    batch_subject,
    ensure_batches_stream,
    ensure_payload_store,
    fetch_training_batch,
    read_batch_message,
)
from pipeline.dev.embedded import EmbeddedNats
from pipeline.log.db import create_engine
from pipeline.settings import libpq_url
from tests.conftest import Servers
from tests.support.waiting import wait_until

TURNSTILE = [sys.executable, "-m", "consumers.cli"]


def new_policy() -> str:
    return f"relay{uuid.uuid4().hex[:10]}"


def make_batch(policy: str, tokens: int = 6) -> TrainingBatch:
    batch_id = uuid.uuid4().hex
    sample = BatchSample(
        sample_id=f"s-{batch_id}",
        episode_id=f"e-{batch_id}",
        group_id=f"g-{batch_id}",
        turn_ids=(str(uuid.uuid4()),),
        policy_version=3,
        reward=1.0,
        advantage=0.5,
        stale=False,
        input_ids=tuple(range(tokens)),
        loss_mask=tuple(n % 2 for n in range(tokens)),
        logprobs=tuple(-0.25 * (n % 4) for n in range(tokens)),  # exact in float32
    )
    return TrainingBatch(batch_id, policy, "cfg-relay", 3, (sample,))


async def insert_batch(
    database_url: str,
    batch_id: str,
    policy: str,
    payload: bytes,
    *,
    notify: bool = False,
) -> None:
    """What the materializer commits for one batch: a ``batches`` row and its outbox row (one transaction)."""
    async with await psycopg.AsyncConnection.connect(libpq_url(database_url)) as db:
        await db.execute(
            "INSERT INTO batches (batch_id, policy, samples, groups, tokens, stale_samples, "
            "min_policy_version, max_policy_version, newest_version, config_hash, position, created_at) "
            "VALUES (%s, %s, 1, 1, 6, 0, 3, 3, 3, 'cfg-relay', 0, now())",
            (batch_id, policy),
        )
        await db.execute(
            "INSERT INTO batch_outbox (batch_id, subject, payload) VALUES (%s, %s, %s)",
            (batch_id, batch_subject(policy), payload),
        )
        if notify:
            await db.execute(f"NOTIFY {BATCHES_CHANNEL}")


async def insert(database_url: str, batch: TrainingBatch, *, notify: bool = False) -> bytes:
    payload = encode_batch(batch)
    await insert_batch(database_url, batch.batch_id, batch.policy, payload, notify=notify)
    return payload


def published_at(database_url: str, batch_id: str) -> tuple[Any, Any]:
    """(batch_outbox.published_at, batches.published_at)."""
    with psycopg.connect(libpq_url(database_url)) as db:
        row = db.execute(
            "SELECT o.published_at, b.published_at FROM batch_outbox o JOIN batches b USING (batch_id) "
            "WHERE batch_id = %s",
            (batch_id,),
        ).fetchone()
    assert row is not None
    return row[0], row[1]


def is_published(database_url: str, batch_id: str) -> bool:
    outbox, batches = published_at(database_url, batch_id)
    assert (outbox is None) == (batches is None), "outbox and batches disagree"
    return outbox is not None


def forget_published(database_url: str, batch_id: str) -> None:
    """As if the relay died between the PubAck and its commit."""
    with psycopg.connect(libpq_url(database_url)) as db:
        db.execute("UPDATE batch_outbox SET published_at = NULL WHERE batch_id = %s", (batch_id,))
        db.execute("UPDATE batches SET published_at = NULL WHERE batch_id = %s", (batch_id,))


async def stored_count(connection: NatsConnection, subject: str) -> int:
    info = await connection.jetstream().stream_info(BATCHES_STREAM, subjects_filter=subject)
    return int((info.state.subjects or {}).get(subject, 0))


async def stream_messages(connection: NatsConnection, subject: str) -> list[Any]:
    """Every message stored on ``subject``, in stream order (an ephemeral pull consumer, as a trainer's)."""
    count = await stored_count(connection, subject)
    subscription = await connection.jetstream().pull_subscribe(subject, stream=BATCHES_STREAM)
    messages: list[Any] = []
    deadline = time.monotonic() + 30
    try:
        while len(messages) < count and time.monotonic() < deadline:
            with contextlib.suppress(TimeoutError):
                messages += await subscription.fetch(count - len(messages), timeout=5.0)
    finally:
        await subscription.unsubscribe()
    assert len(messages) == count, f"fetched {len(messages)} of the {count} messages on {subject}"
    return messages


@pytest.fixture
async def engine(database_url: str) -> AsyncIterator[AsyncEngine]:
    created = create_engine(database_url, pool_size=4)
    yield created
    await created.dispose()


@pytest.fixture
async def nc(servers: Servers) -> AsyncIterator[NatsConnection]:
    connection = await nats.connect(servers.nats_url)
    yield connection
    await connection.drain()


async def test_inline_batches_are_published_in_order_once_each_and_marked(
    engine: AsyncEngine, nc: NatsConnection, database_url: str
) -> None:
    policy = new_policy()
    batches = [make_batch(policy) for _ in range(3)]
    for batch in batches:
        await insert(database_url, batch)
    relay = OutboxRelay(engine, nc)
    assert await relay.outbox_depth() == 3

    assert await relay.publish_pending() == 3
    assert await relay.outbox_depth() == 0
    assert await relay.publish_pending() == 0  # nothing left: a second pass publishes nothing again

    messages = await stream_messages(nc, batch_subject(policy))
    assert [m.headers["Nats-Msg-Id"] for m in messages] == [b.batch_id for b in batches]
    assert [m.headers[BATCH_HEADER] for m in messages] == [b.batch_id for b in batches]
    assert all(OBJECT_HEADER not in m.headers for m in messages)
    assert [await fetch_training_batch(nc, m) for m in messages] == batches
    for batch in batches:
        outbox, batches_row = published_at(database_url, batch.batch_id)
        assert outbox is not None
        assert outbox == batches_row


async def test_a_batch_over_max_payload_goes_through_the_object_store(
    engine: AsyncEngine, nc: NatsConnection, database_url: str
) -> None:
    policy = new_policy()
    batch = make_batch(policy, tokens=1_000_000)  # 9 bytes a token: ~9 MB
    payload = await insert(database_url, batch)
    assert len(payload) > nc.max_payload
    relay = OutboxRelay(engine, nc)

    assert await relay.publish_pending() == 1

    assert is_published(database_url, batch.batch_id)
    [message] = await stream_messages(nc, batch_subject(policy))
    assert message.headers[OBJECT_HEADER] == f"{BATCH_PAYLOADS_BUCKET}/{batch.batch_id}"
    assert message.headers["Nats-Msg-Id"] == batch.batch_id
    assert len(message.data) < 1024
    assert await read_batch_message(nc, message) == payload
    assert await read_batch_message(nc.jetstream(), message) == payload
    assert await fetch_training_batch(nc, message) == batch

    # A retry after a lost commit: the object is not uploaded again and the stream keeps one message.
    store = await nc.jetstream().object_store(BATCH_PAYLOADS_BUCKET)
    nuid = (await store.get_info(batch.batch_id)).nuid
    forget_published(database_url, batch.batch_id)
    assert await relay.publish_pending() == 1
    assert (await store.get_info(batch.batch_id)).nuid == nuid
    assert await stored_count(nc, batch_subject(policy)) == 1


async def test_the_inline_limit_leaves_room_for_the_headers(
    engine: AsyncEngine, nc: NatsConnection, database_url: str
) -> None:
    policy = new_policy()
    relay = OutboxRelay(engine, nc)
    at_limit, over_limit = b"a" * relay.inline_limit, b"b" * (relay.inline_limit + 1)
    await insert_batch(database_url, "at-" + policy, policy, at_limit)
    await insert_batch(database_url, "over-" + policy, policy, over_limit)

    assert await relay.publish_pending() == 2

    first, second = await stream_messages(nc, batch_subject(policy))
    assert first.data == at_limit
    assert OBJECT_HEADER not in first.headers
    assert OBJECT_HEADER in second.headers
    assert await read_batch_message(nc, second) == over_limit


async def test_a_batch_published_again_after_a_lost_commit_is_stored_once(
    engine: AsyncEngine, nc: NatsConnection, database_url: str
) -> None:
    policy = new_policy()
    batch = make_batch(policy)
    await insert(database_url, batch)
    relay = OutboxRelay(engine, nc)
    assert await relay.publish_pending() == 1

    forget_published(database_url, batch.batch_id)
    assert await relay.publish_pending() == 1  # published again ...

    assert is_published(database_url, batch.batch_id)
    assert await stored_count(nc, batch_subject(policy)) == 1  # ... and dropped by JetStream's dedupe window
    info = await ensure_batches_stream(nc)
    assert info.config.duplicate_window >= 3600


async def test_two_relays_at_once_publish_each_batch_once(
    servers: Servers, engine: AsyncEngine, nc: NatsConnection, database_url: str
) -> None:
    policy = new_policy()
    batches = [make_batch(policy) for _ in range(12)]
    for batch in batches:
        await insert(database_url, batch)
    other_engine = create_engine(database_url, pool_size=2)
    other_nc = await nats.connect(servers.nats_url)
    try:
        first = OutboxRelay(engine, nc, batch_limit=2)
        second = OutboxRelay(other_engine, other_nc, batch_limit=2)
        counts = await asyncio.gather(first.publish_pending(), second.publish_pending())
    finally:
        await other_nc.drain()
        await other_engine.dispose()

    # Each relay counts only the rows it locked and marked: a row taken by both would count twice.
    assert sum(counts) == 12
    messages = await stream_messages(nc, batch_subject(policy))
    assert sorted(m.headers["Nats-Msg-Id"] for m in messages) == sorted(b.batch_id for b in batches)
    assert all(is_published(database_url, b.batch_id) for b in batches)


async def test_nothing_is_marked_while_nats_is_down_and_the_batch_goes_out_when_it_is_back(
    engine: AsyncEngine, database_url: str, server_dir: Path
) -> None:
    server = EmbeddedNats(server_dir / "nats")
    await asyncio.to_thread(server.start)
    connection = await nats.connect(server.url, max_reconnect_attempts=-1, reconnect_time_wait=0.2)
    stop = asyncio.Event()
    try:
        relay = OutboxRelay(engine, connection, poll_interval=0.3, publish_timeout=1.0, max_backoff=0.5)
        policy = new_policy()
        before = make_batch(policy)
        await insert(database_url, before)
        assert await relay.publish_pending() == 1  # the stream exists; the server goes away now

        await asyncio.to_thread(server.stop)
        during = make_batch(policy)
        await insert(database_url, during, notify=True)
        with pytest.raises(BatchNotPublished, match=during.batch_id):
            await relay.publish_pending()
        running = asyncio.create_task(relay.run(stop))
        await asyncio.sleep(2.0)
        assert not is_published(database_url, during.batch_id)
        assert relay.published == 1

        await asyncio.to_thread(server.start)
        await wait_until(
            lambda: is_published(database_url, during.batch_id), 30, "the batch after the outage"
        )
        stop.set()
        await asyncio.wait_for(running, 10)

        messages = await stream_messages(connection, batch_subject(policy))
        assert [m.headers["Nats-Msg-Id"] for m in messages] == [before.batch_id, during.batch_id]
        assert await fetch_training_batch(connection, messages[1]) == during
    finally:
        stop.set()
        await connection.close()
        await asyncio.to_thread(server.stop)


async def test_a_notify_wakes_the_relay_long_before_its_poll_interval(
    engine: AsyncEngine, nc: NatsConnection, database_url: str
) -> None:
    relay = OutboxRelay(engine, nc, poll_interval=30.0)
    stop = asyncio.Event()
    running = asyncio.create_task(relay.run(stop))
    try:
        await wait_until(lambda: relay.passes >= 1, 10, "the relay's first pass")
        policy = new_policy()
        quiet, loud = make_batch(policy), make_batch(policy)
        await insert(database_url, quiet)  # no NOTIFY: waits for the poll
        await asyncio.sleep(1.5)
        assert not is_published(database_url, quiet.batch_id)

        # The poll would come after 30 s: a bound well under it tells a NOTIFY wake-up from a poll, with room
        # for a loaded machine.
        started = time.monotonic()
        await insert(database_url, loud, notify=True)
        await wait_until(lambda: is_published(database_url, loud.batch_id), 20, "the NOTIFY'd batch")
        assert time.monotonic() - started < 20
        assert is_published(database_url, quiet.batch_id)  # the pass publishes everything pending
        assert await stored_count(nc, batch_subject(policy)) == 2

        stop.set()
        await asyncio.wait_for(running, 20)  # stop is honoured during the 30 s wait
    finally:
        stop.set()
        await asyncio.wait_for(running, 10)


async def test_a_missing_object_is_a_clear_error(nc: NatsConnection) -> None:
    await ensure_payload_store(nc)
    message = SimpleNamespace(
        data=b"",
        headers={OBJECT_HEADER: f"{BATCH_PAYLOADS_BUCKET}/gone-{uuid.uuid4().hex}", BATCH_HEADER: "b1"},
    )
    with pytest.raises(BatchPayloadError, match=r"batch b1: its payload .* is not in the object store"):
        await read_batch_message(nc, message)
    inline = SimpleNamespace(data=b"TSB1 inline", headers={BATCH_HEADER: "b2"})
    assert await read_batch_message(nc, inline) == b"TSB1 inline"


@pytest.mark.slow
async def test_turnstile_serve_relay_publishes_and_stops_on_sigterm(
    servers: Servers, nc: NatsConnection, database_url: str
) -> None:
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("TURNSTILE_")}
    env.update(TURNSTILE_DATABASE_URL=database_url, TURNSTILE_NATS_URL=servers.nats_url)
    process = await asyncio.create_subprocess_exec(
        *TURNSTILE, "serve", "relay", "--poll-interval", "0.5", env=env, stderr=asyncio.subprocess.PIPE
    )
    try:
        policy = new_policy()
        batch = make_batch(policy)
        await insert(database_url, batch, notify=True)
        await wait_until(lambda: is_published(database_url, batch.batch_id), 60, "the relay process")
        process.send_signal(signal.SIGTERM)
        _, stderr = await asyncio.wait_for(process.communicate(), 30)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    output = stderr.decode()
    assert process.returncode == 0, output
    assert "relay stopped" in output
    [message] = await stream_messages(nc, batch_subject(policy))
    assert await fetch_training_batch(nc, message) == batch
