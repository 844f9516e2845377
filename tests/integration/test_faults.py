"""A run survives its servers: NATS restarted mid-run, and separately PostgreSQL restarted mid-run.

Each test owns the server it restarts (embedded, on a port of its own) and shares the other one.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from consumers.inference import InferenceConfig
from pipeline.dev.embedded import EmbeddedNats, EmbeddedPostgres
from pipeline.inference.client import NatsLLMClient
from pipeline.log import EventStore
from pipeline.log.db import migrate
from pipeline.runners.runner import Runner, RunnerConfig, TaskSpec, run_tasks
from schemas import EpisodeFinished, TurnCompleted
from tests.conftest import Servers
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
