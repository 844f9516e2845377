"""The trainer on the batch stream: tensors, versions that inference consumers load, exactly-once training
across a kill -9 mid-batch."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import nats
import psycopg
import pytest
from mlflow.tracking import MlflowClient
from sqlalchemy.ext.asyncio import create_async_engine

from consumers.inference import InferenceConfig
from consumers.trainer import TrainerConfig, serve_trainer
from pipeline.batches.format import BatchSample, TrainingBatch, encode_batch
from pipeline.batches.relay import BATCHES_STREAM, OutboxRelay, batch_subject, ensure_batches_stream
from pipeline.errors import TurnstileError
from pipeline.log import EventStore
from pipeline.materialize.config import MaterializerConfig
from pipeline.materialize.writer import Materializer
from pipeline.settings import libpq_url, sqlalchemy_url
from pipeline.training import (
    BatchSubscription,
    LearnerOptions,
    checkpoint_dir,
    publish_policy_version,
    published_version,
    to_tensors,
)
from pipeline.training.tracking import local_store
from schemas import PolicyVersionPublished
from tests.conftest import Servers
from tests.integration.test_materializer import random_log
from tests.support.processes import running
from tests.support.serving import serving
from tests.support.waiting import wait_until

TURNSTILE = [sys.executable, "-m", "consumers.cli"]
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_with_pytorch.py"


def rows(database_url: str, query: str, *params: Any) -> list[tuple[Any, ...]]:
    with psycopg.connect(libpq_url(database_url)) as connection:
        return connection.execute(query, params).fetchall()  # type: ignore[arg-type]


def test_batches_become_right_padded_tensors_aligned_with_their_masks() -> None:
    def sample(n: int, ids: tuple[int, ...], mask: tuple[int, ...]) -> BatchSample:
        logprobs = tuple(-0.5 if m else 0.0 for m in mask)
        return BatchSample(f"s{n}", "e", "g", ("t",), 3, 1.0, 0.5 * n, False, ids, mask, logprobs)

    batch = TrainingBatch("b", "p", "h", 3, (sample(1, (5, 6, 7), (0, 1, 1)), sample(2, (8, 9), (0, 1))))
    tensors = to_tensors(batch, pad_id=0)
    assert tensors.input_ids.tolist() == [[5, 6, 7], [8, 9, 0]]
    assert tensors.attention_mask.tolist() == [[1, 1, 1], [1, 1, 0]]
    assert tensors.loss_mask.tolist() == [[0.0, 1.0, 1.0], [0.0, 1.0, 0.0]]
    assert tensors.logprobs.tolist() == [[0.0, -0.5, -0.5], [0.0, -0.5, 0.0]]
    assert tensors.advantages.tolist() == [0.5, 1.0]
    assert tensors.sample_ids == ["s1", "s2"]


async def batches_on_the_stream(
    servers: Servers,
    store: EventStore,
    database_url: str,
    *,
    groups: int,
    batch_samples: int,
    relay_first: int | None = None,
) -> tuple[str, int]:
    """Record a log under a policy of its own (tests share the NATS server), materialize it and relay its
    batches (only the first ``relay_first`` of them when given): (policy, batches made)."""
    policy = f"p{uuid.uuid4().hex[:10]}"
    await random_log(store, groups=groups, policy=policy)
    materializer = Materializer(database_url, MaterializerConfig(batch_samples=batch_samples))
    await materializer.open()
    await materializer.catch_up()
    await materializer.close()
    if relay_first is None:
        await relay_batches(servers, database_url)
    else:
        await relay_batches(servers, database_url, at_most=relay_first)
    return policy, int(rows(database_url, "SELECT count(*) FROM batch_outbox")[0][0])


async def relay_batches(servers: Servers, database_url: str, *, at_most: int | None = None) -> int:
    """Publish the pending batches (at most ``at_most`` of them): the number published."""
    engine = create_async_engine(sqlalchemy_url(database_url))
    connection = await nats.connect(servers.nats_url)
    try:
        if at_most is None:
            return await OutboxRelay(engine, connection).publish_pending()
        return await OutboxRelay(engine, connection, batch_limit=at_most).publish_next()
    finally:
        await connection.drain()
        await engine.dispose()


async def test_trainer_trains_every_batch_publishes_versions_and_inference_loads_them(
    servers: Servers,
    store: EventStore,
    database_url: str,
    tiny_model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    policy, published = await batches_on_the_stream(servers, store, database_url, groups=4, batch_samples=6)
    assert published >= 3
    # The promised order: a batch is recorded as trained into version v only once v's checkpoint is whole
    # on disk (a crash in between must leave the batch untrained, to be delivered again).
    on_disk_when_recorded: list[bool] = []
    record = BatchSubscription.commit

    async def commit(self: BatchSubscription, batches: Any, version: int, **options: Any) -> None:
        if options.get("outcome", "trained") == "trained":
            directory = checkpoint_dir(tmp_path / "checkpoints", version)
            whole = (directory / "model.safetensors").is_file() and (directory / "optimizer.pt").is_file()
            on_disk_when_recorded.append(whole)
        await record(self, batches, version, **options)

    monkeypatch.setattr(BatchSubscription, "commit", commit)

    config = TrainerConfig(
        database_url=database_url, nats_url=servers.nats_url, policy=policy, model=tiny_model_dir,
        checkpoints=tmp_path / "checkpoints", durable=f"t{uuid.uuid4().hex[:8]}", version_every=1,
        keep_checkpoints=2, log_steps=tmp_path / "steps.jsonl", track="mlflow", track_dir=tmp_path / "mlflow",
        learner=LearnerOptions(micro_batch_tokens=64, kl_coef=0.01), merge_waiting=1,
    )  # fmt: skip
    inference = InferenceConfig(
        servers.nats_url, policy, backend="torch", model=tiny_model_dir, database_url=database_url
    )
    async with serving(inference) as service:
        stop = asyncio.Event()
        training = asyncio.create_task(serve_trainer(config, stop=stop))
        deadline = asyncio.get_running_loop().time() + 120
        while rows(database_url, "SELECT count(*) FROM trained_batches")[0][0] < published:
            assert asyncio.get_running_loop().time() < deadline, "the trainer did not train every batch"
            assert not training.done(), training.exception()
            await asyncio.sleep(0.1)
        while service.backend.policy_version < published:  # the consumer loads each version it hears of
            assert asyncio.get_running_loop().time() < deadline, "the consumer did not load the last version"
            await asyncio.sleep(0.1)
        stop.set()
        stats = await training

    assert stats.version == published
    assert stats.trained == published
    assert on_disk_when_recorded == [True] * published
    newest = await published_version(store, policy)
    assert isinstance(newest, PolicyVersionPublished)
    assert newest.version == published
    assert len(newest.batches_consumed) == 1  # version_every=1: one batch per version
    assert Path(newest.checkpoint, "model.safetensors").is_file()  # noqa: ASYNC240
    # every trained batch leads back to its samples, turns and episodes
    traced = rows(
        database_url,
        "SELECT count(DISTINCT t.batch_id), count(DISTINCT s.sample_id), count(DISTINCT e.episode_id) "
        "FROM trained_batches t JOIN batches b USING (batch_id) JOIN samples s ON s.batch_id = b.batch_id "
        "JOIN turns u ON u.turn_id = ANY (s.turn_ids) JOIN episodes e ON e.episode_id = s.episode_id",
    )[0]
    assert traced[0] == published
    assert traced[1] == rows(database_url, "SELECT count(*) FROM samples WHERE batch_id IS NOT NULL")[0][0]
    # --keep-checkpoints 2: only the newest two version directories stay
    kept = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert kept == [f"v{v:06d}" for v in (published - 1, published)]
    # --log-steps: the on_step hook heard of every step, with the loss the trainer recorded
    steps = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    assert [step["step"] for step in steps] == list(range(1, published + 1))
    assert [step["policy_version"] for step in steps] == list(range(published))
    recorded = dict(rows(database_url, "SELECT batch_id, loss FROM trained_batches"))
    assert {step["batch_id"]: step["loss"] for step in steps} == pytest.approx(recorded)
    assert all(step["samples"] > 0 and step["tokens"] > 0 for step in steps)
    assert all(step["kl"] >= 0 and 0 <= step["clip_fraction"] <= 1 for step in steps)
    assert all(step["reference_kl"] >= 0 for step in steps)
    assert steps[-1]["reference_kl"] > 0  # --kl-coef: the weights moved away from the starting ones
    # --track mlflow: the same losses, step by step, in the local store
    client = MlflowClient(tracking_uri=local_store(tmp_path / "mlflow"))
    (run,) = client.search_runs([client.get_experiment_by_name("turnstile").experiment_id])
    assert run.info.run_name == config.durable
    assert run.data.params["micro_batch_tokens"] == "64"
    logged = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "loss")}
    assert logged == pytest.approx({step["step"]: step["loss"] for step in steps})


async def test_a_trainer_stopped_while_it_publishes_a_version_publishes_it_before_it_stops(
    servers: Servers,
    store: EventStore,
    database_url: str,
    tiny_model_dir: Path,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Another connection holds the append lock, so once the trainer has recorded its batch as trained into
    version 1, the version itself waits to be recorded; the trainer is told to stop then. It finishes that
    publication before it stops (its figures say version 1, the policy log has it), rather than leaving it to
    its next start."""
    caplog.set_level(logging.INFO, logger="pipeline.training")
    policy, _ = await batches_on_the_stream(
        servers, store, database_url, groups=2, batch_samples=4, relay_first=1
    )
    durable = f"t{uuid.uuid4().hex[:8]}"
    config = TrainerConfig(
        database_url=database_url, nats_url=servers.nats_url, policy=policy, model=tiny_model_dir,
        checkpoints=tmp_path / "checkpoints", durable=durable, version_every=1, merge_waiting=1,
    )  # fmt: skip
    stop = asyncio.Event()
    async with store.transaction():  # the append lock, until the stop is under way
        training = asyncio.create_task(serve_trainer(config, stop=stop))
        query = "SELECT count(*) FROM trained_batches WHERE trainer = %s AND policy_version = 1"
        await wait_until(lambda: rows(database_url, query, durable)[0][0] == 1, 120, "the batch recorded")
        assert await published_version(store, policy) is None  # its publication waits for the lock
        stop.set()
        await wait_until(  # the stop under way: the trainer has ended, or it waits for the publication
            lambda: training.done() or "stopping: finishing version 1 first" in caplog.text, 60, "the stop"
        )
    stats = await training
    assert stats.version == 1
    newest = await published_version(store, policy)
    assert newest is not None
    assert newest.version == 1
    assert len(newest.batches_consumed) == 1


async def test_a_trainer_behind_takes_the_waiting_batches_into_one_step_each_once(
    servers: Servers, store: EventStore, database_url: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Every batch on the stream before the trainer starts: it is behind from the first step, so it takes up
    to --merge-waiting of them per step (one update, one version); each batch is still trained exactly once
    and recorded into the version that holds its update."""
    policy, published = await batches_on_the_stream(servers, store, database_url, groups=6, batch_samples=4)
    assert published >= 6
    config = TrainerConfig(
        database_url=database_url, nats_url=servers.nats_url, policy=policy, model=tiny_model_dir,
        checkpoints=tmp_path / "checkpoints", durable=f"t{uuid.uuid4().hex[:8]}", merge_waiting=3,
        log_steps=tmp_path / "steps.jsonl",
    )  # fmt: skip
    stop = asyncio.Event()
    training = asyncio.create_task(serve_trainer(config, stop=stop))
    try:
        await wait_until(
            lambda: rows(database_url, "SELECT count(*) FROM trained_batches")[0][0] == published,
            120,
            "the trainer training every batch",
        )
    finally:
        stop.set()
        stats = await training
    recorded = rows(database_url, "SELECT batch_id, policy_version, loss FROM trained_batches")
    assert len({batch for batch, _, _ in recorded}) == published  # each once
    per_version: dict[int, list[float]] = {}
    for _, version, loss in recorded:
        per_version.setdefault(version, []).append(loss)
    assert sorted(per_version) == list(range(1, stats.version + 1))  # versions 1, 2, ... without a gap
    assert all(1 <= len(losses) <= 3 for losses in per_version.values())
    assert all(len(set(losses)) == 1 for losses in per_version.values())  # one step: one loss per version
    assert stats.version < published, "no step took more than one batch although all were waiting"
    newest = await published_version(store, policy)
    assert newest is not None
    assert len(newest.batches_consumed) == len(per_version[stats.version])


async def test_a_trainer_killed_mid_batch_trains_each_batch_once(
    servers: Servers, store: EventStore, database_url: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    # Four batches reach the stream first: the trainer makes version 1 of the first three and then holds the
    # fourth, trained but not yet recorded (a version takes three). It is killed there, whatever the
    # machine's speed; the other batches are published while it is down.
    policy, made = await batches_on_the_stream(
        servers, store, database_url, groups=6, batch_samples=4, relay_first=4
    )
    assert made >= 6
    durable = f"t{uuid.uuid4().hex[:8]}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TURNSTILE_")}
    env.update(TURNSTILE_DATABASE_URL=database_url, TURNSTILE_NATS_URL=servers.nats_url)
    command = [
        *TURNSTILE, "serve", "trainer", "--policy", policy, "--model", str(tiny_model_dir), "--durable",
        durable, "--checkpoints", str(tmp_path / "checkpoints"), "--version-every", "3", "--ack-wait", "2",
        "--merge-waiting", "1",
    ]  # fmt: skip

    def trained() -> int:
        return int(rows(database_url, "SELECT count(*) FROM trained_batches")[0][0])

    connection = await nats.connect(servers.nats_url)
    js = connection.jetstream()

    async def holding_the_fourth() -> bool:
        with contextlib.suppress(nats.js.errors.NotFoundError):
            info = await js.consumer_info(BATCHES_STREAM, durable)
            return trained() == 3 and info.num_pending == 0 and info.num_ack_pending == 1
        return False

    async with running(*command, env=env, stderr=asyncio.subprocess.DEVNULL) as first:
        await wait_until(holding_the_fourth, 120, "the trainer holding batch 4 after version 1")
        first.send_signal(signal.SIGKILL)
        await first.wait()
    assert trained() == 3  # version 1 only: the fourth batch was never recorded
    assert await relay_batches(servers, database_url) == made - 4
    await connection.drain()

    target = made - made % 3  # whole versions only: the rest waits for more batches
    async with running(*command, env=env, stderr=asyncio.subprocess.PIPE) as second:
        await wait_until(lambda: trained() >= target, 120, "the restarted trainer to catch up")
        second.send_signal(signal.SIGTERM)
        _, log = await asyncio.wait_for(second.communicate(), 60)
        assert second.returncode == 0, log.decode()
    assert trained() == target  # nothing more after the last whole version

    recorded = rows(
        database_url, "SELECT batch_id, policy_version FROM trained_batches ORDER BY policy_version"
    )
    assert len(recorded) == target
    assert len({batch for batch, _ in recorded}) == target  # each batch once
    assert [version for _, version in recorded] == [v for v in range(1, target // 3 + 1) for _ in range(3)]
    versions = rows(
        database_url,
        "SELECT (data->>'version')::int FROM events WHERE stream = %s ORDER BY position",
        f"policy-{policy}",
    )
    assert sorted({v for (v,) in versions}) == list(range(1, target // 3 + 1))


async def test_a_trainer_that_dies_before_its_checkpoint_is_on_disk_has_acked_nothing_and_loses_nothing(
    servers: Servers, store: EventStore, database_url: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The README's order (checkpoint on disk, then the batches recorded, then acked): a trainer that dies
    writing its first checkpoint (here: a file where the checkpoint's partial directory goes, so the save
    fails after the learner step) has acked no batch, and a restarted trainer trains every one of them."""
    policy, made = await batches_on_the_stream(servers, store, database_url, groups=4, batch_samples=6)
    assert made >= 2
    durable = f"t{uuid.uuid4().hex[:8]}"
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    blocker = checkpoint_dir(checkpoints, 1).with_name("v000001.partial")
    blocker.write_text("not a directory: the save of version 1 fails here")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TURNSTILE_")}
    env.update(TURNSTILE_DATABASE_URL=database_url, TURNSTILE_NATS_URL=servers.nats_url)
    command = [
        *TURNSTILE, "serve", "trainer", "--policy", policy, "--model", str(tiny_model_dir), "--durable",
        durable, "--checkpoints", str(checkpoints), "--version-every", "1", "--ack-wait", "2",
    ]  # fmt: skip

    def trained() -> int:
        return int(rows(database_url, "SELECT count(*) FROM trained_batches")[0][0])

    async with running(*command, env=env, stderr=asyncio.subprocess.PIPE) as first:
        _, log = await asyncio.wait_for(first.communicate(), 180)
    assert first.returncode not in (0, None), log.decode()[-2000:]
    assert trained() == 0
    connection = await nats.connect(servers.nats_url)
    try:
        info = await connection.jetstream().consumer_info(BATCHES_STREAM, durable)
    finally:
        await connection.drain()
    assert info.delivered.consumer_seq >= 1  # it had taken a batch and trained on it ...
    assert info.ack_floor.consumer_seq == 0  # ... and acked none: each comes again

    blocker.unlink()
    async with running(*command, env=env, stderr=asyncio.subprocess.PIPE) as second:
        await wait_until(lambda: trained() >= made, 120, "the restarted trainer to train every batch")
        second.send_signal(signal.SIGTERM)
        _, log = await asyncio.wait_for(second.communicate(), 60)
        assert second.returncode == 0, log.decode()[-2000:]
    recorded = rows(
        database_url, "SELECT batch_id, policy_version FROM trained_batches ORDER BY policy_version"
    )
    assert len({batch for batch, _ in recorded}) == len(recorded) == made  # each batch once, none lost
    assert [version for _, version in recorded] == list(range(1, made + 1))


@pytest.mark.parametrize("bad", [["--version-every", "0"], ["--model", "/nonexistent"]])
def test_serve_trainer_refuses_bad_options(bad: list[str], servers: Servers, database_url: str) -> None:
    import subprocess

    env = {k: v for k, v in os.environ.items() if not k.startswith("TURNSTILE_")}
    env.update(TURNSTILE_DATABASE_URL=database_url, TURNSTILE_NATS_URL=servers.nats_url)
    options = {"--model": "/nonexistent", "--version-every": "1"}
    options.update(dict(zip(bad[::2], bad[1::2], strict=True)))
    done = subprocess.run(
        [*TURNSTILE, "serve", "trainer", "--policy", "x", "--checkpoints", "/tmp/x",
         *[part for item in options.items() for part in item]],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2
    assert ("--version-every" if bad[0] == "--version-every" else "not a model directory") in done.stderr


async def test_the_bookkeeping_is_per_trainer_skips_what_it_recorded_and_keeps_losses(
    servers: Servers, store: EventStore, database_url: str
) -> None:
    policy = f"p{uuid.uuid4().hex[:10]}"
    connection = await nats.connect(servers.nats_url)
    await ensure_batches_stream(connection)
    js = connection.jetstream()

    def batch(batch_id: str) -> bytes:
        sample = BatchSample("s", "e", "g", ("t",), 0, 1.0, 0.5, False, (5, 6), (0, 1), (0.0, -0.5))
        return encode_batch(TrainingBatch(batch_id, policy, "h", 0, (sample,)))

    for batch_id in ("b1", "b2", "b1", "b3"):  # b1 again: a copy the relay published twice
        await js.publish(batch_subject(policy), batch(batch_id), headers={"Nats-Msg-Id": uuid.uuid4().hex})

    async def open_trainer(durable: str) -> BatchSubscription:
        return await BatchSubscription.open(
            connection, store, policy=policy, durable=durable, fetch_timeout=0.5
        )

    first, second = (
        await open_trainer(f"a{uuid.uuid4().hex[:6]}"),
        await open_trainer(f"b{uuid.uuid4().hex[:6]}"),
    )
    try:
        async with asyncio.timeout(60):
            batches = aiter(first)
            b1 = await anext(batches)
            await first.commit([b1], 1, losses=[0.25])
            b2 = await anext(batches)
            await first.commit([b2], 1, outcome="stale")
            b3 = await anext(batches)  # the second b1 is acked and skipped: it is recorded for this trainer
            assert [b1.batch_id, b2.batch_id, b3.batch_id] == ["b1", "b2", "b3"]
            assert first.duplicates == 1
            assert (await first.trained_count(), await first.trained_version()) == (
                1,
                1,
            )  # stale: not trained
            assert await first.trained_into(1) == ["b1"]
            # another trainer keeps its own books: nothing is recorded for it, so it gets b1 too
            assert (await second.trained_count(), await second.trained_version()) == (0, 0)
            assert (await anext(aiter(second))).batch_id == "b1"
    finally:
        await first.close()
        await second.close()
        await connection.drain()
    recorded = rows(database_url, "SELECT batch_id, outcome, loss FROM trained_batches ORDER BY batch_id")
    assert recorded == [("b1", "trained", 0.25), ("b2", "stale", None)]


async def test_a_version_republished_under_another_spelling_of_its_directory_stands_and_another_is_refused(
    servers: Servers, store: EventStore, tmp_path: Path
) -> None:
    policy = f"p{uuid.uuid4().hex[:10]}"
    real = tmp_path / "checkpoints" / "v000001"
    real.mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "checkpoints")
    connection = await nats.connect(servers.nats_url)
    try:
        first = await publish_policy_version(store, connection, policy, 1, str(real))
        again = await publish_policy_version(store, connection, policy, 1, str(tmp_path / "link" / "v000001"))
        assert again == first  # a restart after the crash that lost the publish: the recorded event stands
        other = tmp_path / "elsewhere" / "v000001"
        other.mkdir(parents=True)
        with pytest.raises(TurnstileError, match="version 1 is recorded with checkpoint"):
            await publish_policy_version(store, connection, policy, 1, str(other))
    finally:
        await connection.drain()
    assert len(await store.read_stream(f"policy-{policy}")) == 1


def test_step_diagnostics_are_the_k3_kl_and_the_clipped_share_over_scored_tokens() -> None:
    import math

    import torch

    from pipeline.training.ppo import diagnostics

    old = torch.zeros((1, 3))
    new = torch.tensor([[math.log(2.0), 0.0, math.log(10.0)]])  # ratios 2, 1, 10
    mask = torch.tensor([[1.0, 1.0, 0.0]])  # the third token is not scored
    found = diagnostics(new, old, mask, clip=0.2)
    # ((2 - 1) - ln 2 + (1 - 1) - 0) / 2 tokens; ratio 2 is outside [0.8, 1.2], ratio 1 is not
    assert found["kl"] == pytest.approx((1 - math.log(2.0)) / 2)
    assert found["clip_fraction"] == 0.5
    assert diagnostics(old, old, mask, clip=0.2) == {"kl": 0.0, "clip_fraction": 0.0}


async def test_a_plain_pytorch_trainer_in_another_process_trains_each_batch_once(
    servers: Servers, store: EventStore, database_url: str, tmp_path: Path
) -> None:
    policy, published = await batches_on_the_stream(servers, store, database_url, groups=4, batch_samples=6)
    assert published >= 3
    durable = f"plain{uuid.uuid4().hex[:8]}"
    script = EXAMPLE
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("TURNSTILE_")},
        "TURNSTILE_NATS_URL": servers.nats_url,
        "TURNSTILE_DATABASE_URL": database_url,
    }

    def train() -> subprocess.CompletedProcess[str]:
        argv = [sys.executable, str(script), "--policy", policy, "--durable", durable, "--idle", "10",
                "--checkpoint", str(tmp_path / "plain.pt")]  # fmt: skip
        return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)

    first = await asyncio.to_thread(train)
    assert first.returncode == 0, first.stderr[-3000:]
    assert first.stdout.count("step ") == published
    trained = rows(database_url, "SELECT batch_id, loss FROM trained_batches WHERE trainer = %s", durable)
    assert len({batch_id for batch_id, _ in trained}) == len(trained) == published
    assert all(loss is not None for _, loss in trained)
    assert (tmp_path / "plain.pt").is_file()
    # Run again: every batch was committed (recorded, then acked), so none comes back.
    second = await asyncio.to_thread(train)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "step " not in second.stdout
    assert (
        rows(database_url, "SELECT count(*) FROM trained_batches WHERE trainer = %s", durable)[0][0]
        == published
    )
