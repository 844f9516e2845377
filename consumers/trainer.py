"""Reference trainer: PPO-clip policy gradient on the batch stream for a local Hugging Face causal LM.

It takes batches from ``batches.<policy>`` (``pipeline.training.BatchSubscription``), weighs each model
token by the ratio of the current policy's probability to the sampling probability recorded with the turn
(clipped to [1 - clip, 1 + clip]) times the sample's advantage, and every ``version_every`` batches saves
a checkpoint, records the batches as trained into that version and publishes the version, which the
inference consumers then load. Batches whose oldest sample is more than ``max_staleness`` versions behind
are skipped and counted. On restart it resumes from the newest version it recorded (weights and
optimizer state), so every batch counts exactly once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nats

from pipeline.errors import ConfigError
from pipeline.log import EventStore
from pipeline.training.subscription import (
    BatchSubscription,
    BatchTensors,
    DeliveredBatch,
    publish_policy_version,
)

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

    def __post_init__(self) -> None:
        if self.version_every < 1:
            raise ConfigError(f"--version-every must be at least 1, got {self.version_every}")
        if not (self.model / "config.json").is_file():
            raise ConfigError(
                f"--model {self.model}: not a model directory (no config.json); build one with "
                "`turnstile model init-tiny DIR`"
            )


def checkpoint_dir(root: Path, version: int) -> Path:
    return root / f"v{version:06d}"


class PolicyGradient:
    """The model, its optimizer and one PPO-clip step (blocking: run it in a thread)."""

    def __init__(self, weights: Path, *, lr: float, clip: float, seed: int, threads: int) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        torch.manual_seed(seed)
        torch.set_num_threads(threads)
        self.torch = torch
        self.model: Any = AutoModelForCausalLM.from_pretrained(weights, dtype=torch.float32)
        self.model.train()
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=lr)
        optimizer_state = weights / "optimizer.pt"
        if optimizer_state.is_file():
            self.optimizer.load_state_dict(torch.load(optimizer_state, weights_only=True))
        self.clip = clip

    def step(self, batch: BatchTensors) -> float:
        torch = self.torch
        logits = self.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        # the token at position i is scored by the logits at position i - 1
        targets = batch.input_ids[:, 1:]
        new = torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        old, mask = batch.logprobs[:, 1:], batch.loss_mask[:, 1:]
        ratio = torch.exp(new - old)
        advantage = batch.advantages.unsqueeze(1)
        clipped = torch.clamp(ratio, 1 - self.clip, 1 + self.clip)
        per_token = -torch.minimum(ratio * advantage, clipped * advantage)
        loss = (per_token * mask).sum() / mask.sum().clamp(min=1.0)
        self.optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        return float(loss.detach())

    def save(self, directory: Path) -> None:
        """Write the checkpoint next to its final place, then rename: a checkpoint is whole or absent."""
        partial = directory.with_name(directory.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        self.model.save_pretrained(partial)
        self.torch.save(self.optimizer.state_dict(), partial / "optimizer.pt")
        shutil.rmtree(directory, ignore_errors=True)
        os.replace(partial, directory)


@dataclass
class TrainerStats:
    version: int = 0
    trained: int = 0
    stale: int = 0
    last_loss: float | None = None


async def serve_trainer(config: TrainerConfig, *, stop: asyncio.Event | None = None) -> TrainerStats:
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    store = await EventStore.connect(config.database_url)
    connection = await nats.connect(config.nats_url, max_reconnect_attempts=-1, reconnect_time_wait=0.5)
    stats = TrainerStats()
    try:
        batches = await BatchSubscription.open(
            connection, store, policy=config.policy, durable=config.durable, ack_wait=config.ack_wait
        )
        async with batches:
            stats.version = await batches.trained_version()
            stats.trained = await batches.trained_count()
            weights = checkpoint_dir(config.checkpoints, stats.version) if stats.version else config.model
            if not (weights / "config.json").is_file():
                raise ConfigError(
                    f"trainer {config.durable!r} recorded version {stats.version} but its checkpoint "
                    f"{weights} is missing; restore it or start a new trainer with another --durable name"
                )
            if stats.version:  # the crash may have come between recording and publishing
                await publish_policy_version(
                    store, connection, config.policy, stats.version, str(weights.absolute()),
                    batches_consumed=await batches.trained_into(stats.version),
                )  # fmt: skip
            learner = await asyncio.to_thread(
                PolicyGradient,
                weights,
                lr=config.lr,
                clip=config.clip,
                seed=config.seed,
                threads=config.threads,
            )
            log.info("trainer %s at policy version %d (%s)", config.durable, stats.version, weights)
            training = asyncio.create_task(_train(config, store, connection, batches, learner, stats))
            stopping = asyncio.create_task(stop.wait())
            await asyncio.wait({training, stopping}, return_when=asyncio.FIRST_COMPLETED)
            training.cancel()
            stopping.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await training
    finally:
        with contextlib.suppress(Exception):
            await connection.drain()
        await store.close()
    return stats


async def _train(
    config: TrainerConfig,
    store: EventStore,
    connection: Any,
    batches: BatchSubscription,
    learner: PolicyGradient,
    stats: TrainerStats,
) -> None:
    pending: list[DeliveredBatch] = []
    losses: list[float | None] = []
    async for delivered in batches:
        behind = stats.version - delivered.min_policy_version
        if config.max_staleness is not None and behind > config.max_staleness:
            stats.stale += 1
            log.info("batch %s is %d versions behind: skipped", delivered.batch_id, behind)
            await batches.commit([delivered], stats.version, outcome="stale")
            continue
        loss = await asyncio.to_thread(learner.step, delivered.tensors())
        stats.last_loss = loss
        pending.append(delivered)
        losses.append(loss)
        if len(pending) < config.version_every:
            continue
        version = stats.version + 1
        directory = checkpoint_dir(config.checkpoints, version)
        await asyncio.to_thread(learner.save, directory)
        await batches.commit(pending, version, losses=losses)
        stats.version, stats.trained = version, stats.trained + len(pending)
        await publish_policy_version(
            store, connection, config.policy, version, str(directory.absolute()),
            batches_consumed=[d.batch_id for d in pending],
        )  # fmt: skip
        log.info("policy version %d published (%d batches trained, loss %.4f)", version, stats.trained, loss)
        pending.clear()
        losses.clear()
