"""A run survives its servers: NATS restarted mid-run, and separately PostgreSQL restarted mid-run.

Each test owns the server it restarts (embedded, on a port of its own) and shares the other one.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import nats
import psycopg
import pytest

from consumers.inference import InferenceConfig
from consumers.materializer import rematerialize, serve_materializer
from consumers.runtime import database_outage
from pipeline.batches import BatchSample, TrainingBatch, batch_subject, encode_batch, ensure_batches_stream
from pipeline.dev.embedded import EmbeddedNats, EmbeddedPostgres
from pipeline.inference.client import NatsLLMClient
from pipeline.log import EventStore
from pipeline.log.db import migrate
from pipeline.materialize import MaterializerConfig
from pipeline.runners.runner import Runner, RunnerConfig, TaskSpec, run_tasks
from pipeline.training import BatchSubscription, publish_policy_version
from schemas import EpisodeFinished, RewardAssigned, TurnCompleted
from tests.conftest import Servers
from tests.integration.test_materializer import read_models, rows, started, turn
from tests.support.agents import SlowAgent
from tests.support.backends import RuleBackend, echo_rule
from tests.support.serving import serving

EPISODES = 40


async def run_with_a_restart(store: EventStore, nats_url: str, restart: Callable[[], None]) -> None:
    """Run EPISODES three-turn episodes; once a third of the turns are recorded, call ``restart``."""
    policy = f"p{uuid.uuid4().hex[:10]}"
    config = InferenceConfig(nats_url, policy, backend="scripted", heartbeat_interval=0.3)
    async with serving(config, RuleBackend(echo_rule, delay=0.02)):
        llm = await NatsLLMClient.connect(nats_url, heartbeat_timeout=1.0, retries=20, wait_for_consumer=60)
        try:
            runner_config = RunnerConfig(
                policy=policy, agent_name="SlowAgent", concurrency=EPISODES, retries=0
            )
            runner = Runner(SlowAgent(), store=store, llm=llm, config=runner_config)
            tasks = iter([TaskSpec(task={"id": n}, task_id=str(n)) for n in range(EPISODES)])
            work = asyncio.create_task(run_tasks(runner, tasks))
            # Restart once every episode has started and recorded its first turn: all are mid-run.
            deadline = time.monotonic() + 60
            while store.stats.events < 2 * EPISODES and time.monotonic() < deadline:  # noqa: ASYNC110
                await asyncio.sleep(0.02)
            assert not work.done()
            await asyncio.to_thread(restart)
            outcomes = await asyncio.wait_for(work, 120)
        finally:
            await llm.close()
    assert [o.termination for o in outcomes] == ["done"] * EPISODES


async def assert_every_episode_complete_once(store: EventStore) -> None:
    records = await store.read_all(0, limit=10_000)
    turns = [r for r in records if isinstance(r.event, TurnCompleted)]
    finished = [r for r in records if isinstance(r.event, EpisodeFinished)]
    assert len(finished) == EPISODES
    assert Counter(r.stream for r in turns) == Counter({r.stream: 3 for r in finished})  # 3 each, none twice
    assert len({r.event_id for r in records}) == len(records)


async def test_the_nats_server_restarted_mid_run(database_url: str, server_dir: Path) -> None:
    server = EmbeddedNats(server_dir / "nats")
    server.start()
    store = await EventStore.connect(database_url)
    try:

        def restart() -> None:
            server.stop()
            time.sleep(1.0)
            server.start()

        await run_with_a_restart(store, server.url, restart)
        await assert_every_episode_complete_once(store)
    finally:
        await store.close()
        server.stop()


async def test_postgresql_restarted_mid_run(servers: Servers, server_dir: Path) -> None:
    postgres = EmbeddedPostgres(server_dir / "pg")
    postgres.start()
    try:
        migrate(postgres.url)
        store = await EventStore.connect(postgres.url, retry_for=60)

        def restart() -> None:
            postgres.stop()
            time.sleep(1.0)
            postgres.start()

        await run_with_a_restart(store, servers.nats_url, restart)
        await assert_every_episode_complete_once(store)
        await store.close()
    finally:
        postgres.stop()


async def record_episodes(store: EventStore, tag: str, groups: int) -> None:
    """``groups`` groups of four two-turn episodes, recorded one event at a time, interleaved."""
    pending = {}
    for g in range(groups):
        for slot in range(4):
            episode_id = f"{tag}-{g}-{slot}"
            first = turn([1, g, slot, 2], [5 + slot, 2])
            pending[episode_id] = [
                started(episode_id, group=f"{tag}-{g}", size=4),
                first,
                turn([1, g, slot, 2, 5 + slot, 2, 1, 7, 2], [9, g % 50, 2]),
                RewardAssigned(value=slot / 4),
                EpisodeFinished(termination="done"),
            ]
    written = dict.fromkeys(pending, 0)
    while pending:
        for episode_id in sorted(pending):
            events = pending[episode_id]
            await store.append(f"episode-{episode_id}", [events[written[episode_id]]], written[episode_id])
            written[episode_id] += 1
            if written[episode_id] == len(events):
                del pending[episode_id]


async def caught_up(database_url: str, serving: asyncio.Task[object]) -> None:
    """Until the materializer's checkpoint is the log's head (failing at once if the service ended)."""
    deadline = time.monotonic() + 120
    while True:
        if serving.done():
            raise AssertionError(f"the materializer ended: {serving.exception()!r}")
        head, checkpoint = rows(
            database_url,
            "SELECT (SELECT max(position) FROM events), "
            "(SELECT position FROM checkpoints WHERE name = 'materializer:main')",
        )[0]
        if checkpoint is not None and checkpoint == head:
            return
        assert time.monotonic() < deadline, f"checkpoint {checkpoint}, head {head}"
        await asyncio.sleep(0.05)


async def test_the_materializer_rides_out_postgresql_restarts(
    server_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``turnstile serve materializer`` exited 1 on any PostgreSQL restart; now it waits for the server, goes
    on from its checkpoint, and ends with exactly what one uninterrupted fold of the same log gives."""
    caplog.set_level(logging.INFO, logger="consumers")
    postgres = EmbeddedPostgres(server_dir / "pg")
    postgres.start()
    stop = asyncio.Event()
    try:
        migrate(postgres.url)
        store = await EventStore.connect(postgres.url, retry_for=60)
        config = MaterializerConfig(discount=0.9, batch_samples=8, step_events=4)
        serving = asyncio.create_task(serve_materializer(postgres.url, config, stop=stop))
        try:
            for tag, restart in (("fast", postgres.stop), ("killed", postgres.kill)):
                await record_episodes(store, tag, groups=6)
                await caught_up(postgres.url, serving)

                def restart_now(down: Callable[[], None] = restart) -> None:
                    down()  # a fast shutdown, then a kill -9 (the restart recovers from the WAL)
                    postgres.start()

                await asyncio.to_thread(restart_now)
                await record_episodes(store, f"{tag}-after", groups=2)  # while it reconnects
                await caught_up(postgres.url, serving)
        finally:
            stop.set()
            await asyncio.wait_for(serving, 60)
            await store.close()
        await rematerialize(postgres.url, MaterializerConfig(name="reference", discount=0.9, batch_samples=8))
        live, reference = read_models(postgres.url, "public"), read_models(postgres.url, "rm_reference")
    finally:
        postgres.stop()
    assert len(live["turns"]) == 2 * (6 + 2) * 4 * 2
    assert len(live["batches"]) == len(live["turns"]) // 8  # a sample per turn, eight a batch
    assert live == reference  # nothing lost, nothing folded twice
    messages = [record.getMessage() for record in caplog.records]
    assert sum("PostgreSQL unreachable" in m and "starting again" in m for m in messages) == 2, messages
    assert sum("PostgreSQL is back" in m for m in messages) == 2, messages


async def test_the_trainers_bookkeeping_waits_out_a_postgresql_restart(
    servers: Servers, server_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """In CI the trainer exited 1 when PostgreSQL restarted while it looked up a batch it was given: its reads
    and writes of ``trained_batches`` had no retry, and the version's append gave up after ``retry_for``.
    Now each waits for the server, however long it is away (here longer than the store's ``retry_for``), and
    the books end as one uninterrupted run would have left them."""
    caplog.set_level(logging.INFO, logger="pipeline.training")
    policy = f"p{uuid.uuid4().hex[:10]}"
    postgres = EmbeddedPostgres(server_dir / "pg")
    postgres.start()
    connection = await nats.connect(servers.nats_url)
    try:
        migrate(postgres.url)
        store = await EventStore.connect(postgres.url, retry_for=0.5)
        await ensure_batches_stream(connection)
        for batch_id in ("b1", "b2"):
            sample = BatchSample("s", "e", "g", ("t",), 0, 1.0, 0.5, False, (5, 6), (0, 1), (0.0, -0.5))
            batch = encode_batch(TrainingBatch(batch_id, policy, "h", 0, (sample,)))
            await connection.jetstream().publish(batch_subject(policy), batch)
        batches = await BatchSubscription.open(
            connection, store, policy=policy, durable="t", fetch_timeout=0.5
        )
        try:
            delivered = aiter(batches)
            first = await asyncio.wait_for(anext(delivered), 60)
            await asyncio.to_thread(postgres.stop)
            # while it is down: the next batch's lookup, the first one's commit, the version's append
            second = asyncio.create_task(anext(delivered))
            commit = asyncio.create_task(batches.commit([first], 1, losses=[0.5]))
            published = asyncio.create_task(
                publish_policy_version(store, connection, policy, 1, str(server_dir), batches_consumed=["b1"])
            )
            waits = (
                "looking up batch b2",
                "recording 1 batches into version 1",
                "recording policy version 1",
            )
            deadline = time.monotonic() + 60
            while not all(any(f"while {w}" in r.getMessage() for r in caplog.records) for w in waits):
                assert time.monotonic() < deadline, [r.getMessage() for r in caplog.records]
                assert not any(t.done() for t in (second, commit, published))  # none gave up or went through
                await asyncio.sleep(0.05)
            await asyncio.to_thread(postgres.start)
            assert (await asyncio.wait_for(second, 60)).batch_id == "b2"
            await asyncio.wait_for(commit, 60)
            assert (await asyncio.wait_for(published, 60)).version == 1
            assert (await batches.trained_version(), await batches.trained_into(1)) == (1, ["b1"])
            await batches.commit(
                [first], 1, losses=[0.5]
            )  # the commit again (its answer lost): one row stays
        finally:
            await batches.close()
            await store.close()
        assert rows(postgres.url, "SELECT batch_id, policy_version, loss FROM trained_batches") == [
            ("b1", 1, 0.5)
        ]
        versions = rows(postgres.url, "SELECT count(*) FROM events WHERE stream = %s", f"policy-{policy}")
        assert versions == [(1,)]
    finally:
        await connection.drain()
        postgres.stop()
    assert any("PostgreSQL back after" in r.getMessage() for r in caplog.records)


def test_an_outage_is_told_from_other_errors_and_a_full_disk_is_named() -> None:
    full = psycopg.errors.DiskFull('could not extend file "base/5/16384": No space left on device')
    assert database_outage(full) == (
        'PostgreSQL\'s disk is full (could not extend file "base/5/16384": No space left on device): free '
        "space on the disk of its data directory"
    )
    assert database_outage(psycopg.errors.AdminShutdown("terminating connection")) == (
        "PostgreSQL unreachable (terminating connection)"
    )
    assert database_outage(psycopg.errors.InsufficientPrivilege("permission denied")) is None
    assert database_outage(ValueError("a bug")) is None
