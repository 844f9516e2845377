"""The training loop: batches from the stream, one learner step each, a policy version every
``version_every`` batches — checkpoint written, then the batches recorded as trained into it, then acked,
then the version published — so after a crash each batch counts exactly once."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path

from nats.aio.client import Client as NatsConnection

from pipeline.errors import ConfigError
from pipeline.log import Store
from pipeline.training.ppo import PolicyGradient, checkpoint_dir
from pipeline.training.subscription import BatchSubscription, DeliveredBatch, publish_policy_version

log = logging.getLogger(__name__)


@dataclass
class TrainerStats:
    version: int = 0
    trained: int = 0
    stale: int = 0
    last_loss: float | None = None


@dataclass(frozen=True)
class TrainingPlan:
    """What the loop does with the batches of ``policy``."""

    policy: str
    model: Path
    """The weights of version 0."""
    checkpoints: Path
    durable: str = "trainer"
    version_every: int = 1
    max_staleness: int | None = None


async def resume(
    plan: TrainingPlan, store: Store, connection: NatsConnection, batches: BatchSubscription
) -> tuple[TrainerStats, Path]:
    """Where a (re)started trainer stands: its newest recorded version and that version's weights. The
    version is published again, since a crash may have come between recording it and publishing it."""
    stats = TrainerStats(version=await batches.trained_version(), trained=await batches.trained_count())
    weights = checkpoint_dir(plan.checkpoints, stats.version) if stats.version else plan.model
    if not (weights / "config.json").is_file():
        raise ConfigError(
            f"trainer {plan.durable!r} recorded version {stats.version} but its checkpoint "
            f"{weights} is missing; restore it or start a new trainer with another --durable name"
        )
    if stats.version:
        await publish_policy_version(
            store, connection, plan.policy, stats.version, str(weights.absolute()),
            batches_consumed=await batches.trained_into(stats.version),
        )  # fmt: skip
    return stats, weights


async def train(
    plan: TrainingPlan,
    store: Store,
    connection: NatsConnection,
    batches: BatchSubscription,
    learner: PolicyGradient,
    stats: TrainerStats,
) -> None:
    pending: list[DeliveredBatch] = []
    losses: list[float | None] = []
    async for delivered in batches:
        behind = stats.version - delivered.min_policy_version
        if plan.max_staleness is not None and behind > plan.max_staleness:
            stats.stale += 1
            log.info("batch %s is %d versions behind: skipped", delivered.batch_id, behind)
            await batches.commit([delivered], stats.version, outcome="stale")
            continue
        loss = await asyncio.to_thread(learner.step, delivered.tensors())
        stats.last_loss = loss
        pending.append(delivered)
        losses.append(loss)
        if len(pending) < plan.version_every:
            continue
        version = stats.version + 1
        directory = checkpoint_dir(plan.checkpoints, version)
        await asyncio.to_thread(learner.save, directory)
        await batches.commit(pending, version, losses=losses)
        stats.version, stats.trained = version, stats.trained + len(pending)
        await publish_policy_version(
            store, connection, plan.policy, version, str(directory.absolute()),
            batches_consumed=[d.batch_id for d in pending],
        )  # fmt: skip
        log.info("policy version %d published (%d batches trained, loss %.4f)", version, stats.trained, loss)
        pending.clear()
        losses.clear()
