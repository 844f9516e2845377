"""Rollouts paced to the learner: ``TrainerBacklog`` holds new work while the trainer's consumer on BATCHES
has more than ``max_ahead`` batches waiting, and a runner with it starts no group until the backlog drains."""

from __future__ import annotations

import asyncio
import uuid

import nats
from nats.js.api import AckPolicy, ConsumerConfig

from pipeline.batches import BATCHES_STREAM, ensure_batches_stream
from pipeline.batches.relay import batch_subject
from pipeline.training import TrainerBacklog
from tests.conftest import Servers


async def test_new_work_waits_while_the_trainer_has_more_than_max_ahead_batches(servers: Servers) -> None:
    connection = await nats.connect(servers.nats_url)
    try:
        await ensure_batches_stream(connection)
        js = connection.jetstream()
        policy, durable = f"p{uuid.uuid4().hex[:8]}", f"trainer{uuid.uuid4().hex[:8]}"
        pacer = TrainerBacklog(connection, durable, max_ahead=2, every=0.01)
        assert await pacer.backlog() is None  # no trainer yet: nothing to pace against
        await asyncio.wait_for(pacer(), 10)
        demo = TrainerBacklog(connection, durable, max_ahead=2, every=0.01, wait_for_trainer=True)
        assert await demo.backlog() == 3  # unless told a trainer is coming: then it waits for it

        await js.add_consumer(
            BATCHES_STREAM,
            ConsumerConfig(
                durable_name=durable, filter_subject=batch_subject(policy), ack_policy=AckPolicy.EXPLICIT
            ),
        )
        for n in range(4):
            await js.publish(batch_subject(policy), f"batch {n}".encode())
        assert await pacer.backlog() == 4

        waiting = asyncio.create_task(pacer())
        subscription = await js.pull_subscribe(batch_subject(policy), durable, stream=BATCHES_STREAM)
        fetched = await subscription.fetch(2, timeout=10)
        assert await pacer.backlog() == 4  # delivered, not acked: still the trainer's backlog
        assert not waiting.done()
        await fetched[0].ack()
        await fetched[1].ack()
        await asyncio.wait_for(waiting, 30)  # two left: at most max_ahead
        assert await pacer.backlog() == 2
        assert pacer.held > 0
    finally:
        await connection.close()
