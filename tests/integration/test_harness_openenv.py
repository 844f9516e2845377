"""The harness's OpenEnv face (pipeline/harness/openenv.py) against the real ``openenv`` package and TRL's
harness worker's own mapping: a real episode (a ``turnstile serve gateway`` process, PostgreSQL, NATS, the
scripted tiny model, the command agent in a process sandbox, the task's real verifier) read back as OpenEnv
``TrainingTurn``s with the engine's exact tokens, and what TRL would train on it."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

pytest.importorskip("openenv", reason="pip install -e '.[openenv]'")

from openenv.core.harness import TrainableSession, TrainingTrace
from trl.experimental.async_grpo.async_rollout_worker import _chain_to_sequences
from trl.experimental.async_grpo.openenv_harness import _turns_from_training_trace

from pipeline.harness import backend
from pipeline.harness.openenv import RolloutFailed, TurnstileSessionFactory
from pipeline.log import EventStore
from schemas import EpisodeFinished, EpisodeStarted, RewardAssigned, TurnCompleted
from tests.conftest import Servers
from tests.support.agent_gateway import agent_gateway, episode_events
from tests.support.harness import EXAMPLE_TASKS, SCRIPT, harness_config, owned_sandboxes
from tests.support.waiting import wait_until

pytestmark = pytest.mark.openenv


async def test_an_episode_the_harness_ran_is_an_openenv_training_trace_trl_chains_token_exact(
    servers: Servers, database_url: str, store: EventStore, tiny_model_dir: Path, tmp_path: Path
) -> None:
    async with agent_gateway(servers.nats_url, database_url, tiny_model_dir, SCRIPT) as gateway:
        factory = await asyncio.to_thread(
            TurnstileSessionFactory, harness_config(gateway, tmp_path), backend("none"), database_url,
            sampling={"temperature": 0.5},
        )  # fmt: skip
        try:
            session = await asyncio.to_thread(factory.create, str(EXAMPLE_TASKS / "write-greeting"), seed=7)
            assert isinstance(session, TrainableSession)  # what TRL's worker checks before it trains
            assert await asyncio.to_thread(session.wait_for_completion) == 0
            trace = await asyncio.to_thread(session.fetch_training_trace)
            verdict = await asyncio.to_thread(session.verify, [])
            await asyncio.to_thread(session.close)
        finally:
            await asyncio.to_thread(factory.close)

    assert isinstance(trace, TrainingTrace)
    assert verdict.env_reward == 1.0  # the verifier's: greeting.txt was written
    session_id = session.attempt.session_id
    assert session_id is not None
    events = await episode_events(store, session_id)
    recorded = [e for e in events if isinstance(e, TurnCompleted)]
    assert [e.value for e in events if isinstance(e, RewardAssigned)] == [1.0]
    assert len(trace.turns) == len(recorded) == 2  # the command, then the answer
    for turn, whole in zip(trace.turns, recorded, strict=True):
        assert turn.node_id == str(whole.turn_id)
        assert turn.prompt_token_ids == whole.prompt_token_ids  # the engine's ids, never re-tokenized
        assert turn.completion_token_ids == whole.completion_token_ids
        assert turn.per_token_logps == whole.completion_logprobs
        assert turn.loss_mask == [0] * len(whole.prompt_token_ids) + [1] * len(whole.completion_token_ids)
        assert turn.metadata["policy_version"] == whole.policy_version
        assert turn.metadata["sampling_params"]["temperature"] == 0.5  # TRL's sampling, the session's default
    assert (
        trace.turns[0].response["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "run_shell"
    )

    # what TRL's harness worker does with it: one training row, the second turn appended to the first cleanly
    sequences, tally = _chain_to_sequences(_turns_from_training_trace(trace), "rollout", 0)
    assert len(sequences) == 1
    assert (tally["transitions"], tally["clean"], tally["fork"]) == (1.0, 1.0, 0.0)


async def test_an_infrastructure_failure_is_unscorable_not_a_reward_of_0(
    servers: Servers, database_url: str, store: EventStore, tiny_model_dir: Path, tmp_path: Path
) -> None:
    async with agent_gateway(servers.nats_url, database_url, tiny_model_dir, SCRIPT) as gateway:
        unreachable = harness_config(gateway, tmp_path, sandbox_gateway="127.0.0.1:9")
        factory = await asyncio.to_thread(TurnstileSessionFactory, unreachable, backend("none"), database_url)
        try:
            session = await asyncio.to_thread(
                factory.create, {"id": "fix", "instruction": "x", "verifier": "true"}
            )
            with pytest.raises(RolloutFailed, match="without a single LLM call"):
                await asyncio.to_thread(session.wait_for_completion)
            verdict = await asyncio.to_thread(session.verify, [])
            await asyncio.to_thread(session.close)
        finally:
            await asyncio.to_thread(factory.close)
    assert verdict.env_reward is None  # unscored: TRL keeps it out of the group's baseline
    assert session.attempt.session_id is not None
    events = await episode_events(store, session.attempt.session_id)
    assert not [e for e in events if isinstance(e, RewardAssigned)]


async def test_closing_a_running_session_ends_its_episode_cancelled_and_removes_its_sandbox(
    servers: Servers, database_url: str, store: EventStore, tiny_model_dir: Path, tmp_path: Path
) -> None:
    waiting = {
        "id": "wait",
        "instruction": "Wait a long time.",
        "verifier": "true",
    }  # the agent runs sleep 600
    async with agent_gateway(servers.nats_url, database_url, tiny_model_dir, SCRIPT) as gateway:
        config = harness_config(gateway, tmp_path)
        factory = await asyncio.to_thread(TurnstileSessionFactory, config, backend("none"), database_url)
        try:
            session = await asyncio.to_thread(factory.create, waiting, seed=3, episode_id="rollout-1")
            await wait_until(lambda: bool(owned_sandboxes(config.owner)), 120, "the episode's sandbox")
            with pytest.raises(TimeoutError):  # still running: the agent sleeps
                await asyncio.to_thread(session.wait_for_completion, 1.0)
            await asyncio.to_thread(session.close)
        finally:
            await asyncio.to_thread(factory.close)
    assert session.attempt.outcome == "cancelled"
    assert owned_sandboxes(config.owner) == []
    assert session.attempt.session_id is not None
    events = await episode_events(store, session.attempt.session_id)
    started, finished = events[0], events[-1]
    assert isinstance(started, EpisodeStarted)
    assert (started.tags["openenv_seed"], started.tags["openenv_rollout"]) == ("3", "rollout-1")
    assert isinstance(finished, EpisodeFinished)
    assert finished.termination == "cancelled"
    assert not [e for e in events if isinstance(e, RewardAssigned)]
