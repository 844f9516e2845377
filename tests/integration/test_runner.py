"""Runners at scale and as processes: 200 concurrent episodes on the tiny model, `turnstile run` (and
Ctrl-C), recovery of abandoned episodes, and the TASKS work queue with a runner killed mid-run."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import signal
import sys
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import nats
import psycopg
import pytest
import sqlalchemy as sa

from consumers.inference import InferenceConfig
from pipeline.episodes import EpisodeSession, expand_turns
from pipeline.episodes.fold import EpisodeOutcome
from pipeline.episodes.leases import RunnerLease, close_abandoned_episodes
from pipeline.examples import ARITHMETIC_TASKS
from pipeline.inference.backends import Generation
from pipeline.inference.client import NatsLLMClient
from pipeline.log import EventStore
from pipeline.log.tables import runners
from pipeline.runners.runner import Runner, RunnerConfig, RunStats, TaskSpec, run_tasks
from pipeline.runners.taskqueue import TASKS_STREAM, TaskWorker, runner_durable, submit_tasks
from pipeline.settings import libpq_url
from schemas import LLMRequest, SamplingParams, TurnCompleted
from tests.conftest import Servers
from tests.support.agents import ThreeTurnAgent
from tests.support.backends import Rule, RuleBackend, calculator_rule, echo_rule
from tests.support.processes import running
from tests.support.serving import serving
from tests.support.taskqueue import SilentTasks
from tests.support.waiting import wait_until

TURNSTILE = [sys.executable, "-m", "consumers.cli"]


def new_policy() -> str:
    return f"p{uuid.uuid4().hex[:10]}"


@pytest.fixture
async def llm(servers: Servers) -> AsyncIterator[NatsLLMClient]:
    client = await NatsLLMClient.connect(servers.nats_url, heartbeat_timeout=5.0, wait_for_consumer=5.0)
    yield client
    await client.close()


def query(database_url: str, sql: str, *params: object) -> list[tuple[Any, ...]]:
    with psycopg.connect(libpq_url(database_url)) as connection:
        return connection.execute(sql, params).fetchall()  # type: ignore[arg-type]


def terminations(database_url: str) -> Counter[str]:
    rows = query(database_url, "SELECT data->>'termination' FROM events WHERE type = 'EpisodeFinished'")
    return Counter(row[0] for row in rows)


def open_episodes(database_url: str) -> int:
    rows = query(
        database_url,
        "SELECT count(*) FROM events s WHERE s.type = 'EpisodeStarted' AND NOT EXISTS "
        "(SELECT 1 FROM events f WHERE f.stream = s.stream AND f.type = 'EpisodeFinished')",
    )
    return int(rows[0][0])


class Gated(RuleBackend):
    """Answers the first ``free`` requests; later ones wait until ``gate`` is set (``held`` counts them)."""

    def __init__(self, rule: Rule, *, free: int) -> None:
        super().__init__(rule)
        self.free, self.admitted, self.held = free, 0, 0
        self.gate = asyncio.Event()

    async def generate(self, request: LLMRequest) -> Generation:
        self.admitted += 1
        if self.admitted > self.free and not self.gate.is_set():
            self.held += 1
            await self.gate.wait()
        return await super().generate(request)


def env_for(servers: Servers, database_url: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TURNSTILE_")}
    return {**env, "TURNSTILE_DATABASE_URL": database_url, "TURNSTILE_NATS_URL": servers.nats_url, **extra}


async def test_200_concurrent_episodes_of_3_turns_on_the_tiny_model(
    servers: Servers, store: EventStore, llm: NatsLLMClient, tiny_model_dir: Path
) -> None:
    policy = new_policy()
    config = InferenceConfig(servers.nats_url, policy, backend="torch", model=tiny_model_dir, max_batch=64)
    async with serving(config):
        runner_config = RunnerConfig(
            policy=policy,
            agent_name="tests.support.agents:ThreeTurnAgent",
            concurrency=200,
            sampling=SamplingParams(max_tokens=4),
        )
        runner = Runner(ThreeTurnAgent(), store=store, llm=llm, config=runner_config)
        tasks = iter([TaskSpec(task={"id": n, "max_tokens": 4}, task_id=str(n)) for n in range(200)])
        outcomes = await run_tasks(runner, tasks)

    assert len(outcomes) == 200
    assert {o.termination for o in outcomes} <= {"done", "truncated"}
    records = await store.read_all(0, limit=10_000)
    turns = [r.event for r in records if isinstance(r.event, TurnCompleted)]
    assert len(turns) == 600
    assert len({t.turn_id for t in turns}) == 600  # every turn exactly once
    by_episode: dict[str, list[TurnCompleted]] = {}
    for record in records:
        if isinstance(record.event, TurnCompleted):
            by_episode.setdefault(record.stream, []).append(record.event)
    assert len(by_episode) == 200
    for episode_turns in by_episode.values():
        assert len(episode_turns) == 3
        first, second, third = expand_turns(episode_turns)
        assert first.parent_turn_id is None
        assert second.parent_turn_id == first.turn_id
        assert third.parent_turn_id == second.turn_id
        for parent, child in ((first, second), (second, third)):
            context = [*parent.prompt_token_ids, *parent.completion_token_ids]
            assert child.prompt_token_ids[: len(context)] == context  # token-exact continuation
        for turn in episode_turns:
            assert 1 <= len(turn.completion_token_ids) <= 4
            assert len(turn.completion_logprobs) == len(turn.completion_token_ids)
    assert runner.stats.done == 200
    assert runner.stats.turns == 600


async def test_abandoned_episodes_are_closed_aborted_and_live_ones_left_alone(
    store: EventStore, llm: NatsLLMClient
) -> None:
    async with store.engine.begin() as connection:
        await connection.execute(
            sa.insert(runners).values(
                runner_id="dead", host="h", pid=1, heartbeat_at=sa.text("now() - interval '10 minutes'")
            )
        )

    async def open_episode(runner_id: str | None) -> EpisodeSession:
        session = EpisodeSession(store, llm, policy="main", runner_id=runner_id)
        await session.start()
        return session

    async with RunnerLease(store, interval=0.2) as live:
        of_dead = await open_episode("dead")
        of_live = await open_episode(live.runner_id)
        no_runner = await open_episode(None)
        finished = await open_episode("dead")
        await finished.finish("done")
        await asyncio.sleep(0.5)  # the live lease is renewed meanwhile

        closed = await close_abandoned_episodes(store, lease_timeout=30)
        assert closed == [of_dead.stream]
        assert await close_abandoned_episodes(store, lease_timeout=30) == []
        assert await close_abandoned_episodes(store, lease_timeout=30, orphan_after=0) == [no_runner.stream]
    # the lease ended (the runner stopped) with its episode still open: now it is abandoned too
    assert await close_abandoned_episodes(store, lease_timeout=30) == [of_live.stream]

    last = (await store.read_stream(of_dead.stream))[-1].event
    assert last is not None
    assert last.model_dump()["termination"] == "aborted"
    assert "runner dead stopped" in last.model_dump()["error"]
    assert [r.type for r in await store.read_stream(finished.stream)][-1] == "EpisodeFinished"
    assert len(await store.read_stream(finished.stream)) == 2  # not closed twice


async def test_turnstile_run_with_the_calculator_agent_records_every_task(
    servers: Servers, database_url: str
) -> None:
    policy = new_policy()
    config = InferenceConfig(servers.nats_url, policy, backend="scripted", heartbeat_interval=0.5)
    async with serving(config, RuleBackend(calculator_rule)), running(
        *TURNSTILE, "run", "--agent", "pipeline.examples.calculator:CalculatorAgent",
        "--tasks", str(ARITHMETIC_TASKS), "--policy", policy, "--group-size", "2",
        env=env_for(servers, database_url), stderr=asyncio.subprocess.PIPE,
    ) as process:  # fmt: skip
        _, stderr = await asyncio.wait_for(process.communicate(), 120)
    output = stderr.decode()
    assert process.returncode == 0, output
    assert "finished" in output
    assert terminations(database_url) == Counter({"done": 32})
    rewards = query(database_url, "SELECT (data->>'value')::float FROM events WHERE type = 'RewardAssigned'")
    assert [r[0] for r in rewards] == [1.0] * 32  # the rule backend computes every answer right
    turns = query(database_url, "SELECT count(*) FROM events WHERE type = 'TurnCompleted'")
    assert turns[0][0] == 64


async def test_turnstile_run_with_no_inference_consumer_says_why_and_exits_non_zero(
    servers: Servers, database_url: str, tmp_path: Path
) -> None:
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"id": 1}\n{"id": 2}\n')
    async with running(
        *TURNSTILE, "run", "--agent", "tests.support.agents:ThreeTurnAgent", "--tasks", str(tasks),
        "--policy", new_policy(), "--retries", "0",
        env=env_for(servers, database_url), stderr=asyncio.subprocess.PIPE,
    ) as process:  # fmt: skip
        _, stderr = await asyncio.wait_for(process.communicate(), 120)
    output = stderr.decode()
    assert process.returncode == 1, output
    assert "2 episode(s) failed; causes:" in output
    assert "2 x pipeline.inference.client.NoInferenceConsumer: no inference consumer for policy" in output
    assert "(infrastructure: no agent change fixes it)" in output
    assert terminations(database_url) == Counter({"error": 2})


def test_a_long_running_runner_logs_the_first_failure_of_each_kind_and_counts_the_rest(
    caplog: pytest.LogCaptureFixture,
) -> None:
    stats = RunStats()
    causes = [
        "Traceback ...\npipeline.inference.client.NoInferenceConsumer: no inference consumer for policy 'p'",
        "ValueError: the agent could not parse 'x'",
    ]
    with caplog.at_level(logging.WARNING, logger="pipeline.runners.runner"):
        for n, error in enumerate([causes[0], causes[1], causes[0], causes[0], causes[1]]):
            stats.count(EpisodeOutcome(f"e{n}", "error", None, 1, error))
    warned = [r.getMessage() for r in caplog.records]
    assert warned == [
        "episode e0 failed (infrastructure): pipeline.inference.client.NoInferenceConsumer: no inference "
        "consumer for policy 'p'",
        "episode e1 failed (agent): ValueError: the agent could not parse 'x'",
    ]
    assert stats.failed == 5
    assert sorted(stats.causes.values()) == [2, 3]


async def test_turnstile_run_ctrl_c_cancels_open_episodes_cleanly(
    servers: Servers, database_url: str, tmp_path: Path
) -> None:
    policy = new_policy()
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"id": n}) + "\n" for n in range(6)) + "{broken\n")
    config = InferenceConfig(servers.nats_url, policy, backend="scripted", heartbeat_interval=0.5)
    async with serving(config, RuleBackend(echo_rule)), running(
        *TURNSTILE, "run", "--agent", "tests.support.agents:SlowAgent", "--tasks", str(tasks),
        "--policy", policy,
        env=env_for(servers, database_url, TURNSTILE_TEST_AGENT_SLEEP="30"),
        stderr=asyncio.subprocess.PIPE,
    ) as process:  # fmt: skip
        await wait_until(
            lambda: (
                query(database_url, "SELECT count(*) FROM events WHERE type = 'TurnCompleted'")[0][0] == 6
            ),
            60,
            "every episode's first turn",
        )
        process.send_signal(signal.SIGINT)
        _, stderr = await asyncio.wait_for(process.communicate(), 60)
    output = " ".join(stderr.decode().split())  # rich wraps long lines
    assert process.returncode == 130, output
    assert "line 7: not JSON" in output
    assert terminations(database_url) == Counter({"cancelled": 6})
    assert open_episodes(database_url) == 0
    # the summary says what the log holds (it said "cancelled 0": cancelled episodes return no outcome)
    assert re.search(r"cancelled\s*│\s*6\s*│", output), output


async def test_runner_killed_mid_run_its_tasks_are_redelivered_none_lost_none_counted_twice(
    servers: Servers, database_url: str, tmp_path: Path
) -> None:
    policy = new_policy()
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"id": n}) + "\n" for n in range(12)))
    env = env_for(servers, database_url, TURNSTILE_TEST_AGENT_SLEEP="0.4")
    serve = [
        *TURNSTILE, "serve", "runner", "--agent", "tests.support.agents:SlowAgent", "--policy", policy,
        "--concurrency", "8", "--ack-wait", "2", "--lease-timeout", "3",
    ]  # fmt: skip
    config = InferenceConfig(servers.nats_url, policy, backend="scripted", heartbeat_interval=0.5)
    # 30 of the 72 turns are answered, then requests wait at a gate: whatever the machine's speed, the
    # runner is killed with at least 4 episodes done and the ones waiting at the gate open.
    backend = Gated(echo_rule, free=30)
    async with serving(config, backend):
        async with running(
            *TURNSTILE, "submit", str(tasks), "--policy", policy, "--group-size", "2", env=env,
            stderr=asyncio.subprocess.PIPE,
        ) as submit:  # fmt: skip
            _, submitted = await asyncio.wait_for(submit.communicate(), 60)
        assert submit.returncode == 0, submitted.decode()
        assert "submitted 12 tasks" in submitted.decode()

        async with running(*serve, env=env, stderr=asyncio.subprocess.DEVNULL) as first:
            await wait_until(lambda: backend.held >= 1, 120, "a request waiting at the gate")
            assert terminations(database_url)["done"] >= 4
            first.kill()  # SIGKILL: no cleanup at all
            await first.wait()
        killed_with_open = open_episodes(database_url)
        backend.gate.set()

        async with running(*serve, env=env, stderr=asyncio.subprocess.PIPE) as second:
            connection = await nats.connect(servers.nats_url)
            try:

                async def queue_drained() -> bool:
                    info = await connection.jetstream().consumer_info(TASKS_STREAM, runner_durable(policy))
                    return info.num_pending == 0 and info.num_ack_pending == 0

                await wait_until(queue_drained, 90, "every task acked")
            finally:
                await connection.drain()
            second.send_signal(signal.SIGTERM)
            _, log = await asyncio.wait_for(second.communicate(), 60)
            assert second.returncode == 0, log.decode()

    assert killed_with_open > 0  # the kill did leave episodes open
    done = query(
        database_url,
        "SELECT data->>'group_id', count(*) FROM events s WHERE type = 'EpisodeStarted' AND EXISTS "
        "(SELECT 1 FROM events f WHERE f.stream = s.stream AND f.type = 'EpisodeFinished' "
        "AND f.data->>'termination' = 'done') GROUP BY 1",
    )
    assert len(done) == 12  # every task ran...
    assert {count for _, count in done} == {2}  # ...with exactly its group of 2 counted once
    counts = terminations(database_url)
    assert counts["done"] == 24
    assert counts["aborted"] == killed_with_open
    assert set(counts) <= {"done", "aborted"}
    assert open_episodes(database_url) == 0
    turns_of_done = query(
        database_url,
        "SELECT count(*) FROM events t WHERE t.type = 'TurnCompleted' AND EXISTS (SELECT 1 FROM events f "
        "WHERE f.stream = t.stream AND f.type = 'EpisodeFinished' AND f.data->>'termination' = 'done')",
    )
    assert turns_of_done[0][0] == 24 * 3


def test_failed_episodes_are_counted_in_metrics_by_kind_of_error_not_by_message() -> None:
    from collections import Counter

    from consumers.runner import _by_kind
    from pipeline.runners.runner import RunStats

    stats = RunStats(
        causes=Counter({"ValueError: boom": 2, "ValueError: other": 1, "InferenceTimeout: 30 s": 1})
    )
    assert _by_kind(stats) == {("ValueError",): 3.0, ("InferenceTimeout",): 1.0}


def test_rewards_are_summed_by_sign_so_that_each_metric_only_grows() -> None:
    from pipeline.episodes import EpisodeOutcome
    from pipeline.runners.runner import RunStats

    stats = RunStats()
    totals = []
    for n, reward in enumerate([2.0, -1.0, -3.0, None, 0.5]):
        stats.count(EpisodeOutcome(f"e{n}", "done", reward, turns=1))
        totals.append((stats.reward_gained, stats.reward_lost, stats.rewards))
    assert totals == [(2, 0, 1), (2, 1, 2), (2, 4, 3), (2, 4, 3), (2.5, 4, 4)]  # never down
    assert stats.reward_sum == 2.5 - 4
    assert stats.mean_reward == (2.5 - 4) / 4


class GatedAgent:
    """One turn, then waits for ``release``: a task still running when its delivery runs out."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.started = 0

    async def run(self, task: dict[str, Any], llm: Any) -> float:
        self.started += 1
        await llm.chat([{"role": "user", "content": "hello"}])
        await self.release.wait()
        return 1.0


async def test_a_task_delivered_again_to_the_runner_still_running_it_is_not_run_twice(
    servers: Servers, store: EventStore, llm: NatsLLMClient, database_url: str
) -> None:
    policy = new_policy()
    agent = GatedAgent()
    config = RunnerConfig(policy=policy, agent_name="GatedAgent", group_size=2)
    connection = await nats.connect(servers.nats_url)
    stop = asyncio.Event()
    try:
        async with serving(
            InferenceConfig(servers.nats_url, policy, backend="scripted"), RuleBackend(echo_rule)
        ):
            worker = TaskWorker(Runner(agent, store=store, llm=llm, config=config), connection, ack_wait=1.0)
            worker.running = SilentTasks(worker.ack_wait)
            await submit_tasks(connection, policy, [TaskSpec(task={"id": 1}, task_id="t1")], group_size=2)
            working = asyncio.create_task(worker.run(stop))
            await wait_until(lambda: worker.running.joined >= 2, 60, "the task delivered again, twice")
            agent.release.set()
            await wait_until(lambda: worker.tasks_done == 1, 60, "the task done and acked")

            async def queue_drained() -> bool:
                info = await connection.jetstream().consumer_info(TASKS_STREAM, runner_durable(policy))
                return info.num_pending == 0 and info.num_ack_pending == 0

            await wait_until(queue_drained, 30, "the latest delivery acked")
            stop.set()
            await asyncio.wait_for(working, 30)
    finally:
        stop.set()
        await connection.drain()
    assert agent.started == 2  # each slot once: no attempt closed aborted and run again
    finished = query(database_url, "SELECT data->>'termination' FROM events WHERE type = 'EpisodeFinished'")
    assert finished == [("done",), ("done",)]
