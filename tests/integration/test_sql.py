"""``turnstile sql``, the views of migration 0004 and docs/queries.sql, on a real PostgreSQL."""

from __future__ import annotations

import csv
import datetime as dt
import io
import json
import math
import os
import re
import subprocess
import sys
import uuid
from decimal import Decimal
from pathlib import Path
from typing import Any

import psycopg
import pytest
from alembic import command
from rich.console import Console

from pipeline.log.db import alembic_config
from pipeline.log.store import APPEND_LOCK
from pipeline.sql.readonly import (
    QueryResult,
    ReadOnlyViolation,
    SqlError,
    run_readonly,
    statement_keyword,
    to_csv,
    to_json,
    to_table,
)
from tests.conftest import login_url

TURNSTILE = [sys.executable, "-m", "consumers.cli"]
QUERIES = Path(__file__).resolve().parents[2] / "docs" / "queries.sql"
BASE = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
READ_ONLY = "turnstile sql is read-only"

# episode_id: policy, agent, task, group, retry_of, status, termination, error, reward, turns, prompt tokens,
# completion tokens, min/max policy version, started (s after BASE), finished (s), duration
EPISODES: dict[str, tuple[Any, ...]] = {
    "e1": ("main", "calc", "t1", "g1", None, "finished", "done", None, 1.0, 2, 100, 20, 1, 1, 0, 10, 10.0),
    "e2": ("main", "calc", "t1", "g1", None, "finished", "done", None, 0.0, 1, 50, 10, 1, 1, 5, 20, 15.0),
    "e3": ("main", "calc", "t2", "g2", None, "finished", "error", "Traceback (most recent call last):\n"
           '  File "agent.py", line 1\nValueError: boom\n', 0.5, 3, 30, 30, 1, 2, 0, 70, 70.0),
    "e4": ("main", "calc", "t2", None, "e3", "running", None, None, None, 1, 10, 5, 2, 2, 80, None, None),
    "e5": ("alt", "single", "t4", "g3", None, "finished", "max_turns", None, 2.0, 1, 10, 10, 3, 3, 0, 5, 5.0),
}  # fmt: skip
# (episode, engine, latency ms, prefix break) in turn order
TURNS = [
    ("e1", "A", 100.0, False), ("e1", "A", 200.0, True),
    ("e2", "B", 300.0, False),
    ("e3", "A", 300.0, False), ("e3", "A", 400.0, False), ("e3", "B", 500.0, True),
    ("e4", "A", 1000.0, False),
    ("e5", "C", 50.0, False),
]  # fmt: skip
TURN_IDS = [uuid.UUID(int=index) for index in range(1, len(TURNS) + 1)]
# a sample's id is its turn's (migration 0013): each sample here is its episode's first turn
SAMPLE_IDS = {
    name: str(TURN_IDS[[turn[0] for turn in TURNS].index(episode_id)])
    for name, episode_id in (("s1", "e1"), ("s2", "e2"), ("s3", "e3"), ("s4", "e5"))
}
# sample: episode, group, policy version, stale, batch
SAMPLES = {
    "s1": ("e1", "g1", 1, True, "b1"),
    "s2": ("e2", "g1", 2, False, "b1"),
    "s3": ("e3", "g2", 2, False, "b1"),
    "s4": ("e5", "g3", 3, False, None),
}
# batch_id: policy, samples, groups, tokens, stale samples, min/max/newest version, created (s), published (s)
BATCHES = {
    "b1": ("main", 3, 2, 300, 1, 1, 2, 3, 100, 102.5),
    "b2": ("alt", 1, 1, 20, 0, 3, 3, 3, 200, None),
}


def at(seconds: float | None) -> dt.datetime | None:
    return None if seconds is None else BASE + dt.timedelta(seconds=seconds)


def seed(database_url: str) -> None:
    """A few rows in the log and the read models, written as the fixture's (owning) user."""
    with psycopg.connect(database_url) as connection:
        connection.execute("SELECT pg_advisory_xact_lock(%s)", (APPEND_LOCK,))  # appends hold the lock
        connection.execute(
            "INSERT INTO events (position, stream, version, event_id, type, data, content_hash) "
            "VALUES (1, 'episode-e1', 1, %s, 'EpisodeStarted', '{\"episode_id\": \"e1\"}', '\\x00')",
            (uuid.uuid4(),),
        )
        for position, (episode_id, row) in enumerate(EPISODES.items(), start=1):
            started, finished, duration = row[14:]
            connection.execute(
                "INSERT INTO episodes (episode_id, stream, policy, agent, task_id, group_id, retry_of, "
                "status, termination, error, reward, turns, prompt_tokens, completion_tokens, "
                "min_policy_version, max_policy_version, started_at, finished_at, duration_s, "
                "started_position, finished_position) VALUES "
                "(%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)",
                (
                    episode_id,
                    f"episode-{episode_id}",
                    *row[:14],
                    at(started),
                    at(finished),
                    duration,
                    position,
                    None if finished is None else 100 + position,
                ),
            )
        # A turn's read model is its turn_rows row plus its TurnCompleted event (the view turns, migration
        # 0013): the event carries engine, timings and finish reason.
        indexes: dict[str, int] = {}
        versions = {"e1": 1}
        started = {episode_id: position for position, episode_id in enumerate(EPISODES, start=1)}
        for position, (turn_id, (episode_id, engine, latency, prefix_break)) in enumerate(
            zip(TURN_IDS, TURNS, strict=True), start=2
        ):
            indexes[episode_id] = indexes.get(episode_id, -1) + 1
            versions[episode_id] = versions.get(episode_id, 0) + 1
            stream, version = f"episode-{episode_id}", versions[episode_id]
            data = {
                "turn_id": str(turn_id), "engine_id": engine, "reply": {"finish_reason": "stop"},
                "timings": {"queued_ms": latency / 10, "first_token_ms": latency / 2, "total_ms": latency},
            }  # fmt: skip
            connection.execute(
                "INSERT INTO events (position, stream, version, event_id, type, data, content_hash, "
                "recorded_at) VALUES (%s, %s, %s, %s, 'TurnCompleted', %s, '\\x00', %s)",
                (position, stream, version, uuid.uuid4(), json.dumps(data), BASE),
            )
            connection.execute(
                "INSERT INTO turn_rows (turn_id, episode, turn_index, prompt_tokens, completion_tokens, "
                "policy_version, reward, discounted_return, prefix_break, position) "
                "VALUES (%s, %s, %s, 10, 10, 1, 0, 0, %s, %s)",
                (turn_id, started[episode_id], indexes[episode_id], prefix_break, position),
            )
        for batch_id, batch in BATCHES.items():
            created, published = batch[-2:]
            connection.execute(
                "INSERT INTO batches (batch_id, policy, samples, groups, tokens, stale_samples, "
                "min_policy_version, max_policy_version, newest_version, config_hash, position, created_at, "
                "published_at) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, 'h', 0, %s, %s)",
                (batch_id, *batch[:-2], at(created), at(published)),
            )
        for name, (episode_id, group, version, stale, batch) in SAMPLES.items():
            assert group == EPISODES[episode_id][3]  # the view takes a sample's group from its episode
            connection.execute(
                "INSERT INTO sample_rows (turn_id, policy_version, tokens, model_tokens, reward, advantage, "
                "stale, arrays, batch_id) VALUES (%s, %s, 100, 10, %s, 0.0, %s, '\\x0102', %s)",
                (SAMPLE_IDS[name], version, EPISODES[episode_id][8], stale, batch),
            )


READER_LOGIN: list[tuple[str, str]] = []  # this session's reader login (the ``logins`` fixture)


@pytest.fixture(autouse=True)
def _reader_login(logins: dict[str, tuple[str, str]]) -> None:
    READER_LOGIN[:] = [logins["turnstile_reader"]]


def reader(database_url: str) -> str:
    """The test's database, logged in as a reader (not a superuser: `turnstile sql` refuses those)."""
    return login_url(database_url, READER_LOGIN[0])


def rows_of(database_url: str, query: str) -> list[dict[str, Any]]:
    result = run_readonly(reader(database_url), query)
    return [dict(zip(result.columns, row, strict=True)) for row in result.rows]


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TURNSTILE_")}
    return {**env, **extra}


def turnstile_sql(database_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*TURNSTILE, "sql", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=clean_env(TURNSTILE_DATABASE_URL=database_url, TURNSTILE_READER_URL=reader(database_url)),
    )


def documented_queries() -> list[str]:
    """docs/queries.sql split on ';' at line ends, comment-only pieces left out."""
    pieces = re.split(r";[ \t]*$", QUERIES.read_text(), flags=re.MULTILINE)
    code = [re.sub(r"--[^\n]*", "", piece).strip() for piece in pieces]
    return [piece.strip() for piece, text in zip(pieces, code, strict=True) if text]


def numbered(query: str) -> int:
    match = re.search(r"^-- (\d+)\. ", query, flags=re.MULTILINE)
    assert match, f"query without a numbered '-- N. question' comment:\n{query}"
    return int(match.group(1))


def counts(database_url: str) -> tuple[int, int, float]:
    with psycopg.connect(database_url) as connection:
        row = connection.execute(
            "SELECT (SELECT count(*) FROM events), (SELECT count(*) FROM episodes), "
            "(SELECT reward FROM episodes WHERE episode_id = 'e1')"
        ).fetchone()
    assert row is not None
    return row[0], row[1], row[2]


# -- the views ------------------------------------------------------------------------------------------


def test_views_give_the_hand_computed_aggregates(database_url: str) -> None:
    seed(database_url)
    stats = {row["policy"]: row for row in rows_of(database_url, "SELECT * FROM episode_stats")}
    assert (stats["main"]["episodes"], stats["main"]["running"], stats["main"]["finished"]) == (4, 1, 3)
    assert stats["main"]["mean_reward"] == pytest.approx(0.5)  # (1 + 0 + 0.5) / 3; e4 has none yet
    assert stats["main"]["mean_turns"] == pytest.approx(1.75)  # (2 + 1 + 3 + 1) / 4
    assert (stats["main"]["prompt_tokens"], stats["main"]["completion_tokens"], stats["main"]["tokens"]) == (
        190, 65, 255,
    )  # fmt: skip
    assert stats["main"]["mean_duration_s"] == pytest.approx(95 / 3)
    assert stats["main"]["last_finished_at"] == BASE + dt.timedelta(seconds=70)
    assert (stats["alt"]["episodes"], stats["alt"]["mean_reward"], stats["alt"]["tokens"]) == (1, 2.0, 20)

    by_version = {
        (row["policy"], row["policy_version"]): row
        for row in rows_of(database_url, "SELECT * FROM reward_by_policy_version")
    }
    assert set(by_version) == {("main", 1), ("main", 2), ("alt", 3)}
    assert (by_version["main", 1]["episodes"], by_version["main", 1]["mean_reward"]) == (2, 0.5)
    assert by_version["main", 1]["stddev_reward"] == pytest.approx(math.sqrt(0.5))  # sample stddev of 1, 0
    assert (by_version["main", 2]["stddev_reward"], by_version["main", 2]["mean_reward"]) == (None, 0.5)
    assert by_version["alt", 3]["max_reward"] == 2.0

    groups = {row["group_id"]: row for row in rows_of(database_url, "SELECT * FROM group_rewards")}
    assert set(groups) == {"g1", "g2", "g3"}
    assert groups["g1"]["stddev_reward"] == pytest.approx(0.5)  # population stddev of 1, 0
    assert (groups["g1"]["zero_spread"], groups["g2"]["zero_spread"], groups["g1"]["task_id"]) == (
        False,
        True,
        "t1",
    )

    latency = {
        row["engine_id"]: row for row in rows_of(database_url, "SELECT * FROM turn_latency_by_consumer")
    }
    assert latency["A"]["turns"] == 5  # 100, 200, 300, 400, 1000
    assert latency["A"]["p50_latency_ms"] == pytest.approx(300)
    assert latency["A"]["p95_latency_ms"] == pytest.approx(880)  # 400 + 0.8 * (1000 - 400)
    assert latency["A"]["p99_latency_ms"] == pytest.approx(976)  # 400 + 0.96 * 600
    assert latency["A"]["p50_first_token_ms"] == pytest.approx(150)
    assert latency["A"]["completion_tokens"] == 50
    assert latency["B"]["p95_latency_ms"] == pytest.approx(490)  # 300 + 0.95 * 200
    assert latency["C"]["max_latency_ms"] == 50

    breaks = {row["agent"]: row for row in rows_of(database_url, "SELECT * FROM prefix_break_rate_by_agent")}
    assert (breaks["calc"]["episodes"], breaks["calc"]["turns"], breaks["calc"]["prefix_breaks"]) == (4, 7, 2)
    assert breaks["calc"]["prefix_break_rate"] == pytest.approx(2 / 7)
    assert breaks["single"]["prefix_break_rate"] == 0.0

    batches = {row["batch_id"]: row for row in rows_of(database_url, "SELECT * FROM batch_staleness")}
    assert (batches["b1"]["max_staleness"], batches["b1"]["min_staleness"]) == (2, 1)
    assert batches["b1"]["mean_staleness"] == pytest.approx(4 / 3)  # samples at versions 1, 2, 2; newest 3
    assert batches["b1"]["stale_fraction"] == pytest.approx(1 / 3)
    assert batches["b1"]["publish_delay_s"] == pytest.approx(2.5)
    assert (batches["b2"]["mean_staleness"], batches["b2"]["publish_delay_s"]) == (None, None)

    ends = {
        (row["policy"], row["termination"]): (row["episodes"], row["share"])
        for row in rows_of(database_url, "SELECT * FROM terminations")
    }
    assert ends == {
        ("main", "done"): (2, pytest.approx(2 / 3)),
        ("main", "error"): (1, pytest.approx(1 / 3)),
        ("alt", "max_turns"): (1, 1.0),
    }


def test_downgrade_drops_the_views_and_upgrade_runs_again_where_the_role_exists(database_url: str) -> None:
    command.downgrade(alembic_config(database_url), "0003")
    with psycopg.connect(database_url) as connection:
        assert connection.execute("SELECT to_regclass('episode_stats')").fetchone() == (None,)
        assert connection.execute(
            "SELECT count(*) FROM pg_roles WHERE rolname = 'turnstile_reader'"
        ).fetchone() == (1,)  # shared with the other databases: left in place
    command.upgrade(alembic_config(database_url), "head")
    assert rows_of(database_url, "SELECT * FROM episode_stats") == []


def test_the_narrow_read_models_migration_keeps_what_readers_see(database_url: str) -> None:
    """Migration 0013 moves turns and samples written by the older materializer into turn_rows and
    sample_rows: the views give back the same rows (an individual and a concat sample, a root and a child,
    a recorded parent that is not the tree's); downgrading gives the tables back."""
    command.downgrade(alembic_config(database_url), "0012")
    root, child = uuid.UUID(int=1), uuid.UUID(int=2)
    events = [
        ("EpisodeStarted", {"episode_id": "x"}),
        ("TurnCompleted", {"turn_id": str(root), "engine_id": "E", "chat_template": "abc",
                           "reply": {"finish_reason": "stop", "tool_calls": [{"id": "1"}]},
                           "timings": {"queued_ms": 1.5, "first_token_ms": 2, "total_ms": 3.25}}),
        ("TurnCompleted", {"turn_id": str(child), "parent_turn_id": str(uuid.UUID(int=9)), "engine_id": "F",
                           "reply": {"finish_reason": "length"}, "timings": {}}),
    ]  # fmt: skip
    with psycopg.connect(database_url) as connection:
        connection.execute("SELECT pg_advisory_xact_lock(%s)", (APPEND_LOCK,))
        for position, (kind, data) in enumerate(events, start=1):
            connection.execute(
                "INSERT INTO events (position, stream, version, event_id, type, data, content_hash, "
                "recorded_at) VALUES (%s, 'episode-x', %s, %s, %s, %s, '\\x00', %s)",
                (position, position, uuid.uuid4(), kind, json.dumps(data), at(position)),
            )
        connection.execute(
            "INSERT INTO episodes (episode_id, stream, policy, agent, task_id, group_id, status, started_at, "
            "started_position, finished_position) VALUES ('x', 'episode-x', 'p', 'a', 't', NULL, 'finished', "
            "%s, 1, 4)",
            (at(0),),
        )
        connection.execute(
            "INSERT INTO turns VALUES "
            "(%s, 'x', 0, NULL, NULL, 10, 5, 'stop', 1, 'E', 1.5, 2, 3.25, -0.5, 0, 0.5, false, 1, %s, 2, "
            "NULL, 'abc'), "
            "(%s, 'x', 1, %s, %s, 20, 4, 'length', 2, 'F', 0, 0, 0, NULL, 1, 1, true, 0, %s, 3, true, NULL)",
            (root, at(2), child, root, uuid.UUID(int=9), at(3)),
        )
        connection.execute(
            "INSERT INTO samples VALUES "
            "(%s, 'x', 'p', 'x', 0, %s, 1, 15, 5, 0.5, 0.25, false, NULL, 4, 'b', 4), "
            "(%s, 'x', 'p', 'x', 1, %s, 1, 24, 9, 0.5, NULL, true, '\\x01', NULL, NULL, 4)",
            (str(root), [root], f"{child}:path", [root, child]),
        )
    before = {
        table: sorted(rows_of(database_url, f"SELECT * FROM {table}"), key=str)
        for table in ("turns", "samples")
    }
    command.upgrade(alembic_config(database_url), "0013")  # 0014 adds a column to turns
    for table in ("turns", "samples"):
        assert sorted(rows_of(database_url, f"SELECT * FROM {table}"), key=str) == before[table], table
    with psycopg.connect(database_url) as connection:
        assert connection.execute("SELECT count(*) FROM sample_rows WHERE reward IS NULL").fetchone() == (1,)
    command.downgrade(alembic_config(database_url), "0012")
    for table in ("turns", "samples"):
        assert sorted(rows_of(database_url, f"SELECT * FROM {table}"), key=str) == before[table], table
    command.upgrade(alembic_config(database_url), "head")


# -- docs/queries.sql -----------------------------------------------------------------------------------


def test_every_documented_query_runs_on_an_empty_and_on_a_filled_database(database_url: str) -> None:
    queries = documented_queries()
    assert len(queries) >= 10
    assert [numbered(query) for query in queries] == list(range(1, len(queries) + 1))
    for query in queries:
        assert run_readonly(reader(database_url), query).rows == [], query

    seed(database_url)
    results = {numbered(query): rows_of(database_url, query) for query in queries}
    assert [(row["policy"], row["policy_version"]) for row in results[2]] == [
        ("alt", 3), ("main", 1), ("main", 2),
    ]  # fmt: skip
    assert [(row["turns"], row["episodes"]) for row in results[4] if row["policy"] == "main"] == [
        (1, 1), (2, 1), (3, 1),
    ]  # fmt: skip
    assert results[6][0]["engine_id"] == "A"  # the highest p95 first
    assert [(row["staleness"], row["samples"], row["flagged_stale"]) for row in results[7]] == [
        (1, 2, 0), (2, 1, 1),
    ]  # fmt: skip
    assert [row["sample_id"] for row in results[11]] == [SAMPLE_IDS["s4"]]  # the newest group, g3
    assert [(row["retried_episode"], row["retry"]) for row in results[14]] == [("e3", "e4")]
    assert results[15] == [{"agent": "calc", "error": "ValueError: boom", "episodes": 1}]
    assert [row["episode_id"] for row in results[16]] == ["e4"]


def test_a_documented_paragraph_runs_as_the_file_says(database_url: str) -> None:
    """The file's recipe: turnstile sql "$(awk -v RS= '/^-- 5\\./' docs/queries.sql)" runs query 5."""
    seed(database_url)
    paragraphs = [part.strip() for part in re.split(r"\n\s*\n", QUERIES.read_text()) if part.strip()]
    assert len([part for part in paragraphs if re.match(r"-- \d+\. ", part)]) == len(documented_queries())
    fifth = next(part for part in paragraphs if part.startswith("-- 5. "))
    result = turnstile_sql(database_url, fifth, "--json")  # begins with "--": still the query, not an option
    assert result.returncode == 0, result.stderr
    assert [(row["agent"], row["prefix_breaks"]) for row in json.loads(result.stdout)] == [
        ("calc", 2),
        ("single", 0),
    ]


# -- read-only ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "statement",
    [
        "DELETE FROM events",
        "INSERT INTO episodes (episode_id) VALUES ('x')",
        "UPDATE episodes SET reward = 0",
        "DROP TABLE events",
        "CREATE TABLE scratch (a int)",
        "SELECT 1; DELETE FROM events",
        "SELECT 1; COMMIT; SET default_transaction_read_only = off; COMMIT; DELETE FROM events",
    ],
)
def test_writes_are_refused_with_a_clear_message_and_change_nothing(
    database_url: str, statement: str
) -> None:
    seed(database_url)
    before = counts(database_url)
    result = turnstile_sql(database_url, statement)
    assert result.returncode == 2, result.stderr
    assert READ_ONLY in result.stderr
    assert result.stdout == ""
    assert counts(database_url) == before == (1 + len(TURNS), 5, 1.0)


@pytest.mark.parametrize(
    ("statement", "said"),
    [
        ("WITH gone AS (DELETE FROM events RETURNING 1) SELECT count(*) FROM gone", "read-only transaction"),
        ("EXPLAIN ANALYZE DELETE FROM events", "read-only transaction"),
        ("SELECT * INTO scratch FROM events", "read-only transaction"),
        ("delete from events; select 1", "multiple commands"),
        ("/* hi */ COMMIT", "COMMIT is not one"),
        ("SET ROLE NONE", "SET is not one"),
        ("DO $$ BEGIN DELETE FROM events; END $$", "DO is not one"),
        ("(COPY events TO STDOUT)", "COPY is not one"),
        ("ALTER SYSTEM SET work_mem = '1GB'", "cannot run inside a transaction block"),
    ],
)
def test_other_ways_to_write_are_refused(database_url: str, statement: str, said: str) -> None:
    seed(database_url)
    with pytest.raises(ReadOnlyViolation, match=READ_ONLY) as refused:
        run_readonly(reader(database_url), statement)
    assert said in str(refused.value)
    assert counts(database_url) == (1 + len(TURNS), 5, 1.0)


def test_queries_run_as_the_reader_role_in_a_read_only_transaction(database_url: str) -> None:
    row = run_readonly(
        reader(database_url),
        "SELECT current_user, current_setting('transaction_read_only'), pg_backend_pid()",
    ).rows[0]
    assert row[:2] == ("turnstile_reader", "on")
    with psycopg.connect(database_url, autocommit=True) as other:
        pid = other.info.backend_pid
        with pytest.raises(ReadOnlyViolation, match="permission denied"):
            run_readonly(reader(database_url), f"SELECT pg_terminate_backend({pid})")
        assert other.execute("SELECT 1").fetchone() == (1,)
    with pytest.raises(ReadOnlyViolation):
        run_readonly(reader(database_url), "SELECT lo_import('/etc/hostname')")


def test_a_superuser_login_is_refused_unless_allowed_because_a_query_can_switch_back_to_it(
    database_url: str,
) -> None:
    escape = "SELECT set_config('role', session_user, true), current_setting('is_superuser')"
    with pytest.raises(SqlError, match="is a superuser: a query could switch back to it"):
        run_readonly(database_url, escape)  # the fixture's URL: the server's superuser
    assert run_readonly(database_url, escape, allow_superuser=True).rows[0][1] == "on"  # what it guards
    assert run_readonly(reader(database_url), escape).rows[0][1] == "off"  # a reader login stays a reader
    superuser_env = clean_env(TURNSTILE_DATABASE_URL=database_url)  # no reader URL: the superuser it is
    refused = subprocess.run(
        [*TURNSTILE, "sql", "SELECT 1 AS one", "--json"],
        capture_output=True, text=True, timeout=120, env=superuser_env,
    )  # fmt: skip
    assert refused.returncode != 0
    assert "TURNSTILE_READER_URL" in refused.stdout + refused.stderr
    allowed = subprocess.run(
        [*TURNSTILE, "sql", "SELECT 1 AS one", "--json", "--allow-superuser"],
        capture_output=True, text=True, timeout=120, env=superuser_env,
    )  # fmt: skip
    assert allowed.returncode == 0, allowed.stderr
    assert json.loads(allowed.stdout) == [{"one": 1}]


def test_a_query_past_the_timeout_is_cancelled(database_url: str) -> None:
    with pytest.raises(SqlError, match=r"statement timeout \(0.2 s\)"):
        run_readonly(reader(database_url), "SELECT pg_sleep(5)", timeout_s=0.2)


# -- errors ---------------------------------------------------------------------------------------------


def test_a_syntax_error_shows_what_postgresql_said(database_url: str) -> None:
    result = turnstile_sql(database_url, "SELEC 1")
    assert result.returncode == 2
    assert 'syntax error at or near "SELEC"' in result.stderr
    assert READ_ONLY not in result.stderr


def test_an_unknown_column_points_at_it(database_url: str) -> None:
    with pytest.raises(SqlError) as refused:
        run_readonly(reader(database_url), "SELECT episode_id,\n       nope[1]\nFROM episodes")
    message = str(refused.value)
    assert 'column "nope" does not exist' in message
    assert "  LINE 2:        nope[1]\n" + " " * len("  LINE 2:        ") + "^" in message
    result = turnstile_sql(database_url, "SELECT nope[1] FROM episodes")  # brackets survive rich markup
    assert result.returncode == 2
    assert "SELECT nope[1] FROM episodes" in result.stderr


def test_an_empty_query_and_an_unknown_schema_say_what_to_do(database_url: str) -> None:
    with pytest.raises(SqlError, match="empty"):
        run_readonly(reader(database_url), " -- nothing\n;")
    with pytest.raises(SqlError, match=r"schema 'rm_nope' does not exist .*rematerialize"):
        run_readonly(reader(database_url), "SELECT 1", search_path="rm_nope")


# -- the command ----------------------------------------------------------------------------------------

BY_ID = "SELECT episode_id, reward, finished_at, turns FROM episodes ORDER BY episode_id"


def test_sql_prints_a_table_by_default(database_url: str) -> None:
    seed(database_url)
    result = turnstile_sql(database_url, BY_ID)
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stdout.splitlines() if "e" in line and "│" in line]
    assert [re.findall(r"e\d", line)[0] for line in lines if re.search(r"│ e\d ", line)] == [
        "e1", "e2", "e3", "e4", "e5",
    ]  # fmt: skip
    assert "episode_id" in result.stdout
    assert "NULL" in result.stdout  # e4: no reward yet
    assert result.stderr.strip() == "5 rows"


def test_sql_csv_and_json(database_url: str) -> None:
    seed(database_url)
    as_csv = turnstile_sql(database_url, BY_ID, "--csv")
    assert as_csv.returncode == 0, as_csv.stderr
    table = list(csv.reader(io.StringIO(as_csv.stdout)))
    assert table[0] == ["episode_id", "reward", "finished_at", "turns"]
    assert table[1] == ["e1", "1.0", "2026-01-01T00:00:10+00:00", "2"]
    assert table[4] == ["e4", "", "", "1"]
    as_json = turnstile_sql(database_url, BY_ID, "--json", "--limit", "2")
    assert as_json.returncode == 0, as_json.stderr
    assert json.loads(as_json.stdout) == [
        {"episode_id": "e1", "reward": 1.0, "finished_at": "2026-01-01T00:00:10+00:00", "turns": 2},
        {"episode_id": "e2", "reward": 0.0, "finished_at": "2026-01-01T00:00:20+00:00", "turns": 1},
    ]
    assert "2 rows (more not fetched: --limit 2)" in as_json.stderr
    both = turnstile_sql(database_url, BY_ID, "--json", "--csv")
    assert both.returncode == 2
    assert "choose one" in both.stderr


def test_sql_reads_a_rebuild_schema_first(database_url: str) -> None:
    seed(database_url)
    with psycopg.connect(database_url) as connection:  # what `turnstile rematerialize --name try` makes
        connection.execute("CREATE SCHEMA rm_try")
        connection.execute("CREATE TABLE rm_try.episodes (LIKE public.episodes INCLUDING ALL)")
        connection.execute(
            "INSERT INTO rm_try.episodes SELECT * FROM public.episodes WHERE episode_id = 'e5'"
        )
    result = turnstile_sql(database_url, "SELECT episode_id FROM episodes", "--schema", "try", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == [{"episode_id": "e5"}]
    live = turnstile_sql(database_url, "SELECT count(*) AS n FROM episodes", "--json", "--schema", "main")
    assert json.loads(live.stdout) == [{"n": 5}]


# -- formatting -----------------------------------------------------------------------------------------


def test_values_become_json_csv_and_table_cells(database_url: str) -> None:
    result = run_readonly(
        reader(database_url),
        "SELECT '6f1c1c6e-4a36-4b7e-9d43-0d3a3b3c9a10'::uuid AS id, '\\x0aff'::bytea AS raw, "
        "1.50::numeric AS n, 'NaN'::float8 AS nan, '{\"a\": [1, null]}'::jsonb AS doc, ARRAY[1, 2] AS xs, "
        "NULL AS nothing, "
        "interval '90 seconds' AS took, true AS ok, '2026-01-01 00:00:00+00'::timestamptz AS at, "
        "'[red]x[/red]' AS markup, 1 AS n, '50%' AS pct",
    )
    record = json.loads(to_json(result))[0]
    assert record == {
        "id": "6f1c1c6e-4a36-4b7e-9d43-0d3a3b3c9a10", "raw": "\\x0aff", "n": 1.5, "nan": "NaN",
        "doc": {"a": [1, None]}, "xs": [1, 2], "nothing": None, "took": 90.0, "ok": True,
        "at": "2026-01-01T00:00:00+00:00", "markup": "[red]x[/red]", "n_2": 1, "pct": "50%",
    }  # fmt: skip
    fields = list(csv.reader(io.StringIO(to_csv(result))))[1]
    assert fields == [
        "6f1c1c6e-4a36-4b7e-9d43-0d3a3b3c9a10", "\\x0aff", "1.50", "NaN", '{"a": [1, null]}', "[1, 2]", "",
        "90.0", "true", "2026-01-01T00:00:00+00:00", "[red]x[/red]", "1", "50%",
    ]  # fmt: skip
    console = Console(file=io.StringIO(), width=300, color_system=None)
    console.print(to_table(result))
    shown = console.file.getvalue()  # type: ignore[attr-defined]
    for cell in ("<2 bytes>", "NULL", "[red]x[/red]", "1.5", "0:01:30"):
        assert cell in shown


def test_table_numbers_are_readable() -> None:
    result = QueryResult(["x"], [(1234567.891,), (Decimal("2.000"),), (0.123456789,), (None,)])
    console = Console(file=io.StringIO(), width=80, color_system=None)
    console.print(to_table(result))
    shown = console.file.getvalue()  # type: ignore[attr-defined]
    cells = [line.strip("│").strip() for line in shown.splitlines() if line.startswith("│")]
    assert cells == ["1234567.9", "2", "0.123457", "NULL"]
    assert "│         2 │" in shown  # numbers are right-aligned


def test_statement_keyword_skips_comments_and_parentheses() -> None:
    assert statement_keyword("  -- a\n/* b /* nested */ c */ ((select 1))") == "SELECT"
    assert statement_keyword("\ncopy x to stdout") == "COPY"
    assert statement_keyword("123") == ""
