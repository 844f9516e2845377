"""`turnstile demo --harness`, shortened: a black-box agent (the command agent, a process of its own) under
the harness, sampled by the long-context tiny model through a gateway process; the materializer, relay and
trainer train its verified episodes into policy versions, the inference consumer loads them, and later
episodes are sampled by newer versions. The rewards are the verifier's, and all of it is in `turnstile sql`
and `turnstile ui`."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import psycopg
import pytest

from pipeline.dev import HARNESS_POLICY, try_queries
from pipeline.dev.embedded import EmbeddedServers
from pipeline.harness.backends.process import sandboxes_root
from tests.support.demo import TURNSTILE, browse, run_demo, turnstile_up

BATCHES = 3
VERIFIED = ("done", "truncated", "max_turns")
"""How an episode ends when its agent finished and the verifier ran (``truncated``: the reply was cut at
the demo's ``max_tokens``); the others (cancelled at the stop, error, timeout) get no reward."""


def digit_share(text: str) -> float:
    """What examples/harness-demo/digits/tests/test.sh scores an answer: the share of its digits."""
    return sum(c.isdigit() for c in text) / len(text) if text else 0.0


def rows(connection: psycopg.Connection[Any], sql: str) -> list[tuple[Any, ...]]:
    return connection.execute(sql, {"policy": HARNESS_POLICY}).fetchall()


@pytest.mark.slow
@pytest.mark.demo  # a few minutes: the demo's own CI step
def test_the_harness_demo_trains_versions_that_sample_later_episodes_rewarded_by_the_verifier(
    server_dir: Path,
) -> None:
    data_dir = server_dir / ".turnstile"
    summary = run_demo(data_dir, BATCHES, "--harness", "--sandbox", "none")
    assert int(summary["batches_trained"]) >= BATCHES  # type: ignore[call-overload]
    assert int(summary["policy_version"]) >= BATCHES  # type: ignore[call-overload]

    with EmbeddedServers(data_dir) as servers, psycopg.connect(servers.postgres.url) as connection:
        versions = [v for (v,) in rows(connection, VERSIONS)]
        assert versions == list(range(1, len(versions) + 1)), versions
        assert len(versions) >= BATCHES

        turns = rows(connection, TURNS)  # (episode started, turn's version, versions published before it)
        assert turns
        assert all(version <= published for _, version, published in turns), "a version before it existed"
        sampled_by = {version for _, version, _ in turns}
        assert {0, 1} <= sampled_by, sampled_by  # newer versions sampled episodes
        assert len(sampled_by) >= 3, sampled_by
        first_started, last_started = min(turns)[0], max(turns)[0]
        first_versions = {v for started, v, _ in turns if started == first_started}
        last_versions = {v for started, v, _ in turns if started == last_started}
        assert first_versions == {0}, first_versions
        assert min(last_versions) >= 1, last_versions

        rewards = rows(connection, REWARDS)  # (termination, reward sources, rewards, last reply, tool calls)
        verified = [r for r in rewards if r[0] in VERIFIED]
        assert verified
        assert all(sources == ["verifier"] for _, sources, *_ in verified), "one reward each, the verifier's"
        answered = [(values[0], reply) for _, _, values, reply, calls in verified if not calls]
        assert answered
        for reward, reply in answered:  # the agent wrote its last reply to answer.txt, the verifier scored it
            assert reward == pytest.approx(digit_share(reply), abs=1e-12), (reward, reply)
        assert all(sources == [] for termination, sources, *_ in rewards if termination not in VERIFIED)

        untraced = rows(connection, UNTRACED)
        assert untraced == [(0,)]  # every trained batch is made of the harness's episodes
        assert rows(connection, STILL_OPEN) == [(0,)]  # stopping ended every open session (cancelled)
    leftover = sandboxes_root()
    assert not any(leftover.glob(f"{HARNESS_POLICY}-*/*")), list(leftover.glob(f"{HARNESS_POLICY}-*/*"))

    with turnstile_up(server_dir) as env:  # what the demo prints to try, and the browser
        query = try_queries(HARNESS_POLICY)[0]
        done_sql = subprocess.run(
            [*TURNSTILE, "sql", query], cwd=server_dir, env=env, capture_output=True, text=True, timeout=300
        )
        assert done_sql.returncode == 0, done_sql.stdout + done_sql.stderr
        assert "mean_reward" in done_sql.stdout, done_sql.stdout
        assert len(done_sql.stdout.splitlines()) >= 3, done_sql.stdout  # a row per version at least
        browse(["turnstile", "ui", "--model", str(data_dir / "models" / "long")], server_dir, env)


VERSIONS = """
    SELECT (data->>'version')::int FROM events WHERE stream = 'policy-' || %(policy)s ORDER BY position
"""
TURNS = """
    SELECT s.position, (t.data->>'policy_version')::int,
           (SELECT count(*) FROM events v
            WHERE v.stream = 'policy-' || %(policy)s AND v.position < t.position)
    FROM events s JOIN events t ON t.stream = s.stream AND t.type = 'TurnCompleted'
    WHERE s.type = 'EpisodeStarted' AND s.data->>'policy' = %(policy)s
"""
REWARDS = """
    SELECT f.data->>'termination',
           array(SELECT r.data->>'source' FROM events r
                 WHERE r.stream = s.stream AND r.type = 'RewardAssigned'),
           array(SELECT (r.data->>'value')::float8 FROM events r
                 WHERE r.stream = s.stream AND r.type = 'RewardAssigned'),
           (SELECT t.data->'reply'->>'text' FROM events t
            WHERE t.stream = s.stream AND t.type = 'TurnCompleted' ORDER BY t.position DESC LIMIT 1),
           (SELECT jsonb_array_length(coalesce(t.data->'reply'->'tool_calls', '[]')) FROM events t
            WHERE t.stream = s.stream AND t.type = 'TurnCompleted' ORDER BY t.position DESC LIMIT 1)
    FROM events s JOIN events f ON f.stream = s.stream AND f.type = 'EpisodeFinished'
    WHERE s.type = 'EpisodeStarted' AND s.data->>'policy' = %(policy)s
"""
UNTRACED = """
    SELECT count(*) FROM trained_batches t
    WHERE t.outcome = 'trained' AND NOT EXISTS (
        SELECT 1 FROM samples x JOIN episodes e USING (episode_id)
        WHERE x.batch_id = t.batch_id AND e.policy = %(policy)s AND e.reward IS NOT NULL)
"""
STILL_OPEN = """
    SELECT count(*) FROM events s WHERE s.type = 'EpisodeStarted' AND s.data->>'policy' = %(policy)s
    AND NOT EXISTS (SELECT 1 FROM events f WHERE f.stream = s.stream AND f.type = 'EpisodeFinished')
"""
