"""Rollouts paced to the learner: new work waits while the trainer has more than ``max_ahead`` batches
of the policy waiting for it.

Without it, a runner produces as fast as inference answers; when the learner is slower (on a CPU, or
beside the rollouts on the same cores), batches queue up, and by the time the trainer reaches them they are
more than ``--max-staleness`` versions behind and skipped: rollouts paid for and thrown away (the demo
skipped 19-31% on two loaded cores). Holding new groups back while the trainer's backlog is full bounds the
staleness at rollout time instead, the way AReaL's ``max_head_offpolicyness`` does, and spends the freed
CPU on the learner. The backlog is the trainer's JetStream consumer on ``BATCHES``: batches delivered and
not yet acked, and batches not yet delivered (``num_ack_pending + num_pending``).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from nats.aio.client import Client as NatsConnection
from nats.errors import Error as NatsError
from nats.js.errors import NotFoundError

from pipeline.batches import BATCHES_STREAM
from pipeline.settings import jetstream

log = logging.getLogger(__name__)


@dataclass
class TrainerBacklog:
    """``await pace()`` returns once the trainer ``durable`` has at most ``max_ahead`` batches waiting; at
    once when the server cannot say, and when there is no such trainer yet unless ``wait_for_trainer`` (the
    demo, which starts its trainer beside the runner: the batches made while the trainer loads would be
    stale by the time it takes them)."""

    connection: NatsConnection
    durable: str = "trainer"
    max_ahead: int = 2
    every: float = 0.2
    wait_for_trainer: bool = False
    held: float = field(default=0.0, init=False)
    """Seconds new work has waited on the trainer so far."""

    async def backlog(self) -> int | None:
        """Batches the trainer has not acked yet, or None when it has no consumer (or NATS cannot say);
        with ``wait_for_trainer``, no consumer yet is a full backlog."""
        try:
            info = await jetstream(self.connection).consumer_info(BATCHES_STREAM, self.durable)
        except NotFoundError:
            return self.max_ahead + 1 if self.wait_for_trainer else None
        except (NatsError, TimeoutError) as error:
            log.debug("pacing: the trainer's consumer could not be read: %s", error)
            return None
        return int(info.num_pending or 0) + int(info.num_ack_pending or 0)

    async def __call__(self) -> None:
        loop = asyncio.get_running_loop()
        started = loop.time()
        # polled: the backlog is the server's count, with no event to wait on
        while (waiting := await self.backlog()) is not None and waiting > self.max_ahead:  # noqa: ASYNC110
            await asyncio.sleep(self.every)
        self.held += loop.time() - started
