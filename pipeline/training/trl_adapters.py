"""TRL on the batch stream (``pip install -e '.[trl]'``; tested with trl 1.16.0).

Three pieces, all reading ``batches.<policy>`` through ``BatchSubscription`` (one durable consumer, its
``trained_batches`` rows, the same exactly-once rule as the reference trainer):

- ``StreamRolloutWorker`` is AsyncGRPOTrainer's ``rollout_worker``: its ``rollout_buffer`` holds one
  ``RolloutSample`` per Turnstile sample (tokens, loss mask as ``completion_mask``, sampling logprobs as
  ``old_log_probs``, Turnstile's advantage, the sample's policy version as ``model_version``, its group).
- ``CheckpointWeightTransfer`` is AsyncGRPOTrainer's ``weight_transfer``: the weights it is sent become a
  checkpoint directory (whole or absent) and a ``PolicyVersionPublished`` that inference consumers load.
  TRL's vLLM server and NCCL are not used.
- ``StreamRollouts`` is GRPOTrainer's ``rollout_func``: the completions of a generation are samples from the
  stream, not text the trainer generates. GRPOTrainer recomputes advantages from rewards (per group of
  ``num_generations`` consecutive completions), so Turnstile's advantages (per depth, per lineage) are
  replaced by GRPO's own; use AsyncGRPOTrainer or the reference learner to train on Turnstile's advantages.

A batch is acked only once all its samples are trained and a version holding them is published; one that
is not (the trainer stopped or died first) is delivered again. Both trainers number versions on from the
newest version this durable recorded, and start from that version's checkpoint (``start_weights``).

trl, datasets and transformers are imported inside the functions that need them: importing
``pipeline.training`` does not need the ``trl`` extra.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import queue
import shutil
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import nats

from pipeline.batches import BatchSample
from pipeline.errors import ConfigError
from pipeline.log import EventStore
from pipeline.settings import nats_inbox_prefix
from pipeline.training.ppo import checkpoint_dir
from pipeline.training.subscription import BatchSubscription, DeliveredBatch, publish_policy_version
from pipeline.training.trainer import prune_checkpoints

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

WEIGHT_FILES: Final = (".safetensors", ".bin", ".pt", ".pth")
"""Files of a model directory that hold weights (or optimizer state): not copied into a new checkpoint."""


class StreamFeed:
    """A trainer's ``BatchSubscription`` on an event loop of its own thread, for synchronous trainers.

    ``next_batch`` takes the next batch not yet trained by ``durable``; ``commit`` records batches as
    trained (or skipped as stale) into a version and acks them; ``publish`` appends and broadcasts a
    version. A batch taken and never committed is delivered again after ``ack_wait`` once the feed closes.
    """

    def __init__(
        self, nats_url: str, database_url: str, *, policy: str, durable: str, ack_wait: float = 120.0
    ) -> None:
        self.nats_url, self.database_url = nats_url, database_url
        self.policy, self.durable, self.ack_wait = policy, durable, ack_wait
        self._batches: queue.Queue[DeliveredBatch] = queue.Queue(maxsize=1)
        self._failure: BaseException | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="turnstile batch feed", daemon=True
        )
        self._thread.start()
        self._stack = contextlib.AsyncExitStack()
        self._feeding: concurrent.futures.Future[None] | None = None
        try:
            self._call(self._open())
        except BaseException:
            self.close()
            raise

    def _call(self, coroutine: Any, timeout: float = 120.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout)

    async def _open(self) -> None:
        connection = await nats.connect(self.nats_url, inbox_prefix=nats_inbox_prefix(self.nats_url))
        self._stack.push_async_callback(connection.drain)
        self.store = await EventStore.connect(self.database_url)
        self._stack.push_async_callback(self.store.close)
        self.connection = connection
        self.subscription = await BatchSubscription.open(
            connection, self.store, policy=self.policy, durable=self.durable, ack_wait=self.ack_wait
        )
        self._stack.push_async_callback(self.subscription.close)

    def next_batch(self, timeout: float | None = None) -> DeliveredBatch | None:
        """The next untrained batch, or None after ``timeout`` seconds without one."""
        if self._feeding is None:
            self._feeding = asyncio.run_coroutine_threadsafe(self._feed(), self._loop)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self._failure is not None:
                raise self._failure
            left = 0.2 if deadline is None else min(0.2, deadline - time.monotonic())
            if left <= 0:
                return None
            with contextlib.suppress(queue.Empty):
                return self._batches.get(timeout=left)

    async def _feed(self) -> None:
        try:
            async for delivered in self.subscription:
                # the queue holds one batch: the next is fetched from JetStream only when this one is taken
                while True:
                    try:
                        self._batches.put_nowait(delivered)
                        break
                    except queue.Full:
                        await asyncio.sleep(0.02)
        except Exception as error:  # the taking thread raises it (never block this loop on the queue)
            self._failure = error

    def trained_version(self) -> int:
        """The newest version this durable recorded batches into (0: none)."""
        return int(self._call(self.subscription.trained_version()))

    def commit(self, delivered: Sequence[DeliveredBatch], version: int, *, outcome: str = "trained") -> None:
        self._call(self.subscription.commit(list(delivered), version, outcome=outcome))

    def publish(self, version: int, checkpoint: Path, batches_consumed: Sequence[str]) -> None:
        self._call(
            publish_policy_version(
                self.store, self.connection, self.policy, version, str(checkpoint.absolute()),
                batches_consumed=batches_consumed,
            )
        )  # fmt: skip

    def close(self) -> None:
        """Stop fetching and close the connections; batches taken and not committed come back later."""
        if not self._loop.is_running():
            return
        with contextlib.suppress(Exception):
            self._call(self._close(), timeout=60)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=60)
        if not self._loop.is_running():
            self._loop.close()

    async def _close(self) -> None:
        if self._feeding is not None:
            self._feeding.cancel()
            with contextlib.suppress(BaseException):
                await asyncio.wrap_future(self._feeding)
        await self._stack.aclose()

    def __enter__(self) -> StreamFeed:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def start_weights(model: Path, checkpoints: Path, version: int) -> Path:
    """The weights a trainer at ``version`` starts from: that version's checkpoint, or ``model`` at 0."""
    weights = checkpoint_dir(checkpoints, version) if version else model
    if not (weights / "config.json").is_file():
        raise ConfigError(
            f"version {version} is recorded as trained but its checkpoint {weights} is missing; restore it "
            "or use another durable name"
        )
    return weights


def write_checkpoint(
    directory: Path, base: Path, weights: dict[str, torch.Tensor] | None = None, model: Any = None
) -> Path:
    """Write a Hugging Face model directory at ``directory``, whole or absent: into ``<name>.partial`` first,
    then renamed. Its configuration and tokenizer files are ``base``'s; its weights are ``model``'s
    (``save_pretrained``) or ``base``'s tensors with ``weights`` laid over them (parameters a trainer does not
    send, frozen ones, keep their values)."""
    from safetensors.torch import load_file, save_file

    tensors: dict[str, torch.Tensor] = {}
    if model is None:
        for shard in sorted(base.glob("*.safetensors")):
            tensors.update(load_file(shard))
        unknown = sorted(set(weights or {}) - set(tensors))
        if unknown:
            raise ConfigError(f"weights not in the model at {base}: {unknown[:5]}; send its own names")
        tensors.update(weights or {})
    partial = directory.with_name(directory.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    for entry in base.iterdir():
        if entry.is_file() and not entry.name.endswith((*WEIGHT_FILES, ".index.json")):
            shutil.copy2(entry, partial / entry.name)
    if model is not None:
        model.save_pretrained(partial)
    else:
        save_file(tensors, str(partial / "model.safetensors"), metadata={"format": "pt"})
    shutil.rmtree(directory, ignore_errors=True)
    os.replace(partial, directory)
    return directory


def rollout_samples(
    batch_samples: Sequence[BatchSample], *, version_offset: int, groups: dict[str, int]
) -> list[Any]:
    """One ``trl``'s ``RolloutSample`` per Turnstile sample. Masks and logprobs keep their positions: both
    count a token where it stands, scored by the logits before it. ``model_version`` is the sample's policy
    version less ``version_offset`` (the trainer counts its versions from 0 at its start); ``group_id`` is
    the sample's group as a number (``groups`` maps group ids to numbers, and grows)."""
    import numpy as np
    from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

    samples = []
    for sample in batch_samples:
        group = groups.setdefault(sample.group_id, len(groups))
        samples.append(
            RolloutSample(
                prompt=[],
                completion=[],
                input_ids=np.asarray(sample.input_ids, dtype=np.int64),
                completion_mask=np.asarray(sample.loss_mask, dtype=np.int64),
                old_log_probs=np.asarray(sample.logprobs, dtype=np.float32),
                advantage=float(sample.advantage),
                model_version=sample.policy_version - version_offset,
                group_id=group,
                metrics={"reward": float(sample.reward)},
            )
        )
    return samples


@dataclass
class _Pending:
    """A batch whose samples are in the rollout buffer or the trainer: how many taken, and when."""

    delivered: DeliveredBatch
    left: int
    last_taken: int = 0  # syncs done when its last sample was taken off the queue


class _LedgerQueue(queue.Queue[Any]):
    """The rollout buffer: FIFO, and tells its worker which batch each sample it hands out came from."""

    def __init__(self, taken: Callable[[str], None]) -> None:
        super().__init__()
        self._owners: deque[str] = deque()
        self._taken = taken

    def put_sample(self, sample: Any, batch_id: str) -> None:
        self.put((sample, batch_id))

    def _put(self, item: tuple[Any, str]) -> None:  # under the queue's lock
        self.queue.append(item[0])
        self._owners.append(item[1])

    def _get(self) -> Any:  # under the queue's lock
        self._taken(self._owners.popleft())
        return self.queue.popleft()


class StreamRolloutWorker:
    """AsyncGRPOTrainer's ``rollout_worker`` (trl's ``RolloutWorkerProtocol``), fed by ``batches.<policy>``.

    Staleness is the reference trainer's rule: a batch whose oldest sample is more than ``max_staleness``
    versions behind the newest published version is recorded as ``stale`` and acked, never queued (give
    AsyncGRPOConfig the same ``max_staleness``: its own check then agrees, since ``model_version`` is counted
    from this worker's start version).

    Acks: a sample taken off ``rollout_buffer`` is trained at the latest ``ack_lag`` weight syncs later. The
    trainer's data loader fetches one micro-batch ahead of the one it trains, and its planner may hold one
    sample it took for the micro-batch after that, so what was taken before sync k is trained by sync k + 2;
    hence a batch is committed (recorded as trained into the version, then acked) at the first sync at
    least 3 syncs after its last sample was taken, and only when that sync's version is published (by
    ``CheckpointWeightTransfer``, before the trainer tells this worker the new version).
    """

    def __init__(
        self,
        nats_url: str,
        database_url: str,
        *,
        policy: str,
        durable: str,
        model: Path,
        checkpoints: Path,
        max_staleness: int | None = None,
        ack_lag: int = 3,
        max_queued: int = 256,
        ack_wait: float = 120.0,
        keep_checkpoints: int = 3,
    ) -> None:
        # imported here, before the filling thread starts: two threads importing trl's modules at once can
        # deadlock on Python's import locks (the trainer imports them on its own thread)
        import trl.experimental.async_grpo.async_rollout_worker  # noqa: F401

        self.feed = StreamFeed(nats_url, database_url, policy=policy, durable=durable, ack_wait=ack_wait)
        self.checkpoints, self.max_staleness, self.ack_lag = checkpoints, max_staleness, ack_lag
        self.max_queued, self.keep_checkpoints = max_queued, keep_checkpoints
        self.start_version = self.feed.trained_version()
        self.start_weights = start_weights(model, checkpoints, self.start_version)
        self.weights = self.start_weights  # the newest checkpoint: the next one's base
        self.published = self.start_version  # the newest version published by this trainer
        self.stale = 0  # batches skipped as too old
        self.queued = 0  # samples put on the rollout buffer
        self.rollout_buffer = _LedgerQueue(self._taken)  # trl reads it as a queue.Queue
        self.metrics_queue: queue.Queue[dict[str, Any]] = queue.Queue()
        self._syncs = 0
        self._pending: dict[str, _Pending] = {}
        self._to_commit: tuple[int, list[DeliveredBatch]] | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failure: BaseException | None = None
        self._groups: dict[str, int] = {}

    def weight_transfer(self) -> CheckpointWeightTransfer:
        return CheckpointWeightTransfer(self)

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._fill, name="turnstile rollout worker", daemon=True)
            self._thread.start()

    def _fill(self) -> None:
        try:
            while not self._stop.is_set():
                if self.rollout_buffer.qsize() >= self.max_queued:
                    self._stop.wait(0.05)
                    continue
                delivered = self.feed.next_batch(timeout=0.5)
                if delivered is not None:
                    self._queue(delivered)
        except BaseException as error:
            self._failure = error
            log.exception("the rollout worker stopped")

    def _queue(self, delivered: DeliveredBatch) -> None:
        behind = self.published - delivered.min_policy_version
        if self.max_staleness is not None and behind > self.max_staleness:
            self.stale += 1
            log.info("batch %s is %d versions behind: skipped", delivered.batch_id, behind)
            self.feed.commit([delivered], self.published, outcome="stale")
            self.metrics_queue.put({"turnstile/stale_batches": 1.0})
            return
        samples = rollout_samples(
            delivered.batch.samples, version_offset=self.start_version, groups=self._groups
        )
        with self._lock:
            self._pending[delivered.batch_id] = _Pending(delivered, left=len(samples))
        for sample in samples:
            self.rollout_buffer.put_sample(sample, delivered.batch_id)
        self.queued += len(samples)

    def _taken(self, batch_id: str) -> None:
        with self._lock:
            pending = self._pending[batch_id]
            pending.left -= 1
            pending.last_taken = self._syncs

    def next_version(self) -> tuple[int, list[DeliveredBatch]]:
        """The version the next weight sync makes and the batches it will hold (all samples taken at least
        ``ack_lag`` syncs before it); kept until ``update_model_version`` commits them."""
        with self._lock:
            sync = self._syncs + 1
            ready = [
                p.delivered
                for p in self._pending.values()
                if p.left == 0 and p.last_taken <= sync - self.ack_lag
            ]
        version = self.start_version + sync
        self._to_commit = (version, ready)
        return version, ready

    def update_model_version(self, model_version: int) -> None:
        """The trainer's weights are version ``model_version`` (counted from this worker's start): commit
        the batches the transfer published that version with."""
        with self._lock:
            self._syncs = model_version
        version = self.start_version + model_version
        if self._to_commit is None or self._to_commit[0] != version or self.published != version:
            log.warning("version %d was not published by CheckpointWeightTransfer: no batch acked", version)
            return
        ready = self._to_commit[1]
        self.feed.commit(ready, version)
        with self._lock:
            for delivered in ready:
                del self._pending[delivered.batch_id]
        self._to_commit = None
        self.metrics_queue.put({"turnstile/batches_acked": float(len(ready))})

    def check_health(self, stale_after_s: float) -> None:
        """An idle stream is not a failure (no batches yet); a worker that stopped on an error is."""
        if self._failure is not None:
            raise RuntimeError(f"the Turnstile rollout worker failed: {self._failure!r}") from self._failure

    def stop(self) -> None:
        """Stop filling and close the feed: batches not committed are delivered again later."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=60)
            self._thread = None
        self.feed.close()


class CheckpointWeightTransfer:
    """AsyncGRPOTrainer's ``weight_transfer`` (trl's ``WeightTransferProtocol``): each ``send_weights``
    writes the weights as the checkpoint of the worker's next version and publishes it. No inference server
    is paused: consumers load the version when they hear of it, between requests."""

    def __init__(self, worker: StreamRolloutWorker) -> None:
        self.worker = worker

    def init_weight_transfer(self) -> None:
        """Nothing to set up: the checkpoint directory and the log are the transport."""

    def pause(self) -> None:
        """Nothing to pause."""

    def resume(self) -> None:
        """Nothing to resume."""

    def destroy(self) -> None:
        """Nothing held."""

    def send_weights(self, iterator: Iterator[tuple[str, torch.Tensor]]) -> None:
        weights = {name: tensor.detach().to("cpu", copy=True).contiguous() for name, tensor in iterator}
        version, ready = self.worker.next_version()
        directory = checkpoint_dir(self.worker.checkpoints, version)
        # over the newest checkpoint: parameters not sent (frozen ones) keep their values
        write_checkpoint(directory, self.worker.weights, weights)
        self.worker.feed.publish(version, directory, [d.batch_id for d in ready])
        self.worker.published, self.worker.weights = version, directory
        prune_checkpoints(self.worker.checkpoints, self.worker.keep_checkpoints)
        log.info("policy version %d published (%d batches in it)", version, len(ready))


@dataclass
class _Generation:
    step: int  # the trainer's micro-step when it asked for these completions
    batches: list[DeliveredBatch] = field(default_factory=list)


class StreamRollouts:
    """GRPOTrainer's ``rollout_func``: each call returns as many completions as it is given prompts, the
    next samples of the stream, in stream order (prompt: the tokens before the first trained one;
    completion: the rest, ``env_mask`` 0 where the loss mask is). Set ``num_generations`` to the
    materializer's group size so that GRPO's groups line up with Turnstile's. The dataset's prompts are
    placeholders (``placeholder_prompts``): the stream decides what is trained.

    GRPOTrainer recomputes advantages from the rewards it is given (``turnstile_reward``, the reward the
    materializer gave the sample: pass ``reward_turnstile`` as the reward function), normalized per group
    of ``num_generations`` consecutive completions: Turnstile's advantages are replaced by GRPO's.

    Add ``callback()`` to the trainer: every ``version_every`` optimizer steps it saves the model as the
    next version (whole or absent), publishes it, then commits and acks the batches whose samples are all
    trained (GRPOTrainer trains a generation over its next ``steps_per_generation * num_iterations``
    micro-steps). A batch only partly handed out waits for the next generation.
    """

    def __init__(
        self,
        feed: StreamFeed,
        *,
        model: Path,
        checkpoints: Path,
        version_every: int = 1,
        max_staleness: int | None = None,
        wait: float | None = None,
        keep_checkpoints: int = 3,
    ) -> None:
        self.feed, self.checkpoints, self.version_every = feed, checkpoints, version_every
        self.max_staleness, self.wait, self.keep_checkpoints = max_staleness, wait, keep_checkpoints
        self.start_version = feed.trained_version()
        self.start_weights = start_weights(model, checkpoints, self.start_version)
        self.weights = self.start_weights  # the newest checkpoint: its tokenizer files go into the next
        self.published = self.start_version
        self.stale = 0
        self._held: deque[tuple[BatchSample, DeliveredBatch]] = deque()
        self._generations: list[_Generation] = []
        self._trainer: Any = None

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
        self._trainer = trainer
        generation = _Generation(step=trainer._step)
        taken = [self._next_sample(generation) for _ in prompts]
        self._generations.append(generation)
        first_trained = [next((i for i, m in enumerate(s.loss_mask) if m), len(s.loss_mask)) for s in taken]
        return {
            "prompt_ids": [list(s.input_ids[:k]) for s, k in zip(taken, first_trained, strict=True)],
            "completion_ids": [list(s.input_ids[k:]) for s, k in zip(taken, first_trained, strict=True)],
            "logprobs": [list(s.logprobs[k:]) for s, k in zip(taken, first_trained, strict=True)],
            "env_mask": [list(s.loss_mask[k:]) for s, k in zip(taken, first_trained, strict=True)],
            "turnstile_reward": [s.reward for s in taken],
            "turnstile_sample_id": [s.sample_id for s in taken],
        }

    def _next_sample(self, generation: _Generation) -> BatchSample:
        while not self._held:
            delivered = self.feed.next_batch(timeout=self.wait)
            if delivered is None:
                raise TimeoutError(f"no batch on the stream of {self.feed.policy!r} within {self.wait}s")
            behind = self.published - delivered.min_policy_version
            if self.max_staleness is not None and behind > self.max_staleness:
                self.stale += 1
                self.feed.commit([delivered], self.published, outcome="stale")
                continue
            self._held.extend((sample, delivered) for sample in delivered.batch.samples)
        sample, delivered = self._held.popleft()
        # a batch counts for the generation that hands out its last sample
        if not any(owner is delivered for _, owner in self._held):
            generation.batches.append(delivered)
        return sample

    def trained_batches(self, micro_step: int) -> list[DeliveredBatch]:
        """The batches all of whose samples are trained once the trainer has done ``micro_step`` steps."""
        trainer = self._trainer
        if trainer is None:
            return []
        every = trainer.args.steps_per_generation * trainer.num_iterations
        done = [g for g in self._generations if g.step + every <= micro_step]
        self._generations = [g for g in self._generations if g.step + every > micro_step]
        return [delivered for g in done for delivered in g.batches]

    def publish_version(self, model: Any) -> int:
        """Save ``model`` as the next version, publish it, then commit the batches trained into it."""
        version = self.published + 1
        ready = self.trained_batches(self._trainer._step if self._trainer is not None else 0)
        directory = write_checkpoint(checkpoint_dir(self.checkpoints, version), self.weights, model=model)
        self.feed.publish(version, directory, [d.batch_id for d in ready])
        self.published, self.weights = version, directory
        self.feed.commit(ready, version)
        prune_checkpoints(self.checkpoints, self.keep_checkpoints)
        log.info("policy version %d published (%d batches in it)", version, len(ready))
        return version

    def callback(self) -> Any:
        """A ``transformers.TrainerCallback`` that publishes a version every ``version_every`` steps."""
        from transformers import TrainerCallback

        rollouts = self

        class PublishVersions(TrainerCallback):
            def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                if state.global_step % rollouts.version_every == 0:
                    rollouts.publish_version(kwargs["model"])

        return PublishVersions()


def reward_turnstile(completions: list[Any], turnstile_reward: list[float], **_: Any) -> list[float]:
    """GRPOTrainer's reward function for ``StreamRollouts``: the reward the materializer gave each sample."""
    return [float(reward) for reward in turnstile_reward]


def placeholder_prompts(rows: int) -> Any:
    """A ``datasets.Dataset`` of ``rows`` placeholder prompts for GRPOTrainer (``StreamRollouts`` ignores
    their text: the stream decides what is trained). Size it to the steps you train for."""
    from datasets import Dataset

    return Dataset.from_dict({"prompt": [f"turnstile {row}" for row in range(rows)]})
