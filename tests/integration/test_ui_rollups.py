"""The run page's rollups (migration 0022) against the views they replace, on real PostgreSQL: after the
materializer's writes, after episodes written, finished and deleted by SQL in bulk, and for a database
migrated with episodes already in it."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from alembic import command
from psycopg.rows import dict_row

from pipeline.log import EventStore
from pipeline.log.db import alembic_config
from pipeline.settings import libpq_url
from pipeline.ui.runs import BY_VERSION, RECENT_GROUPS, RUN_STATS, SPREAD, TERMINATIONS
from tests.conftest import login_url
from tests.support.ui_episodes import record_episodes

# The same figures from the views over every episode (migration 0004), as the run page read them before.
VIEWS = {
    "stats": "SELECT policy, episodes, running, finished, mean_reward, mean_turns, tokens, first_started_at, "
    "last_finished_at FROM episode_stats WHERE policy = %(policy)s",
    "by_version": "SELECT policy_version, episodes, rewarded, mean_reward, stddev_reward, min_reward, "
    "max_reward FROM reward_by_policy_version WHERE policy = %(policy)s AND rewarded > 0 "
    "AND policy_version IS NOT NULL ORDER BY policy_version",
    "terminations": "SELECT termination, episodes, share FROM terminations WHERE policy = %(policy)s "
    "ORDER BY episodes DESC, termination",
    "spread": "SELECT count(*) AS groups, count(*) FILTER (WHERE zero_spread) AS zero_spread, "
    "avg(stddev_reward) AS mean_stddev, max(stddev_reward) AS max_stddev FROM group_rewards "
    "WHERE policy = %(policy)s AND finished = episodes AND episodes > 1",
    "throughput": "SELECT coalesce(sum(turns), 0) AS turns, count(*) AS episodes FROM episodes "
    "WHERE policy = %(policy)s AND status = 'finished' AND finished_at IS NOT NULL",
}
ROLLUPS = {
    "stats": RUN_STATS.format(where="WHERE policy = :policy"),
    "by_version": BY_VERSION,
    "terminations": TERMINATIONS.replace("ORDER BY episodes DESC", "ORDER BY episodes DESC, termination"),
    "spread": f"SELECT groups, zero_spread, mean_stddev, max_stddev FROM ({SPREAD}) s",
}
THROUGHPUT = (
    "SELECT coalesce(sum(turns), 0) AS turns, coalesce(sum(episodes), 0) AS episodes FROM throughput_rollups "
    "WHERE policy = %(policy)s AND width_s = %(width)s"
)

# Episodes written as a materializer would, in bulk: three policies, running and finished, groups of 4,
# rewards on most, no reward on errors.
INSERT = """
    INSERT INTO episodes (episode_id, stream, policy, agent, task_id, group_id, group_size, status,
        termination, reward, turns, prompt_tokens, completion_tokens, min_policy_version, max_policy_version,
        started_at, finished_at, duration_s, started_position, finished_position)
    SELECT 'bulk-' || i, 'episode-bulk-' || i, (ARRAY['main', 'eval', 'side'])[i % 3 + 1], 'a', 't' || i / 4,
        'bulk-g' || i / 4, 4, CASE WHEN i % 7 = 0 THEN 'running' ELSE 'finished' END,
        CASE WHEN i % 7 = 0 THEN NULL WHEN i % 11 = 0 THEN 'error' ELSE 'done' END,
        CASE WHEN i % 7 = 0 OR i % 11 = 0 THEN NULL ELSE (i % 5) / 4.0 END,
        i % 6 + 1, 100 * i, 10 * i, i / 50, i / 40,
        timestamptz '2026-11-01' + i * interval '1 second',
        CASE WHEN i % 7 = 0 THEN NULL ELSE timestamptz '2026-11-01' + i * interval '1.7 second' END,
        CASE WHEN i % 7 = 0 THEN NULL ELSE i * 0.7 END, 1000000 + i, NULL
    FROM generate_series(1, 3000) AS i
"""
FINISH = """
    UPDATE episodes SET status = 'finished', termination = 'done', reward = 1.0, turns = 3,
        finished_at = started_at + interval '90 seconds', duration_s = 90
    WHERE episode_id LIKE 'bulk-%' AND status = 'running' AND substr(episode_id, 6)::int % 2 = 0
"""
DELETE = "DELETE FROM episodes WHERE episode_id LIKE 'bulk-%' AND substr(episode_id, 6)::int % 13 = 0"


def _same(found: list[dict[str, Any]], expected: list[dict[str, Any]], what: str) -> None:
    assert len(found) == len(expected), what
    for got, want in zip(found, expected, strict=True):
        assert set(got) == set(want), what
        for key, value in want.items():
            if isinstance(value, float) or isinstance(got[key], float):
                assert got[key] == pytest.approx(value, rel=1e-9, abs=1e-9), f"{what}: {key}"
            else:
                assert got[key] == value, f"{what}: {key}"


def assert_rollups_match_views(connection: psycopg.Connection[dict[str, Any]]) -> None:
    policies = [row["policy"] for row in connection.execute("SELECT DISTINCT policy FROM episodes")]
    assert policies
    for policy in policies:
        for name, statement in ROLLUPS.items():
            rolled = connection.execute(statement.replace(":policy", "%(policy)s"), {"policy": policy})
            viewed = connection.execute(VIEWS[name], {"policy": policy})
            _same(list(rolled), list(viewed), f"{name} of {policy}")
        finished = connection.execute(VIEWS["throughput"], {"policy": policy}).fetchone()
        for width in (1, 60):
            summed = connection.execute(THROUGHPUT, {"policy": policy, "width": width}).fetchone()
            assert summed == finished, f"throughput rollup of {policy}, width {width} s"


async def test_the_rollups_match_the_views_through_inserts_updates_and_deletes(
    store: EventStore, database_url: str
) -> None:
    await record_episodes(store)  # by the materializer (COPY, then its set-based UPDATE of finished ones)
    with psycopg.connect(libpq_url(database_url), row_factory=dict_row, autocommit=True) as connection:
        assert_rollups_match_views(connection)
        connection.execute(INSERT)
        assert_rollups_match_views(connection)
        finished = connection.execute(FINISH).rowcount
        assert finished > 100
        assert_rollups_match_views(connection)
        assert connection.execute(DELETE).rowcount > 100
        assert_rollups_match_views(connection)
        spread = connection.execute(SPREAD.replace(":policy", "'main'")).fetchone()
        assert spread is not None
        assert spread["groups"] > 0
        assert 0 < spread["zero_spread"] < spread["groups"]


def test_a_reader_cannot_write_the_rollups_and_the_materializer_writes_them_only_through_episodes(
    database_url: str, logins: dict[str, tuple[str, str]]
) -> None:
    for role in ("turnstile_reader", "turnstile_materializer"):
        login = libpq_url(login_url(database_url, logins[role]))
        with psycopg.connect(login) as connection, pytest.raises(psycopg.errors.InsufficientPrivilege):
            connection.execute("UPDATE run_rollups SET episodes = 0")
    materializer = login_url(database_url, logins["turnstile_materializer"])
    with psycopg.connect(libpq_url(materializer), row_factory=dict_row, autocommit=True) as connection:
        connection.execute(INSERT.replace("generate_series(1, 3000)", "generate_series(1, 40)"))
        assert_rollups_match_views(connection)


def test_migrating_fills_the_rollups_from_the_episodes_already_there(database_url: str) -> None:
    config = alembic_config(database_url)
    command.downgrade(config, "0021")
    with psycopg.connect(libpq_url(database_url), autocommit=True) as connection:
        connection.execute(INSERT)
    command.upgrade(config, "head")
    with psycopg.connect(libpq_url(database_url), row_factory=dict_row, autocommit=True) as connection:
        assert_rollups_match_views(connection)


def test_the_spread_reads_the_last_finished_groups_only(database_url: str) -> None:
    """2,100 finished pairs: the oldest 100 with equal rewards (zero spread), the rest unequal. The run page
    reads the newest RECENT_GROUPS of them, by the index, so none of the zero-spread ones; and with the
    table's statistics (PostgreSQL guesses ``finished = episodes`` holds for a fraction of a percent of the
    rows, and then preferred reading every group of the policy to walking an index over all of them) by the
    partial index of finished groups still."""
    with psycopg.connect(libpq_url(database_url), row_factory=dict_row, autocommit=True) as connection:
        connection.execute(
            """
            INSERT INTO episodes (episode_id, stream, policy, agent, task_id, group_id, group_size, status,
                termination, reward, turns, started_at, finished_at, started_position)
            SELECT 'pair-' || i || '-' || k, 'episode-pair-' || i || '-' || k, 'capped', 'a', 't',
                'pair-' || i, 2, 'finished', 'done', CASE WHEN i <= 100 THEN 1.0 ELSE k END, 1,
                timestamptz '2026-11-01' + i * interval '1 minute',
                timestamptz '2026-11-01' + i * interval '1 minute' + interval '5 seconds', 2000000 + 2 * i + k
            FROM generate_series(1, 2100) AS i, generate_series(0, 1) AS k
            """
        )
        spread = connection.execute(SPREAD.replace(":policy", "'capped'")).fetchone()
        assert spread is not None
        assert spread["groups"] == RECENT_GROUPS
        assert spread["zero_spread"] == 0
        assert spread["max_stddev"] == pytest.approx(0.5)
        assert spread["histogram"] == [[10, RECENT_GROUPS]]  # every spread 0.5: the top bucket
        connection.execute("ANALYZE group_rollups")
        plan = "\n".join(
            row["QUERY PLAN"]
            for row in connection.execute("EXPLAIN " + SPREAD.replace(":policy", "'capped'"))
        )
        assert "group_rollups_finished" in plan, plan
