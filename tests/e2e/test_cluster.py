"""The pipeline on a 3-node NATS cluster (JetStream TASKS, HARNESS_TASKS and BATCHES replicated x3), its
services attached to different nodes; one node is killed mid-run and started again. The run completes: every
task has one episode done with its three turns recorded once, every batch is published and trained exactly
once."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import nats
import psycopg
import pytest

from pipeline.dev.embedded import EmbeddedNatsCluster
from pipeline.settings import libpq_url, nats_servers
from tests.support.waiting import wait_until

TURNSTILE = [sys.executable, "-m", "consumers.cli"]
TASKS = 24
TURNS = 3  # tests.support.agents.ThreeTurnAgent


@pytest.fixture
async def cluster(server_dir: Path) -> AsyncIterator[EmbeddedNatsCluster]:
    nodes = EmbeddedNatsCluster(server_dir / "nats", size=3)
    nodes.start()
    try:
        await nodes.replicate_streams(3)
        yield nodes
    finally:
        nodes.stop()


def rows(database_url: str, query: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(libpq_url(database_url)) as connection:
        return connection.execute(query).fetchall()


class Services:
    def __init__(self, directory: Path, database_url: str) -> None:
        self.directory, self.database_url = directory, database_url
        self.processes: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, nats_url: str, *args: str) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("TURNSTILE_")}
        env.update(TURNSTILE_DATABASE_URL=self.database_url, TURNSTILE_NATS_URL=nats_url, HF_HUB_OFFLINE="1")
        log = (self.directory / f"{name}.log").open("ab")
        self.processes[name] = subprocess.Popen(
            [*TURNSTILE, *args], env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip

    def check(self) -> None:
        for name, process in self.processes.items():
            assert process.poll() is None, f"{name} exited:\n{self.log(name)}"

    def log(self, name: str) -> str:
        return (self.directory / f"{name}.log").read_text(errors="replace")[-8000:]

    def stop(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.terminate()
        for process in self.processes.values():
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()


@pytest.fixture
def services(server_dir: Path, database_url: str) -> Iterator[Services]:
    running = Services(server_dir, database_url)
    try:
        yield running
    finally:
        running.stop()


@pytest.mark.slow
async def test_a_run_survives_a_node_of_a_three_node_nats_cluster_going_down_and_coming_back(
    cluster: EmbeddedNatsCluster,
    services: Services,
    database_url: str,
    tiny_model_dir: Path,
    server_dir: Path,
) -> None:
    n1, n2, n3 = (node.url for node in cluster.nodes)
    connection = await nats.connect(nats_servers(cluster.url))
    for stream in ("TASKS", "HARNESS_TASKS", "BATCHES"):
        info = await connection.jetstream().stream_info(stream)
        assert info.config.num_replicas == 3
    await connection.close()
    policy = "clustered"
    tasks = server_dir / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"id": f"t{n}", "reward": 1.0}) + "\n" for n in range(TASKS)))

    # Each service on a node of its own choosing (one URL: it learns the others from the cluster).
    services.start("inference", n2, "serve", "inference", "--policy", policy, "--backend", "scripted")
    services.start("materializer", n1, "serve", "materializer", "--batch-samples", "6")
    services.start("relay", n3, "serve", "relay")
    services.start(
        "trainer", n1, "serve", "trainer", "--policy", policy, "--model", str(tiny_model_dir),
        "--checkpoints", str(server_dir / "checkpoints"),
    )  # fmt: skip
    services.start(
        "runner", n1, "serve", "runner", "--agent", "tests.support.agents:ThreeTurnAgent", "--policy", policy,
        "--concurrency", "4", "--retries", "3", "--timeout", "60",
    )  # fmt: skip
    submitted = await asyncio.to_thread(
        subprocess.run, [*TURNSTILE, "submit", str(tasks), "--policy", policy],
        env={**os.environ, "TURNSTILE_NATS_URL": n3}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert submitted.returncode == 0, submitted.stderr

    def finished() -> int:
        services.check()
        found = rows(database_url, "SELECT count(*) FROM events WHERE type = 'EpisodeFinished'")
        return int(found[0][0])

    await wait_until(lambda: finished() >= TASKS // 4, within=300, what="a quarter of the episodes")
    cluster.nodes[1].kill()  # the inference consumer's node, mid-run
    await wait_until(lambda: finished() >= TASKS // 2, within=300, what="half the episodes, a node down")
    cluster.nodes[1].start()
    done = (
        "SELECT count(DISTINCT data->'task'->>'id') FROM events e WHERE type = 'EpisodeStarted' AND EXISTS "
    )
    done += "(SELECT FROM events f WHERE f.stream = e.stream AND f.data->>'termination' = 'done')"
    await wait_until(
        lambda: services.check() or rows(database_url, done)[0][0] == TASKS,
        within=300,
        what="every task done",
    )

    # Every task has one episode done, with its turns recorded once each.
    per_episode = rows(
        database_url,
        "SELECT e.stream, count(t.*), count(DISTINCT t.data->>'turn_id') FROM events e "
        "JOIN events t ON t.stream = e.stream AND t.type = 'TurnCompleted' "
        "WHERE e.type = 'EpisodeFinished' AND e.data->>'termination' = 'done' GROUP BY e.stream",
    )
    assert len(per_episode) == TASKS
    assert {(count, distinct) for _, count, distinct in per_episode} == {(TURNS, TURNS)}

    # Every batch the materializer made is published and trained exactly once.
    made = "SELECT count(*) FROM batches WHERE samples > 0"
    trained = "SELECT count(*), count(DISTINCT batch_id) FROM trained_batches WHERE outcome = 'trained'"

    def all_trained() -> bool:
        services.check()
        return rows(database_url, trained)[0][1] == rows(database_url, made)[0][0] > 0

    await wait_until(all_trained, within=300, what="every batch trained")
    count, distinct = rows(database_url, trained)[0]
    assert count == distinct == rows(database_url, made)[0][0]
    assert rows(database_url, "SELECT count(*) FROM batches WHERE published_at IS NULL") == [(0,)]
