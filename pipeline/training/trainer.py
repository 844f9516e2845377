"""The training loop: batches from the stream, one learner step each, a policy version every
``version_every`` batches — checkpoint written, then the batches recorded as trained into it, then acked,
then the version published — so after a crash each batch counts exactly once. The next batches are
fetched and loaded into tensors while the learner steps (``_Ahead``); a trainer that fell behind takes up to
``merge_waiting`` waiting batches into one step. Checkpoints older than the
newest ``keep_checkpoints`` are removed after each publication; ``on_step`` (off by default) hears of each
step, for an experiment logger or tracker (``tracking``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import shutil
from collections.abc import Callable, Coroutine
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Final, TextIO

from nats.aio.client import Client as NatsConnection

from pipeline.errors import ConfigError
from pipeline.log import Store
from pipeline.training.ppo import PolicyGradient, checkpoint_dir
from pipeline.training.subscription import BatchSubscription, DeliveredBatch, publish_policy_version
from pipeline.training.tensors import BatchTensors, concat_tensors

log = logging.getLogger(__name__)


@dataclass
class TrainerStats:
    version: int = 0
    trained: int = 0
    stale: int = 0
    last_loss: float | None = None


@dataclass(frozen=True)
class StepRecord:
    """What a learner step tells an experiment logger (``TrainingPlan.on_step``)."""

    step: int  # batches trained by this trainer, this one included
    batch_id: str
    policy_version: int  # the version the step starts from (its update goes into the next one)
    loss: float
    samples: int
    tokens: int
    staleness: int  # versions between the batch's oldest sample and the version trained
    mean_reward: float
    mean_advantage: float
    kl: float  # approximate KL(sampling policy || trained policy) over the batch's scored tokens
    clip_fraction: float  # share of scored tokens whose probability ratio was clipped
    reference_kl: float = 0.0  # approximate KL(trained || starting weights), with --kl-coef
    skipped: int = 0  # batches skipped as stale by this trainer so far


StepHook = Callable[[StepRecord], None]
_CHECKPOINT: Final = re.compile(r"v(\d{6,})")
PUBLISH_ON_STOP_S: Final = 5.0
"""How long a trainer told to stop while it publishes a version lets that publication finish first (its
batches are recorded as trained into it already; left unfinished, only the trainer's next start would
publish it, in ``resume``). Shorter than a supervisor's grace period (``docker compose stop``: 10 s), so
that a PostgreSQL or NATS outage, or a checkpoint slow to write, ends the wait before the supervisor ends
the process."""


class JsonlStepLog:
    """An ``on_step`` hook writing a JSON line per step (``turnstile serve trainer --log-steps FILE``); W&B
    or MLflow fit the same hook: ``on_step=lambda r: wandb.log(dataclasses.asdict(r), step=r.step)``."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file: TextIO = path.open("a", encoding="utf-8")

    def __call__(self, record: StepRecord) -> None:
        self.file.write(json.dumps(asdict(record), sort_keys=True) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def prune_checkpoints(root: Path, keep: int) -> list[Path]:
    """Remove all but the newest ``keep`` version directories under ``root`` (``keep`` 0: keep all); the
    directories removed. Partial directories (a save in progress) are not versions and stay."""
    if keep <= 0 or not root.is_dir():
        return []
    versions = sorted(
        (int(match.group(1)), entry)
        for entry in root.iterdir()
        if entry.is_dir() and (match := _CHECKPOINT.fullmatch(entry.name))
    )
    removed = [entry for _, entry in versions[:-keep]]
    for entry in removed:
        shutil.rmtree(entry, ignore_errors=True)
    return removed


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
    merge_waiting: int = 1
    """A trainer that fell behind takes up to this many batches that are already waiting into one step (one
    update, one version): batches sized to the learner's rate instead of skipped as stale; 1: never."""
    keep_checkpoints: int = 3
    """Version directories kept (the newest; 0 keeps all): resuming needs only the newest, an inference
    consumer that lags further behind fails to load an older one, says so and keeps its weights."""
    on_step: StepHook | None = None


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
    async with _Ahead(batches, depth=plan.merge_waiting) as ahead:
        while True:
            taken = [await ahead.next(), *ahead.ready(plan.merge_waiting - 1)]
            fresh = [item for item in taken if not await _skipped(plan, batches, stats, item[0])]
            if not fresh:
                continue
            tensors = concat_tensors([item[1] for item in fresh])
            loss = await asyncio.to_thread(learner.step, tensors)
            stats.last_loss = loss
            for delivered, _ in fresh:
                pending.append(delivered)
                losses.append(loss)
                if plan.on_step is not None:
                    step = stats.trained + len(pending)
                    _tell(plan.on_step, _record(step, delivered, stats, loss, learner.diagnostics))
            if len(pending) >= plan.version_every:
                publishing = _publish(plan, store, connection, batches, learner, stats, pending, losses)
                await _finished_before_stopping(publishing, f"version {stats.version + 1}")
                pending, losses = [], []


async def _finished_before_stopping(work: Coroutine[Any, Any, None], what: str) -> None:
    """Await ``work``. If the trainer is stopped meanwhile (this task cancelled), ``work`` goes on for up to
    ``PUBLISH_ON_STOP_S`` before the cancellation does: a stop between recording a version's batches and
    publishing the version publishes it, and inference consumers load it now, not at the trainer's next
    start. A second cancellation, or the time running out, cancels ``work`` as well."""
    task = asyncio.ensure_future(work)
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        if task.done():
            raise
        log.info("stopping: finishing %s first (at most %g s)", what, PUBLISH_ON_STOP_S)
        try:
            await asyncio.wait_for(task, PUBLISH_ON_STOP_S)
        except TimeoutError:
            log.warning("stopping: %s did not finish within %g s; the next start publishes it", what,
                        PUBLISH_ON_STOP_S)  # fmt: skip
        except Exception:
            log.exception("stopping: %s failed; the next start publishes it", what)
        raise


async def _skipped(
    plan: TrainingPlan, batches: BatchSubscription, stats: TrainerStats, delivered: DeliveredBatch
) -> bool:
    """Whether ``delivered`` is too far behind the version trained now; if so it is recorded as skipped."""
    behind = stats.version - delivered.min_policy_version
    if plan.max_staleness is None or behind <= plan.max_staleness:
        return False
    stats.stale += 1
    log.info("batch %s is %d versions behind: skipped", delivered.batch_id, behind)
    await batches.commit([delivered], stats.version, outcome="stale")
    return True


async def _publish(
    plan: TrainingPlan,
    store: Store,
    connection: NatsConnection,
    batches: BatchSubscription,
    learner: PolicyGradient,
    stats: TrainerStats,
    pending: list[DeliveredBatch],
    losses: list[float | None],
) -> None:
    """Checkpoint, then record the batches as trained into it and ack them, then publish the version."""
    version = stats.version + 1
    directory = checkpoint_dir(plan.checkpoints, version)
    await asyncio.to_thread(learner.save, directory)
    await batches.commit(pending, version, losses=losses)
    stats.version, stats.trained = version, stats.trained + len(pending)
    await publish_policy_version(
        store, connection, plan.policy, version, str(directory.absolute()),
        batches_consumed=[d.batch_id for d in pending],
    )  # fmt: skip
    log.info(
        "policy version %d published (%d batches trained, loss %.4f)", version, stats.trained, losses[-1]
    )
    for removed in await asyncio.to_thread(prune_checkpoints, plan.checkpoints, plan.keep_checkpoints):
        log.info("removed checkpoint %s (keeping the newest %d)", removed, plan.keep_checkpoints)


def _record(
    step: int,
    delivered: DeliveredBatch,
    stats: TrainerStats,
    loss: float,
    diagnostics: dict[str, float],
) -> StepRecord:
    samples = delivered.batch.samples
    n = max(len(samples), 1)
    return StepRecord(
        step=step,
        batch_id=delivered.batch_id,
        policy_version=stats.version,
        loss=loss,
        samples=len(samples),
        tokens=delivered.batch.tokens,
        staleness=stats.version - delivered.min_policy_version,
        mean_reward=sum(s.reward for s in samples) / n,
        mean_advantage=sum(s.advantage for s in samples) / n,
        kl=diagnostics.get("kl", 0.0),
        clip_fraction=diagnostics.get("clip_fraction", 0.0),
        reference_kl=diagnostics.get("reference_kl", 0.0),
        skipped=stats.stale,
    )


def _tell(hook: StepHook, record: StepRecord) -> None:
    """A logger that fails (a network hiccup of a tracking server) must not stop training."""
    try:
        hook(record)
    except Exception:
        log.exception("the on_step hook failed on batch %s; training goes on", record.batch_id)


class _Ahead:
    """The batches with their tensors, fetched from JetStream and loaded (in a thread) while the learner
    steps: up to ``depth`` wait ready, so the learner never waits on NATS or on decoding, and a trainer that
    fell behind finds several at once (``TrainingPlan.merge_waiting``). Whether a batch is too stale is
    still decided when the learner takes it, against the version of that moment."""

    def __init__(self, batches: BatchSubscription, depth: int) -> None:
        self._batches = batches
        self._queue: asyncio.Queue[tuple[DeliveredBatch, BatchTensors]] = asyncio.Queue(maxsize=max(depth, 1))
        self._filling: asyncio.Task[None] | None = None

    async def __aenter__(self) -> _Ahead:
        self._filling = asyncio.create_task(self._fill())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._filling is not None
        self._filling.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._filling

    async def _fill(self) -> None:
        async for delivered in self._batches:
            await self._queue.put((delivered, await asyncio.to_thread(delivered.tensors)))

    async def next(self) -> tuple[DeliveredBatch, BatchTensors]:
        """The next batch, waiting for it; the subscription's error if it failed."""
        assert self._filling is not None
        getting = asyncio.ensure_future(self._queue.get())
        await asyncio.wait({getting, self._filling}, return_when=asyncio.FIRST_COMPLETED)
        if getting.done():
            return getting.result()
        getting.cancel()
        self._filling.result()  # raises what stopped it
        raise RuntimeError("the batch subscription ended")

    def ready(self, most: int) -> list[tuple[DeliveredBatch, BatchTensors]]:
        """Up to ``most`` batches already loaded, without waiting."""
        taken: list[tuple[DeliveredBatch, BatchTensors]] = []
        while len(taken) < most and not self._queue.empty():
            taken.append(self._queue.get_nowait())
        return taken
