"""AgentEnvironment (reset/step): recorded exactly like runner episodes; gather; close mid-episode."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from consumers.inference import InferenceConfig
from pipeline.episodes.environment import AgentEnvironment, StepType
from pipeline.episodes.fold import whole_events
from pipeline.inference.client import NatsLLMClient
from pipeline.log import EventStore
from pipeline.runners.runner import Runner, RunnerConfig, TaskSpec
from schemas import EpisodeFinished, EpisodeStarted, Event, RewardAssigned, SamplingParams, TurnCompleted
from tests.conftest import Servers
from tests.support.agents import ThreeTurnAgent
from tests.support.backends import RuleBackend, echo_rule
from tests.support.serving import serving

GREEDY = SamplingParams(temperature=0.0, max_tokens=6)


@pytest.fixture
async def llm(servers: Servers) -> AsyncIterator[NatsLLMClient]:
    client = await NatsLLMClient.connect(servers.nats_url, heartbeat_timeout=5.0, wait_for_consumer=5.0)
    yield client
    await client.close()


async def events_of(store: EventStore, episode_id: str) -> list[Event]:
    recorded = await store.read_stream(f"episode-{episode_id}")
    return whole_events([r.event for r in recorded if r.event is not None])


def comparable(events: list[Event]) -> list[dict[str, Any]]:
    """An episode's events without what differs between two recordings of the same run (ids, clocks)."""
    turn_index = {e.turn_id: n for n, e in enumerate(x for x in events if isinstance(x, TurnCompleted))}
    out = []
    for event in events:
        data = event.model_dump(mode="json", exclude={"event_id"})
        if isinstance(event, EpisodeStarted):
            data = event.model_dump(mode="json", include={"task", "task_id", "policy", "sampling", "agent"})
        elif isinstance(event, TurnCompleted):
            data.pop("timings")
            data["turn_id"] = turn_index[event.turn_id]
            data["parent_turn_id"] = turn_index.get(event.parent_turn_id) if event.parent_turn_id else None
        elif isinstance(event, RewardAssigned):
            data["turn_id"] = turn_index.get(event.turn_id) if event.turn_id else None
        elif isinstance(event, EpisodeFinished):
            data["metrics"] = {k: v for k, v in event.metrics.items() if not k.endswith("_s")}
        out.append(data)
    return out


async def test_env_episode_equals_runner_episode_event_for_event_on_the_tiny_model(
    servers: Servers, store: EventStore, llm: NatsLLMClient, tiny_model_dir: Path
) -> None:
    policy = f"p{uuid.uuid4().hex[:10]}"
    config = InferenceConfig(
        servers.nats_url, policy, backend="torch", model=tiny_model_dir, consumer_id="c1"
    )
    task = {"id": "same", "reward": 0.5}
    async with serving(config):
        runner_config = RunnerConfig(policy=policy, agent_name="ThreeTurnAgent", sampling=GREEDY)
        runner = Runner(ThreeTurnAgent(), store=store, llm=llm, config=runner_config)
        [by_runner] = await runner.run_group(TaskSpec(task=task, task_id="same"))

        env = AgentEnvironment(
            ThreeTurnAgent(), task, store=store, policy=policy, task_id="same", agent_name="ThreeTurnAgent",
            sampling=GREEDY,
        )  # fmt: skip
        steps = [await env.reset()]
        while not steps[-1].last():
            observation = steps[-1].observation
            assert observation is not None
            steps.append(await env.step(await llm(observation)))

    assert [s.step_type for s in steps] == [StepType.FIRST, StepType.MID, StepType.MID, StepType.LAST]
    assert steps[-1].reward == 0.5
    assert steps[0].reward is None
    assert steps[1].observation is not None
    assert steps[1].observation.prefix is not None
    assert env.episode_id is not None
    assert env.outcome is not None
    assert env.outcome.termination == "truncated"
    from_runner = comparable(await events_of(store, by_runner.episode_id))
    from_env = comparable(await events_of(store, env.episode_id))
    assert len(from_env) == 6
    assert from_env == from_runner
    turns = [e for e in await events_of(store, env.episode_id) if isinstance(e, TurnCompleted)]
    assert all(
        t.completion_token_ids and len(t.completion_logprobs) == len(t.completion_token_ids) for t in turns
    )


async def test_many_environments_with_gather_and_close_mid_episode_is_cancelled(
    servers: Servers, store: EventStore, llm: NatsLLMClient
) -> None:
    policy = f"p{uuid.uuid4().hex[:10]}"
    config = InferenceConfig(servers.nats_url, policy, backend="scripted", heartbeat_interval=0.5)
    async with serving(config, RuleBackend(echo_rule)):

        async def play(n: int) -> float | None:
            env = AgentEnvironment(ThreeTurnAgent(), {"id": n, "reward": n}, store=store, policy=policy)
            step = await env.reset()
            while not step.last():
                assert step.observation is not None
                step = await env.step(await llm(step.observation))
            return step.reward

        rewards = await asyncio.gather(*(play(n) for n in range(20)))
        assert rewards == [float(n) for n in range(20)]

        env = AgentEnvironment(ThreeTurnAgent(), {"id": "stop"}, store=store, policy=policy)
        step = await env.reset()
        assert step.observation is not None
        step = await env.step(await llm(step.observation))
        assert step.mid()
        await env.close()
        assert env.episode_id is not None
        events = await events_of(store, env.episode_id)
        assert [type(e).__name__ for e in events] == ["EpisodeStarted", "TurnCompleted", "EpisodeFinished"]
        finished = events[-1]
        assert isinstance(finished, EpisodeFinished)
        assert finished.termination == "cancelled"

        with pytest.raises(Exception, match="no LLM request is waiting"):
            await env.step(await llm(step.observation))  # type: ignore[arg-type]
