"""Torch views of training batches.

``BatchStream``: the batch subscription as a ``torch.utils.data.IterableDataset`` for a plain PyTorch loop
(``examples/train_with_pytorch.py``): each item is one batch's right-padded tensors (a dict with the fields
of ``BatchTensors`` and ``batch_id``); ``stream.commit(version)`` records the batches delivered since the
last commit as trained into ``version`` and only then acks them, so a trainer that dies before committing
gets them again and one that committed never does (``BatchSubscription``'s exactly-once rule). Use it with
``DataLoader(stream, batch_size=None)`` and no worker processes (the subscription lives in this process).

``SampleDataset``: the samples of training batches as a map-style torch ``Dataset``, for trainers that take
minibatches (several PPO epochs over a batch, shuffled) with a ``DataLoader``:

    loader = DataLoader(SampleDataset([delivered.payload]), batch_size=16, shuffle=True, collate_fn=collate)
    for minibatch in loader:   # dict of right-padded tensors, as BatchTensors holds them
        ...

Item ``i`` is one sample's unpadded tensors, loaded from the safetensors payloads (``input_ids``,
``loss_mask``, ``logprobs`` of its tokens; ``advantage``, ``reward``, ``policy_version`` as 0-d tensors).
Imports torch: import it as ``pipeline.training.dataset``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import queue
import threading
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import nats
import torch
from safetensors.torch import load
from torch.utils.data import Dataset, IterableDataset

from pipeline.batches import read_metadata
from pipeline.log import EventStore
from pipeline.settings import nats_inbox_prefix
from pipeline.training.subscription import BatchSubscription, DeliveredBatch

Sample = dict[str, torch.Tensor]


class SampleDataset(Dataset[Sample]):
    def __init__(self, payloads: Iterable[bytes]) -> None:
        self._batches: list[dict[str, torch.Tensor]] = []
        self._index: list[tuple[int, int]] = []  # (batch, sample)
        self.sample_ids: list[str] = []
        for payload in payloads:
            tensors = load(payload)
            self.sample_ids += [sample["sample_id"] for sample in read_metadata(payload)["samples"]]
            self._index += [(len(self._batches), row) for row in range(len(tensors["cu_seqlens"]) - 1)]
            self._batches.append(tensors)

    def __len__(self) -> int:
        return len(self._index)

    def __getitem__(self, index: int) -> Sample:
        batch, row = self._index[index]
        tensors = self._batches[batch]
        start, end = int(tensors["cu_seqlens"][row]), int(tensors["cu_seqlens"][row + 1])
        return {
            "input_ids": tensors["input_ids"][start:end].long(),
            "loss_mask": tensors["loss_mask"][start:end].float(),
            "logprobs": tensors["logprobs"][start:end],
            "advantage": tensors["advantages"][row],
            "reward": tensors["rewards"][row],
            "policy_version": tensors["policy_versions"][row],
        }


def collate(items: Sequence[Sample], pad_id: int = 0) -> Sample:
    """Samples as right-padded rows (``input_ids``, ``attention_mask``, ``loss_mask``, ``logprobs``) and
    stacked scalars (``advantages``, ``rewards``, ``policy_versions``): the fields of ``BatchTensors``."""
    length = max((len(item["input_ids"]) for item in items), default=0)
    rows = len(items)
    padded = {
        "input_ids": torch.full((rows, length), pad_id, dtype=torch.long),
        "attention_mask": torch.zeros((rows, length), dtype=torch.long),
        "loss_mask": torch.zeros((rows, length), dtype=torch.float32),
        "logprobs": torch.zeros((rows, length), dtype=torch.float32),
    }
    for row, item in enumerate(items):
        n = len(item["input_ids"])
        padded["input_ids"][row, :n] = item["input_ids"]
        padded["attention_mask"][row, :n] = 1
        padded["loss_mask"][row, :n] = item["loss_mask"]
        padded["logprobs"][row, :n] = item["logprobs"]
    padded["advantages"] = torch.stack([item["advantage"] for item in items])
    padded["rewards"] = torch.stack([item["reward"] for item in items])
    padded["policy_versions"] = torch.stack([item["policy_version"] for item in items])
    return padded


class BatchStream(IterableDataset[dict[str, Any]]):
    """Batches of ``policy`` not yet trained by ``durable``, as they arrive; iteration ends after
    ``idle_timeout`` seconds without a batch (None: never). The subscription runs on a thread of its own."""

    def __init__(
        self,
        nats_url: str,
        database_url: str,
        *,
        policy: str,
        durable: str,
        idle_timeout: float | None = None,
        ack_wait: float = 120.0,
        pad_id: int = 0,
    ) -> None:
        self.nats_url, self.database_url = nats_url, database_url
        self.policy, self.durable, self.ack_wait = policy, durable, ack_wait
        self.idle_timeout, self.pad_id = idle_timeout, pad_id
        self._queue: queue.Queue[DeliveredBatch | BaseException] = queue.Queue(maxsize=1)
        self._uncommitted: list[DeliveredBatch] = []
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._subscription: BatchSubscription | None = None
        self._thread: threading.Thread | None = None

    def __iter__(self) -> Iterator[dict[str, Any]]:
        self._start()
        while True:
            try:
                item = self._queue.get(timeout=self.idle_timeout)
            except queue.Empty:
                return
            if isinstance(item, BaseException):
                raise item
            self._uncommitted.append(item)
            tensors = item.tensors(self.pad_id)
            yield {
                **{field.name: getattr(tensors, field.name) for field in dataclasses.fields(tensors)},
                "batch_id": item.batch_id,
            }

    def commit(self, version: int, losses: Sequence[float | None] | None = None) -> int:
        """Record the batches yielded since the last commit as trained into ``version`` (call it once your
        checkpoint of that version is on disk), then ack them; how many."""
        delivered, self._uncommitted = self._uncommitted, []
        if not delivered:
            return 0
        assert self._loop is not None
        assert self._subscription is not None
        done = asyncio.run_coroutine_threadsafe(
            self._subscription.commit(delivered, version, losses=losses), self._loop
        )
        done.result(timeout=120)
        return len(delivered)

    def close(self) -> None:
        """Stop the subscription; batches yielded and not committed are delivered again (after ack_wait)."""
        if self._thread is None:
            return
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=60)
        self._thread = None

    def __enter__(self) -> BatchStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(
            target=asyncio.run, args=(self._run(),), name="batch stream", daemon=True
        )
        self._thread.start()
        self._ready.wait(timeout=120)

    async def _run(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        try:
            async with contextlib.AsyncExitStack() as stack:
                connection = await nats.connect(self.nats_url, inbox_prefix=nats_inbox_prefix(self.nats_url))
                stack.push_async_callback(connection.drain)
                store = await EventStore.connect(self.database_url)
                stack.push_async_callback(store.close)
                subscription = await BatchSubscription.open(
                    connection, store, policy=self.policy, durable=self.durable, ack_wait=self.ack_wait
                )
                stack.push_async_callback(subscription.close)
                self._subscription = subscription
                self._ready.set()
                feeding = asyncio.create_task(self._feed(subscription))
                stopping = asyncio.create_task(self._stop.wait())
                await asyncio.wait({feeding, stopping}, return_when=asyncio.FIRST_COMPLETED)
                for task in (feeding, stopping):
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
        except Exception as error:  # the iterating thread raises it
            self._queue.put(error)
        finally:
            self._ready.set()

    async def _feed(self, subscription: BatchSubscription) -> None:
        assert self._stop is not None
        try:
            async for delivered in subscription:
                while not self._stop.is_set():  # the queue holds one batch: the next is fetched when taken
                    try:
                        self._queue.put_nowait(delivered)
                        break
                    except queue.Full:
                        await asyncio.sleep(0.05)
        except Exception as error:
            self._queue.put(error)
