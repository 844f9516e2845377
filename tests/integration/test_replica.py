"""Readers off the primary: `turnstile sql`, `replay` and `episodes` against a streaming replica (hot
standby) of the embedded PostgreSQL, with the primary out of their reach."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from pipeline.dev.embedded import EmbeddedPostgres, EmbeddedReplica
from pipeline.episodes import EpisodeSession, run_episode
from pipeline.log import EventStore
from pipeline.log.db import make_logins, migrate, with_user
from pipeline.materialize.config import MaterializerConfig
from pipeline.materialize.writer import Materializer
from tests.support.agents import ThreeTurnAgent
from tests.support.backends import PrefixEcho
from tests.support.waiting import wait_until

TURNSTILE = [sys.executable, "-m", "consumers.cli"]
UNREACHABLE = "postgresql://nobody@127.0.0.1:9/none"  # the discard port: nothing answers there


@pytest.fixture
def primary(tmp_path: Path) -> Iterator[EmbeddedPostgres]:
    server = EmbeddedPostgres(tmp_path / "primary")
    server.start()
    try:
        yield server
    finally:
        server.remove()  # as root its cluster is outside tmp_path (0700): removed with it, not left behind


def turnstile(reader_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TURNSTILE_")}
    env.update(TURNSTILE_READER_URL=reader_url, TURNSTILE_DATABASE_URL=UNREACHABLE)
    return subprocess.run([*TURNSTILE, *args], capture_output=True, text=True, env=env, timeout=120)


async def record(url: str, episode_id: str) -> None:
    store = await EventStore.connect(url)
    try:
        session = EpisodeSession(store, PrefixEcho(), policy="main", agent="tests", episode_id=episode_id)
        outcome = await run_episode(ThreeTurnAgent(), session)
        assert outcome.termination == "done"
        materializer = Materializer(url, MaterializerConfig())
        await materializer.open()
        await materializer.catch_up()
        await materializer.close()
    finally:
        await store.close()


async def test_readers_run_on_a_streaming_replica_that_follows_the_primary(
    primary: EmbeddedPostgres, tmp_path: Path
) -> None:
    migrate(primary.url)
    logins = make_logins(primary.url)
    await record(logins.services, "before-replica")
    replica = EmbeddedReplica(tmp_path / "replica", primary.url)
    replica.start()
    try:
        await wait_until(lambda: replica.caught_up(), within=60, what="the replica to catch up")
        with psycopg.connect(replica.url, autocommit=True) as connection:
            assert connection.execute("SELECT pg_is_in_recovery()").fetchone() == (True,)
            with pytest.raises(psycopg.errors.ReadOnlySqlTransaction):
                connection.execute("INSERT INTO checkpoints (name, position) VALUES ('x', 1)")
        reader = with_user(replica.url, "turnstile_analyst")  # the reader login, replicated with the rest

        listed = turnstile(reader, "episodes", "--json")
        assert listed.returncode == 0, listed.stderr
        assert "before-replica" in listed.stdout
        shown = turnstile(reader, "replay", "before-replica")
        assert shown.returncode == 0, shown.stderr
        assert "Turn 3 of 3" in shown.stdout
        counted = turnstile(reader, "sql", "SELECT count(*) AS n FROM episodes", "--csv")
        assert counted.returncode == 0, counted.stderr
        assert counted.stdout.split() == ["n", "1"]

        await record(logins.services, "after-replica")  # written on the primary, read on the replica
        await wait_until(lambda: replica.caught_up(), within=60, what="the replica to follow")
        assert turnstile(reader, "sql", "SELECT count(*) AS n FROM episodes", "--csv").stdout.split() == [
            "n",
            "2",
        ]
        assert "Turn 3 of 3" in turnstile(reader, "replay", "after-replica").stdout
    finally:
        replica.remove()
