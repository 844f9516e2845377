"""Trainer service (``turnstile serve trainer``): the reference PPO-clip trainer on the batch stream.

Wiring only: the store and NATS through the service runtime, the durable batch subscription
(``pipeline.training.BatchSubscription``), the learner (``pipeline.training.PolicyGradient``) and the loop
(``pipeline.training.train``): every ``version_every`` batches a checkpoint, the batches recorded as trained
into it, a new policy version published for the inference consumers. Batches more than ``max_staleness``
versions behind are skipped and counted. On restart it resumes from the newest version it recorded
(weights and optimizer state), so every batch counts exactly once. Only the newest ``keep_checkpoints``
version directories stay; ``log_steps`` writes a JSON line per step and ``track`` logs each step to W&B or
MLflow (both ``on_step`` hooks). The learner's device, precision, micro-batches, KL and LoRA are
``pipeline.training.LearnerOptions``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from consumers.runtime import (
    METRICS_HOST,
    Runtime,
    connect_nats,
    connect_store,
    running,
    watch_database,
)
from pipeline.errors import ConfigError
from pipeline.training import (
    TRACKERS,
    BatchSubscription,
    JsonlStepLog,
    LearnerOptions,
    PolicyGradient,
    StepHook,
    StepRecord,
    Tracker,
    TrainerStats,
    TrainingPlan,
    open_tracker,
    resume,
    train,
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
    learner: LearnerOptions = field(default_factory=LearnerOptions)
    version_every: int = 1
    max_staleness: int | None = None
    ack_wait: float = 120.0
    merge_waiting: int = 1
    keep_checkpoints: int = 3
    log_steps: Path | None = None  # a JSON line per learner step (the on_step hook); off by default
    track: str | None = None  # "wandb" or "mlflow": each step logged to that tracker
    track_dir: Path | None = None  # where the tracker writes; None: <checkpoints>/tracking
    metrics_port: int | None = None
    metrics_host: str = METRICS_HOST

    def __post_init__(self) -> None:
        if self.version_every < 1:
            raise ConfigError(f"--version-every must be at least 1, got {self.version_every}")
        if self.track is not None and self.track not in TRACKERS:
            raise ConfigError(f"--track {self.track!r}: unknown tracker; use one of {', '.join(TRACKERS)}")
        if self.merge_waiting < 1:
            raise ConfigError(
                f"--merge-waiting must be at least 1 (1: never merge), got {self.merge_waiting}"
            )
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
            merge_waiting=self.merge_waiting,
            keep_checkpoints=self.keep_checkpoints,
            on_step=on_step,
        )


async def serve_trainer(config: TrainerConfig, *, stop: asyncio.Event | None = None) -> TrainerStats:
    """Train until Ctrl-C, SIGTERM or ``stop``; the trainer's figures at the end."""
    step_log = JsonlStepLog(config.log_steps) if config.log_steps is not None else None
    tracker = await asyncio.to_thread(_tracker, config)
    stats = TrainerStats()
    async with running(
        f"trainer {config.durable}",
        stop=stop,
        metrics_port=config.metrics_port,
        metrics_host=config.metrics_host,
    ) as runtime:
        observe = instrument(runtime, lambda: stats, config.policy)
        plan = config.plan(_all(step_log, tracker, observe))
        store = await connect_store(config.database_url)
        assert store is not None
        watch_database(runtime, config.database_url)
        try:
            connection = await connect_nats(config.nats_url, runtime=runtime)
            assert connection is not None
            runtime.check("nats", lambda: connection.is_connected)
            try:
                batches = await BatchSubscription.open(
                    connection, store, policy=config.policy, durable=config.durable, ack_wait=config.ack_wait
                )
                async with batches:
                    stats, weights = await resume(plan, store, connection, batches)
                    runtime.counter(
                        "turnstile_trainer_quarantined_total",
                        "messages on BATCHES that were not a readable batch of this policy (terminated)",
                        lambda: batches.quarantined,
                    )
                    runtime.counter(
                        "turnstile_trainer_duplicates_total",
                        "batches delivered again after they were recorded (acked, skipped)",
                        lambda: batches.duplicates,
                    )
                    learner = await asyncio.to_thread(
                        PolicyGradient, weights, config.learner, base=config.model
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
            if tracker is not None:
                await asyncio.to_thread(tracker.close)
    return stats


def _tracker(config: TrainerConfig) -> Tracker | None:
    """The experiment tracker of ``--track`` (None: none), its run named after the trainer."""
    if config.track is None:
        return None
    directory = config.track_dir if config.track_dir is not None else config.checkpoints / "tracking"
    settings = {"policy": config.policy, "model": str(config.model), "version_every": config.version_every}
    settings |= {"max_staleness": config.max_staleness, "merge_waiting": config.merge_waiting}
    settings |= dataclasses.asdict(config.learner)
    return open_tracker(config.track, run_name=config.durable, directory=directory, config=settings)


def _all(*hooks: StepHook | None) -> StepHook:
    """One hook that calls each of ``hooks`` in turn (None: left out)."""
    present = [hook for hook in hooks if hook is not None]

    def every(record: StepRecord) -> None:
        for hook in present:
            hook(record)

    return every


def instrument(runtime: Runtime, stats: Callable[[], TrainerStats], policy: str) -> StepHook:
    """The trainer's metrics; the hook that observes each learner step. Versions, batches and the per-step
    histograms carry the ``policy`` label, so that two policies' trainers are told apart on one dashboard.

    Batch sizes: read the mean from the histogram's ``_sum`` / ``_count`` (exact); its quantiles interpolate
    inside a bucket (every batch of 64 samples reads as a p50 of 48 with buckets 32 and 64)."""
    runtime.gauge(
        "turnstile_trainer_policy_version",
        "the newest policy version published, by policy",
        lambda: {(policy,): stats().version},
        ["policy"],
    )
    runtime.counter(
        "turnstile_trainer_batches_trained_total",
        "batches trained, by policy",
        lambda: {(policy,): stats().trained},
        ["policy"],
    )
    runtime.counter(
        "turnstile_trainer_stale_batches_total", "batches skipped as too far behind", lambda: stats().stale
    )
    runtime.gauge("turnstile_trainer_loss", "the last learner step's loss", lambda: stats().last_loss or 0.0)
    staleness = runtime.histogram(
        "turnstile_trainer_batch_staleness",
        "policy versions between a batch's oldest sample and the version it was trained on",
        (0, 1, 2, 3, 4, 6, 8, 16, 32),
        ["policy"],
    ).labels(policy)
    samples = runtime.histogram(
        "turnstile_trainer_batch_samples",
        "samples per learner step (mean: rate of _sum / rate of _count)",
        (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 512, 1024, 2048, 4096),
        ["policy"],
    ).labels(policy)
    tokens = runtime.histogram(
        "turnstile_trainer_batch_tokens",
        "tokens per learner step (mean: rate of _sum / rate of _count)",
        (256, 1024, 4096, 16384, 65536, 262144, 1048576),
        ["policy"],
    ).labels(policy)
    last = {"reward": 0.0, "kl": 0.0, "clip_fraction": 0.0}
    runtime.gauge(
        "turnstile_trainer_batch_mean_reward", "the last trained batch's mean reward", lambda: last["reward"]
    )
    runtime.gauge(
        "turnstile_trainer_kl",
        "the last step's approximate KL(sampling || trained policy)",
        lambda: last["kl"],
    )
    runtime.gauge(
        "turnstile_trainer_clip_fraction",
        "the share of the last step's scored tokens whose ratio was clipped",
        lambda: last["clip_fraction"],
    )

    def observe(record: StepRecord) -> None:
        staleness.observe(record.staleness)
        samples.observe(record.samples)
        tokens.observe(record.tokens)
        last.update(reward=record.mean_reward, kl=record.kl, clip_fraction=record.clip_fraction)

    return observe
