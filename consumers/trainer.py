"""Trainer service (``turnstile serve trainer``): the reference PPO-clip trainer on the batch stream.

Wiring only: the store and NATS through the service runtime, the durable batch subscription
(``pipeline.training.BatchSubscription``), the learner (``pipeline.training.PolicyGradient``) and the loop
(``pipeline.training.train``): every ``version_every`` batches a checkpoint, the batches recorded as trained
into it, a new policy version published for the inference consumers. Batches more than ``max_staleness``
versions behind are skipped and counted. On restart it resumes from the newest version it recorded
(weights and optimizer state), so every batch counts exactly once. Only the newest ``keep_checkpoints``
version directories stay; ``log_steps`` writes a JSON line per step (the loop's ``on_step`` hook).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path

from consumers.runtime import connect_nats, connect_store, running
from pipeline.errors import ConfigError
from pipeline.training import (
    BatchSubscription,
    JsonlStepLog,
    PolicyGradient,
    TrainerStats,
    TrainingPlan,
    resume,
    train,
)
from pipeline.training.trainer import StepHook

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainerConfig:
    database_url: str
    nats_url: str
    policy: str
    model: Path
    checkpoints: Path
    durable: str = "trainer"
    lr: float = 3e-3
    clip: float = 0.2
    version_every: int = 1
    max_staleness: int | None = None
    ack_wait: float = 120.0
    seed: int = 0
    threads: int = 1
    keep_checkpoints: int = 3
    log_steps: Path | None = None  # a JSON line per learner step (the on_step hook); off by default

    def __post_init__(self) -> None:
        if self.version_every < 1:
            raise ConfigError(f"--version-every must be at least 1, got {self.version_every}")
        if self.keep_checkpoints < 0:
            raise ConfigError(f"--keep-checkpoints must be 0 (keep all) or more, got {self.keep_checkpoints}")
        if not (self.model / "config.json").is_file():
            raise ConfigError(
                f"--model {self.model}: not a model directory (no config.json); build one with "
                "`turnstile model init-tiny DIR`"
            )

    def plan(self, on_step: StepHook | None = None) -> TrainingPlan:
        return TrainingPlan(
            policy=self.policy,
            model=self.model,
            checkpoints=self.checkpoints,
            durable=self.durable,
            version_every=self.version_every,
            max_staleness=self.max_staleness,
            keep_checkpoints=self.keep_checkpoints,
            on_step=on_step,
        )


async def serve_trainer(config: TrainerConfig, *, stop: asyncio.Event | None = None) -> TrainerStats:
    """Train until Ctrl-C, SIGTERM or ``stop``; the trainer's figures at the end."""
    step_log = JsonlStepLog(config.log_steps) if config.log_steps is not None else None
    plan = config.plan(step_log)
    async with running(f"trainer {config.durable}", stop=stop) as runtime:
        store = await connect_store(config.database_url)
        assert store is not None
        try:
            connection = await connect_nats(config.nats_url)
            assert connection is not None
            runtime.check("nats", lambda: connection.is_connected)
            try:
                batches = await BatchSubscription.open(
                    connection, store, policy=config.policy, durable=config.durable, ack_wait=config.ack_wait
                )
                async with batches:
                    stats, weights = await resume(plan, store, connection, batches)
                    learner = await asyncio.to_thread(
                        PolicyGradient,
                        weights,
                        lr=config.lr,
                        clip=config.clip,
                        seed=config.seed,
                        threads=config.threads,
                    )
                    log.info("trainer %s at policy version %d (%s)", config.durable, stats.version, weights)
                    training = asyncio.create_task(train(plan, store, connection, batches, learner, stats))
                    stopping = asyncio.create_task(runtime.stop.wait())
                    await asyncio.wait({training, stopping}, return_when=asyncio.FIRST_COMPLETED)
                    training.cancel()
                    stopping.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await training
            finally:
                with contextlib.suppress(Exception):
                    await connection.drain()
        finally:
            await store.close()
            if step_log is not None:
                step_log.close()
    return stats
