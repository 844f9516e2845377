"""TRL on the batch stream (marker ``trl``: ``pip install -e '.[dev,trl]'``, then ``pytest -m trl``):
GRPOTrainer trained for real on CPU from a stream made by the real materializer and relay, and
AsyncGRPOTrainer's rollout worker and weight transfer (its trainer needs CUDA: ``tests/e2e/test_gpu_trl.py``)
read through trl's own queue dataset, against the real stream and log."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nats
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pipeline.batches import BATCHES_STREAM, TrainingBatch, batch_subject, fetch_training_batch
from pipeline.log import EventStore
from pipeline.training import (
    StreamFeed,
    StreamRollouts,
    StreamRolloutWorker,
    placeholder_prompts,
    published_version,
    reward_turnstile,
)
from schemas import PolicyVersionPublished
from tests.conftest import Servers
from tests.integration.test_trainer import batches_on_the_stream, relay_batches, rows
from tests.support.attention import varlen_attention

pytestmark = pytest.mark.trl
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")


async def batch_files(servers: Servers, policy: str, count: int) -> list[TrainingBatch]:
    """The batches on ``batches.<policy>`` as the relay published them, read with a consumer of their own."""
    connection = await nats.connect(servers.nats_url)
    try:
        subscription = await connection.jetstream().pull_subscribe(
            batch_subject(policy), stream=BATCHES_STREAM
        )
        batches: list[TrainingBatch] = []
        while len(batches) < count:
            for message in await subscription.fetch(count - len(batches), timeout=10):
                batches.append(await fetch_training_batch(connection, message))
                await message.ack()
        return batches
    finally:
        await connection.drain()


async def consumer_state(servers: Servers, durable: str) -> tuple[int, int]:
    """(messages acked, messages delivered and waiting for an ack) of the durable consumer ``durable``."""
    connection = await nats.connect(servers.nats_url)
    try:
        info = await connection.jetstream().consumer_info(BATCHES_STREAM, durable)
        return info.ack_floor.consumer_seq, info.num_ack_pending
    finally:
        await connection.drain()


def parameters(model_dir: Path) -> dict[str, torch.Tensor]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return {name: p.detach().clone() for name, p in model.named_parameters()}


async def test_grpo_trainer_trains_on_the_stream_publishes_versions_and_acks(
    servers: Servers, store: EventStore, database_url: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    from trl import GRPOConfig, GRPOTrainer

    policy, made = await batches_on_the_stream(servers, store, database_url, groups=4, batch_samples=8)
    files = await batch_files(servers, policy, made)
    stream_samples = [s for batch in files for s in batch.samples]
    durable = f"grpo{uuid.uuid4().hex[:8]}"
    before = parameters(tiny_model_dir)
    handed: list[str] = []

    def train() -> StreamRollouts:
        with StreamFeed(servers.nats_url, database_url, policy=policy, durable=durable, ack_wait=5) as feed:
            rollouts = StreamRollouts(feed, model=tiny_model_dir, checkpoints=tmp_path / "ck", wait=30)

            def recording(prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
                output = rollouts(prompts, trainer)
                handed.extend(output["turnstile_sample_id"])
                return output

            config = GRPOConfig(
                output_dir=str(tmp_path / "out"), max_steps=3, per_device_train_batch_size=4,
                num_generations=4, learning_rate=1e-2, use_cpu=True, report_to=[], save_strategy="no",
                logging_steps=1, max_completion_length=64, seed=0,
            )  # fmt: skip
            trainer = GRPOTrainer(
                model=str(rollouts.start_weights),
                reward_funcs=reward_turnstile,
                args=config,
                train_dataset=placeholder_prompts(64),
                processing_class=AutoTokenizer.from_pretrained(rollouts.start_weights),
                rollout_func=recording,
                callbacks=[rollouts.callback()],
            )
            trainer.train()
            return rollouts

    rollouts = await asyncio.to_thread(train)

    # the trainer trained the stream's samples, in stream order, and its weights moved
    assert handed == [s.sample_id for s in stream_samples[: len(handed)]]
    assert len(handed) == 12  # 3 steps of 4 completions
    newest = await published_version(store, policy)
    assert isinstance(newest, PolicyVersionPublished)
    assert newest.version == rollouts.published == 3
    after = parameters(Path(newest.checkpoint))
    assert any(not torch.equal(before[name], after[name]) for name in before)
    # batches whose samples were all trained are recorded into a version and acked; the rest are not
    trained = dict(
        rows(database_url, "SELECT batch_id, policy_version FROM trained_batches WHERE trainer = %s", durable)
    )
    whole = []
    seen = 0
    for batch in files:
        seen += len(batch.samples)
        if seen <= len(handed):
            whole.append(batch.batch_id)
    assert whole
    assert sorted(trained) == sorted(whole)
    consumed = {
        event.version: set(event.batches_consumed)
        for event in [r.event for r in await store.read_stream(f"policy-{policy}")]
        if isinstance(event, PolicyVersionPublished)
    }
    assert {b for batch_ids in consumed.values() for b in batch_ids} == set(whole)
    assert all(batch_id in consumed[version] for batch_id, version in trained.items())
    acked, _ = await consumer_state(servers, durable)
    assert acked >= len(whole)


TAKER = """
import json, sys, threading
from collections import defaultdict
from pathlib import Path
from accelerate import PartialState
from trl.experimental.async_grpo.async_grpo_trainer import RolloutQueueDataset
from pipeline.training import StreamRolloutWorker

PartialState()

nats_url, database_url, policy, durable, model, checkpoints, count = sys.argv[1:]
worker = StreamRolloutWorker(nats_url, database_url, policy=policy, durable=durable, model=Path(model),
                             checkpoints=Path(checkpoints), max_staleness=1, ack_wait=3.0)
worker.start()
queued = RolloutQueueDataset(worker.rollout_buffer, lambda: 0, worker.check_health, 60, defaultdict(list),
                             max_staleness=1, poll_interval_s=0.5)
samples = iter(queued)
for _ in range(int(count)):
    print(json.dumps([int(t) for t in next(samples)["input_ids"]]), flush=True)
threading.Event().wait()  # held here, samples taken and untrained, until killed
"""
"""A trainer process that takes ``count`` samples off a worker's queue (trl's own dataset) and waits."""


def row(sample: dict[str, Any]) -> tuple[Any, ...]:
    """A queued sample's token arrays and advantage, comparable with a batch file's sample."""
    return (
        tuple(int(t) for t in sample["input_ids"]),
        tuple(int(m) for m in sample["completion_mask"]),
        tuple(round(float(p), 4) for p in sample["old_log_probs"]),
        round(float(sample["advantage"]), 6),
    )


def rollout_dataset(worker: StreamRolloutWorker, version: list[int], max_staleness: int) -> Iterator[Any]:
    """trl's own queue dataset over the worker's buffer, as AsyncGRPOTrainer builds it (in a process where
    accelerate's state is made, as the trainer makes it: the dataset logs through accelerate)."""
    from accelerate import PartialState
    from trl.experimental.async_grpo.async_grpo_trainer import RolloutQueueDataset

    PartialState()

    dataset = RolloutQueueDataset(
        rollout_queue=worker.rollout_buffer, model_version_fn=lambda: version[0],
        check_health_fn=worker.check_health, stale_after_s=60, metrics=defaultdict(list),
        max_staleness=max_staleness, poll_interval_s=0.5,
    )  # fmt: skip
    return iter(dataset)


async def test_async_grpo_worker_queues_the_stream_and_acks_only_after_publication(
    servers: Servers, store: EventStore, database_url: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    # Three batches reach the stream first; the others come once four versions are out, too old for
    # max_staleness 1 then.
    policy, made = await batches_on_the_stream(
        servers, store, database_url, groups=6, batch_samples=4, relay_first=3
    )
    assert made >= 5
    files = await batch_files(servers, policy, 3)
    durable = f"async{uuid.uuid4().hex[:8]}"
    options: dict[str, Any] = dict(
        policy=policy, durable=durable, model=tiny_model_dir, checkpoints=tmp_path / "ck", max_staleness=1,
        ack_wait=3.0,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)

    # A trainer process takes the first batch's samples and is killed (-9) before any version: nothing may
    # be acked, and the batches come again.
    taker = subprocess.Popen(  # noqa: ASYNC220 (read and waited for in threads below)
        [sys.executable, "-c", TAKER, servers.nats_url, database_url, policy, durable, str(tiny_model_dir),
         str(tmp_path / "ck"), str(len(files[0].samples))],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "TRL_EXPERIMENTAL_SILENCE": "1"},
    )  # fmt: skip

    def read_taken() -> list[list[int]]:
        assert taker.stdout is not None
        return [json.loads(taker.stdout.readline()) for _ in files[0].samples]

    try:
        lines = await asyncio.to_thread(read_taken)
        assert (await consumer_state(servers, durable))[1] >= 1  # delivered, waiting for an ack
    finally:
        taker.kill()
        await asyncio.to_thread(taker.wait)
    assert lines == [list(s.input_ids) for s in files[0].samples]
    assert rows(database_url, "SELECT count(*) FROM trained_batches WHERE trainer = %s", durable)[0][0] == 0
    assert (await consumer_state(servers, durable))[0] == 0  # nothing acked: it comes again

    def second_run() -> tuple[list[dict[str, Any]], list[list[str]]]:
        worker = StreamRolloutWorker(servers.nats_url, database_url, **options)
        transfer = worker.weight_transfer()
        version = [0]
        acked_after: list[list[str]] = []
        trained_query = "SELECT batch_id FROM trained_batches WHERE trainer = %s AND outcome = 'trained'"
        try:
            # as AsyncGRPOTrainer begins: transfer set up, a cold sync (version 1), then the worker started
            transfer.init_weight_transfer()
            transfer.send_weights(iter(model.named_parameters()))
            version[0] = 1
            worker.update_model_version(1)
            worker.start()
            samples = rollout_dataset(worker, version, 1)
            got = [next(samples) for batch in files for _ in batch.samples]
            for sync in (2, 3, 4):
                with torch.no_grad():
                    next(model.parameters()).add_(0.5)  # a "step": the weights sent differ from the last
                transfer.pause()
                transfer.send_weights(iter(model.named_parameters()))
                transfer.resume()
                version[0] = sync
                worker.update_model_version(sync)
                acked_after.append(sorted(r[0] for r in rows(database_url, trained_query, durable)))
            return got, acked_after
        finally:
            worker.stop()

    got, acked_after = await asyncio.to_thread(second_run)
    # token for token the batch files, the first batch delivered again
    # (redelivered after ack_wait, the first run's batches may come in another order than the stream's)
    expected = [s for batch in files for s in batch.samples]
    assert sorted(row(s) for s in got) == sorted(
        (
            tuple(s.input_ids),
            tuple(s.loss_mask),
            tuple(round(p, 4) for p in s.logprobs),
            round(s.advantage, 6),
        )
        for s in expected
    )
    groups = [s["group_id"] for s in got]
    assert len(set(groups)) == len({s.group_id for s in expected})
    # acked only at the third sync after the samples were taken, into the version published then
    batch_ids = sorted(b.batch_id for b in files)
    assert acked_after == [[], [], batch_ids]
    recorded = rows(
        database_url, "SELECT DISTINCT policy_version FROM trained_batches WHERE trainer = %s", durable
    )
    assert recorded == [(4,)]
    newest = await published_version(store, policy)
    assert isinstance(newest, PolicyVersionPublished)
    assert newest.version == 4
    assert sorted(newest.batches_consumed) == batch_ids
    # the newest three versions are kept (keep_checkpoints), each written over the one before
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["v000002", "v000003", "v000004"]
    loaded = parameters(Path(newest.checkpoint))
    assert all(torch.equal(loaded[name], p.detach()) for name, p in model.named_parameters())

    # the other batches arrive four versions after their samples' version 0: skipped as stale, never queued
    late = await relay_batches(servers, database_url)
    assert late == made - 3

    def third_run() -> StreamRolloutWorker:
        worker = StreamRolloutWorker(servers.nats_url, database_url, **options)
        try:
            assert worker.start_version == 4
            worker.start()
            start = time.monotonic()
            while worker.stale < late:
                assert time.monotonic() - start < 60, "the late batches were not skipped"
                time.sleep(0.05)
            assert worker.rollout_buffer.qsize() == 0
            assert worker.queued == 0
            return worker
        finally:
            worker.stop()

    await asyncio.to_thread(third_run)
    query = "SELECT outcome, count(*) FROM trained_batches WHERE trainer = %s GROUP BY outcome"
    outcomes = dict(rows(database_url, query, durable))
    assert outcomes == {"trained": 3, "stale": late}


async def test_the_grpo_example_trains_and_a_second_run_goes_on_from_its_version(
    servers: Servers, store: EventStore, database_url: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    policy, made = await batches_on_the_stream(servers, store, database_url, groups=6, batch_samples=4)
    durable = f"ex{uuid.uuid4().hex[:8]}"
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("TURNSTILE_")},
        "TURNSTILE_NATS_URL": servers.nats_url,
        "TURNSTILE_DATABASE_URL": database_url,
        "TRL_EXPERIMENTAL_SILENCE": "1",
    }
    argv = [
        sys.executable, str(EXAMPLES / "train_with_trl_grpo.py"), "--policy", policy, "--durable", durable,
        "--model", str(tiny_model_dir), "--checkpoints", str(tmp_path / "ck"), "--steps", "2",
    ]  # fmt: skip

    def run() -> subprocess.CompletedProcess[str]:
        return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)

    first = await asyncio.to_thread(run)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "published up to version 2;" in first.stdout
    trained = rows(database_url, "SELECT count(*) FROM trained_batches WHERE trainer = %s", durable)[0][0]
    assert 0 < trained < made
    # the second run starts from version 2's checkpoint and numbers on from there
    second = await asyncio.to_thread(run)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "published up to version 4;" in second.stdout
    newest = await published_version(store, policy)
    assert isinstance(newest, PolicyVersionPublished)
    assert newest.version == 4
    assert newest.checkpoint == str((tmp_path / "ck" / "v000004").absolute())


async def test_async_grpo_trainer_trains_on_the_stream_on_cpu(
    servers: Servers,
    store: EventStore,
    database_url: str,
    tiny_model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """AsyncGRPOTrainer itself, with its FlashAttention kernel (CUDA, from the Hub) replaced by
    ``varlen_attention``: the worker's samples trained, versions published, batches acked."""
    import types

    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer, async_grpo_trainer, packing

    # the two CUDA-only calls: the attention kernel, and the GPU's peak FLOP/s (for its MFU metric only)
    monkeypatch.setattr(async_grpo_trainer, "get_peak_flops_per_device", lambda *_: 1e12)

    monkeypatch.setattr(
        packing, "_flash_attn", lambda: types.SimpleNamespace(flash_attn_varlen_func=varlen_attention)
    )
    policy, _ = await batches_on_the_stream(servers, store, database_url, groups=6, batch_samples=4)
    durable = f"agrpo{uuid.uuid4().hex[:8]}"
    before = parameters(tiny_model_dir)

    def train() -> StreamRolloutWorker:
        worker = StreamRolloutWorker(
            servers.nats_url, database_url, policy=policy, durable=durable, model=tiny_model_dir,
            checkpoints=tmp_path / "ck", max_staleness=8,
        )  # fmt: skip
        try:
            config = AsyncGRPOConfig(
                output_dir=str(tmp_path / "out"), max_steps=5, per_device_train_batch_size=4, token_budget=0,
                learning_rate=1e-2, weight_sync_steps=1, max_staleness=8, report_to=[], save_strategy="no",
                logging_steps=1, use_cpu=True, dtype="float32", bf16=False,
            )  # fmt: skip
            AsyncGRPOTrainer(
                model=str(worker.start_weights), reward_funcs=reward_turnstile, args=config,
                train_dataset=placeholder_prompts(32),
                processing_class=AutoTokenizer.from_pretrained(worker.start_weights, padding_side="left"),
                rollout_worker=worker, weight_transfer=worker.weight_transfer(),
            ).train()  # fmt: skip
            return worker
        finally:
            worker.stop()

    worker = await asyncio.to_thread(train)
    assert worker.published == 6  # the cold sync at train begin, then one a step
    newest = await published_version(store, policy)
    assert isinstance(newest, PolicyVersionPublished)
    assert newest.version == 6
    after = parameters(Path(newest.checkpoint))
    assert any(not torch.equal(before[name], after[name]) for name in before)
    trained = rows(
        database_url, "SELECT batch_id, policy_version FROM trained_batches WHERE trainer = %s", durable
    )
    assert trained  # the batches whose samples were taken 3 syncs before a version are in it, and acked
    consumed = {
        b
        for r in await store.read_stream(f"policy-{policy}")
        if isinstance(r.event, PolicyVersionPublished)
        for b in r.event.batches_consumed
    }
    assert {batch_id for batch_id, _ in trained} == consumed
    assert (await consumer_state(servers, durable))[0] >= len(trained)


def test_varlen_attention_is_causal_attention_per_segment() -> None:
    """The stand-in kernel against torch's own: a segment of as many queries as keys is causal attention;
    one of fewer queries is the last rows of it (the tree's new tokens over their whole path)."""
    torch.manual_seed(0)
    q, k, v = torch.randn(9, 4, 8), torch.randn(9, 2, 8), torch.randn(9, 2, 8)
    heads = [x.repeat_interleave(2, 1).transpose(0, 1) for x in (k, v)]
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), *heads, is_causal=True
    ).transpose(0, 1)
    whole = varlen_attention(q, k, v, torch.tensor([0, 9]), torch.tensor([0, 9]), 9, 9)
    assert torch.allclose(whole, expected, atol=1e-5)
    # two segments: queries 0-8 over keys 0-8, then the last 3 queries again over the same 9 keys
    tail = varlen_attention(
        torch.cat([q, q[6:]]), torch.cat([k, k]), torch.cat([v, v]), torch.tensor([0, 9, 12]),
        torch.tensor([0, 9, 18]), 9, 9,
    )  # fmt: skip
    assert torch.allclose(tail[9:], expected[6:], atol=1e-5)
