"""Episode sessions and the agent contract, on real PostgreSQL and NATS with rule-driven backends."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from consumers.inference import InferenceConfig
from pipeline.episodes import EpisodeLLM, EpisodeSession, InvalidLLMCall, fold_episode, run_episode
from pipeline.episodes.fold import whole_events
from pipeline.errors import ConfigError, EpisodeExists
from pipeline.examples import ARITHMETIC_TASKS
from pipeline.examples.calculator import MALFORMED_TOOL_CALL, CalculatorAgent
from pipeline.examples.openai_agent import OpenAIAgent
from pipeline.examples.single_turn import SingleTurnAgent
from pipeline.inference.client import NatsLLMClient
from pipeline.log import EventStore
from pipeline.log.store import APPEND_LOCK
from pipeline.runners import load_agent, load_reward_function
from pipeline.runners.runner import Runner, RunnerConfig, TaskLineError, TaskSpec, read_tasks, run_tasks
from pipeline.settings import libpq_url
from schemas import EpisodeFinished, EpisodeStarted, Event, RewardAssigned, TurnCompleted
from tests.conftest import Servers
from tests.support.agents import FailingAgent, ThreeTurnAgent, length_reward
from tests.support.backends import PrefixEcho, RuleBackend, calculator_rule, echo_rule
from tests.support.serving import serving
from tests.support.waiting import wait_until


def new_policy() -> str:
    return f"p{uuid.uuid4().hex[:10]}"


@pytest.fixture
async def llm(servers: Servers) -> AsyncIterator[NatsLLMClient]:
    client = await NatsLLMClient.connect(servers.nats_url, heartbeat_timeout=2.0, wait_for_consumer=5.0)
    yield client
    await client.close()


@pytest.fixture
async def calculator_policy(servers: Servers) -> AsyncIterator[str]:
    policy = new_policy()
    config = InferenceConfig(servers.nats_url, policy, backend="scripted", heartbeat_interval=0.5)
    async with serving(config, RuleBackend(calculator_rule)):
        yield policy


@pytest.fixture
async def echo_policy(servers: Servers) -> AsyncIterator[str]:
    policy = new_policy()
    config = InferenceConfig(servers.nats_url, policy, backend="scripted", heartbeat_interval=0.5)
    async with serving(config, RuleBackend(echo_rule)):
        yield policy


async def events_of(store: EventStore, episode_id: str) -> list[Event]:
    recorded = await store.read_stream(f"episode-{episode_id}")
    return whole_events([r.event for r in recorded if r.event is not None])


def session(store: EventStore, llm: NatsLLMClient, policy: str, **options: Any) -> EpisodeSession:
    return EpisodeSession(store, llm, policy=policy, agent="tests", task_id="t", **options)


async def test_calculator_agent_records_tool_turns_with_parents_and_token_exact_prompts(
    store: EventStore, llm: NatsLLMClient, calculator_policy: str
) -> None:
    episode = session(store, llm, calculator_policy, task={"question": "What is 17 * 3?", "answer": 51})
    outcome = await run_episode(CalculatorAgent(), episode)

    assert (outcome.termination, outcome.reward, outcome.turns) == ("done", 1.0, 2)
    events = await events_of(store, episode.episode_id)
    assert [type(e).__name__ for e in events] == [
        "EpisodeStarted", "TurnCompleted", "TurnCompleted", "RewardAssigned", "EpisodeFinished",
    ]  # fmt: skip
    first, second = events[1], events[2]
    assert isinstance(first, TurnCompleted)
    assert isinstance(second, TurnCompleted)
    assert first.parent_turn_id is None
    assert second.parent_turn_id == first.turn_id
    assert first.reply.tool_calls[0].function.arguments == '{"expression": "17 * 3"}'
    assert first.request.tools[0].function.name == "calculate"
    tool_message = second.request.messages[-1]
    assert (tool_message.role, tool_message.content) == ("tool", "51")
    assert tool_message.tool_call_id == first.reply.tool_calls[0].id
    # the second prompt is the first turn's exact tokens, then the new messages' tokens only
    assert second.prompt_token_ids[: len(first.prompt_token_ids) + len(first.completion_token_ids)] == [
        *first.prompt_token_ids,
        *first.completion_token_ids,
    ]
    assert second.reply.text == "The answer is 51."
    finished = events[-1]
    assert isinstance(finished, EpisodeFinished)
    assert finished.metrics["turns"] == 2
    assert finished.metrics["reward"] == 1.0


async def test_each_turn_is_in_the_log_before_the_agent_gets_the_reply(
    store: EventStore, llm: NatsLLMClient, echo_policy: str
) -> None:
    seen: list[int] = []

    class Checking:
        async def run(self, task: dict[str, Any], llm: EpisodeLLM) -> float:
            for n in range(3):
                reply = await llm.chat([{"role": "user", "content": f"turn {n}"}])
                recorded = await events_of(store, llm.episode_id)
                seen.append(
                    sum(isinstance(e, TurnCompleted) and e.turn_id == reply.turn_id for e in recorded)
                )
            return 1.0

    episode = session(store, llm, echo_policy)
    await run_episode(Checking(), episode)
    assert seen == [1, 1, 1]


async def test_malformed_tool_call_gets_a_tool_error_back_and_both_are_recorded(
    store: EventStore, llm: NatsLLMClient, calculator_policy: str
) -> None:
    episode = session(store, llm, calculator_policy, task={"question": "malformed 1+1", "answer": 2})
    outcome = await run_episode(CalculatorAgent(max_turns=2), episode)

    assert (outcome.termination, outcome.reward, outcome.turns) == ("done", 0.0, 2)
    turns = [e for e in await events_of(store, episode.episode_id) if isinstance(e, TurnCompleted)]
    assert turns[0].reply.tool_calls == []
    assert "<tool_call>" in turns[0].reply.text
    assert turns[1].request.messages[-1].content == MALFORMED_TOOL_CALL
    assert turns[1].parent_turn_id == turns[0].turn_id


async def test_agent_that_raises_ends_in_error_with_its_traceback(
    store: EventStore, llm: NatsLLMClient, echo_policy: str
) -> None:
    episode = session(store, llm, echo_policy, task={"id": "x", "fail": True})
    outcome = await run_episode(FailingAgent(), episode)

    assert outcome.termination == "error"
    assert outcome.turns == 1
    finished = (await events_of(store, episode.episode_id))[-1]
    assert isinstance(finished, EpisodeFinished)
    assert finished.termination == "error"
    assert finished.error is not None
    assert "RuntimeError: agent broke on task x" in finished.error
    assert "Traceback" in finished.error


async def test_max_turns_timeout_and_truncation_terminations(
    store: EventStore, llm: NatsLLMClient, echo_policy: str
) -> None:
    limited = session(store, llm, echo_policy, max_turns=2)
    outcome = await run_episode(ThreeTurnAgent(), limited)
    assert (outcome.termination, outcome.turns) == ("max_turns", 2)

    class Sleeper:
        async def run(self, task: dict[str, Any], llm: EpisodeLLM) -> None:
            await llm.chat([{"role": "user", "content": "hi"}])
            await asyncio.sleep(30)

    timed = session(store, llm, echo_policy)
    outcome = await run_episode(Sleeper(), timed, timeout=0.5)
    assert (outcome.termination, outcome.turns) == ("timeout", 1)
    finished = (await events_of(store, timed.episode_id))[-1]
    assert isinstance(finished, EpisodeFinished)
    assert "timeout of 0.5 s" in (finished.error or "")


async def test_rewards_per_turn_from_a_reward_function_and_a_wrong_return_type(
    store: EventStore, llm: NatsLLMClient, echo_policy: str
) -> None:
    class PerTurn:
        async def run(self, task: dict[str, Any], llm: EpisodeLLM) -> dict[str, float]:
            a = await llm.chat([{"role": "user", "content": "a"}])
            b = await llm.chat([{"role": "user", "content": "b"}])
            return {str(a.turn_id): 0.25, str(b.turn_id): 0.75}

    per_turn = session(store, llm, echo_policy)
    await run_episode(PerTurn(), per_turn)
    rewards = [e for e in await events_of(store, per_turn.episode_id) if isinstance(e, RewardAssigned)]
    turn_ids = [t.turn_id for t in per_turn.turns]
    assert [(r.turn_id, r.value) for r in rewards] == [(turn_ids[0], 0.25), (turn_ids[1], 0.75)]

    scored = session(store, llm, echo_policy)
    outcome = await run_episode(
        load_agent("tests.support.agents:function_agent"), scored, reward_fn=length_reward
    )
    assert outcome.reward == 1.0  # length_reward: one turn
    reward = next(e for e in await events_of(store, scored.episode_id) if isinstance(e, RewardAssigned))
    assert reward.source == "reward_fn"

    class Wrong:
        async def run(self, task: dict[str, Any], llm: EpisodeLLM) -> Any:
            return "great"

    wrong = session(store, llm, echo_policy)
    outcome = await run_episode(Wrong(), wrong)
    assert outcome.termination == "error"
    assert "returned str" in (outcome.error or "")


async def test_bad_llm_calls_are_refused_with_what_was_wrong(
    store: EventStore, llm: NatsLLMClient, echo_policy: str
) -> None:
    episode = session(store, llm, echo_policy)
    await episode.start()
    with pytest.raises(InvalidLLMCall, match=r"messages\.0\.role"):
        await episode.llm.chat([{"role": "robot", "content": "hi"}])
    with pytest.raises(InvalidLLMCall, match="max_tokens"):
        await episode.llm.chat([{"role": "user", "content": "hi"}], max_tokens=0)
    with pytest.raises(InvalidLLMCall, match=r"messages\.0\.content holds a NUL character"):
        await episode.llm.chat([{"role": "user", "content": "binary \x00 junk"}])
    with pytest.raises(InvalidLLMCall, match="no such turn"):
        await episode.reward(1.0, uuid.uuid4())
    reply = await episode.llm.chat([{"role": "user", "content": "still fine"}])
    assert reply.text == "reply 1"
    assert [type(e).__name__ for e in await events_of(store, episode.episode_id)] == [
        "EpisodeStarted",
        "TurnCompleted",
    ]


async def test_openai_sdk_agent_runs_unchanged_through_llm_openai(
    store: EventStore, llm: NatsLLMClient, calculator_policy: str
) -> None:
    episode = session(store, llm, calculator_policy, task={"question": "What is 6 * 7?", "answer": 42})
    outcome = await run_episode(OpenAIAgent(), episode)

    assert (outcome.termination, outcome.reward, outcome.turns) == ("done", 1.0, 2)
    turns = [e for e in await events_of(store, episode.episode_id) if isinstance(e, TurnCompleted)]
    assert turns[0].reply.tool_calls[0].function.name == "calculate"
    assert turns[0].request.sampling.max_tokens == 64
    assert turns[1].parent_turn_id == turns[0].turn_id  # the SDK's messages continue the recorded turn
    assert turns[1].request.messages[-1].role == "tool"


async def test_runner_goes_on_past_failing_agents_and_bad_task_lines(
    store: EventStore, llm: NatsLLMClient, echo_policy: str, tmp_path: Path
) -> None:
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"id": "a"}\n{"id": "b", "fail": true}\nnot json at all\n\n[1, 2]\n{"id": "c"}\n')
    config = RunnerConfig(
        policy=echo_policy, agent_name="tests.support.agents:FailingAgent", retries=1, group_size=2
    )
    runner = Runner(FailingAgent(), store=store, llm=llm, config=config)
    errors: list[TaskLineError] = []
    outcomes = await run_tasks(runner, read_tasks(tasks), on_task_error=errors.append)

    assert [(e.line, e.message.split(" (")[0]) for e in errors] == [
        (3, "not JSON"),
        (5, "a task is a JSON object, got list"),
    ]
    by_task: dict[str, list[str]] = {}
    for outcome in outcomes:
        started = (await events_of(store, outcome.episode_id))[0]
        assert isinstance(started, EpisodeStarted)
        by_task.setdefault(started.task_id, []).append(outcome.termination)
    assert by_task == {"a": ["done", "done"], "b": ["error", "error"], "c": ["done", "done"]}
    failed = [o for o in outcomes if o.termination == "error"]
    assert all(o.retry_of is not None for o in failed)  # each is the retry of a first failed attempt
    first_attempts = {o.retry_of for o in failed}
    for episode_id in first_attempts:
        assert episode_id is not None
        assert isinstance((await events_of(store, episode_id))[-1], EpisodeFinished)
    assert runner.stats.retried == 2
    assert runner.stats.failed == 2
    assert runner.stats.done == 4


async def test_an_episode_id_the_log_holds_is_refused_before_the_agent_runs(
    store: EventStore, llm: NatsLLMClient, echo_policy: str
) -> None:
    taken = session(store, llm, echo_policy, task={"question": "2 + 2", "answer": "4"})
    await run_episode(SingleTurnAgent(), taken)
    recorded = await store.read_all()
    again = session(store, llm, echo_policy, episode_id=taken.episode_id)
    with pytest.raises(EpisodeExists) as refused:
        await run_episode(SingleTurnAgent(), again)
    stream = f"episode-{taken.episode_id}"
    assert str(refused.value).startswith(
        f"episode {taken.episode_id!r} already exists: stream {stream!r} holds it ({len(recorded)} events)"
    )
    assert await store.read_all() == recorded  # nothing of the second episode was recorded


def test_example_task_file_parses_and_agents_load() -> None:
    specs = list(read_tasks(ARITHMETIC_TASKS))
    assert len(specs) == 16
    assert all(isinstance(s, TaskSpec) and "answer" in s.task for s in specs)
    assert isinstance(load_agent("pipeline.examples.single_turn:SingleTurnAgent"), SingleTurnAgent)
    assert load_reward_function("tests.support.agents:length_reward") is length_reward


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("nope", "write it as package.module:Name"),
        ("tests.no_such_module:Agent", "cannot import module 'tests.no_such_module'"),
        ("tests.support.agents:Missing", "has no 'Missing'"),
        ("tests.support.agents:NOT_AN_AGENT", "expected an object with `async def run"),
    ],
)
def test_unknown_agent_paths_say_what_is_wrong(spec: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("`", "`")):
        load_agent(spec)


def test_fold_episode_requires_a_start() -> None:
    with pytest.raises(Exception, match="must begin with EpisodeStarted"):
        fold_episode([EpisodeFinished(termination="done")])


async def test_a_nul_character_from_the_model_is_recorded_as_the_replacement_character(
    servers: Servers, store: EventStore, llm: NatsLLMClient
) -> None:
    policy = new_policy()
    config = InferenceConfig(servers.nats_url, policy, backend="scripted", heartbeat_interval=0.5)
    async with serving(config, RuleBackend(lambda request: "a\x00b")):
        episode = session(store, llm, policy)
        outcome = await run_episode(load_agent("tests.support.agents:function_agent"), episode)
    assert outcome.termination == "done"
    turn = (await events_of(store, episode.episode_id))[1]
    assert isinstance(turn, TurnCompleted)
    assert turn.reply.text == "a\ufffdb"
    assert turn.completion_token_ids[1] == 3  # the tokens keep the byte 0 (RuleBackend: 3 + byte)


async def test_cancelled_while_recording_rewards_the_episode_still_ends_cancelled(
    store: EventStore, llm: NatsLLMClient, echo_policy: str
) -> None:
    scoring = asyncio.Event()

    async def slow_reward(task: dict[str, Any], episode: Any) -> float:
        scoring.set()
        await asyncio.sleep(60)  # cancelled here: after the agent, before the reward and the finish
        return 1.0

    episode = session(store, llm, echo_policy)
    running = asyncio.create_task(
        run_episode(load_agent("tests.support.agents:function_agent"), episode, reward_fn=slow_reward)
    )
    await asyncio.wait_for(scoring.wait(), 10)
    running.cancel()
    with pytest.raises(asyncio.CancelledError):
        await running
    events = await events_of(store, episode.episode_id)
    assert [type(e).__name__ for e in events] == ["EpisodeStarted", "TurnCompleted", "EpisodeFinished"]
    finished = events[-1]
    assert isinstance(finished, EpisodeFinished)
    assert finished.termination == "cancelled"


def appends_waiting_for_the_lock(database_url: str) -> int:
    """How many transactions wait for the append lock (PostgreSQL's own view of its locks)."""
    with psycopg.connect(libpq_url(database_url)) as connection:
        row = connection.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted AND database = "
            "(SELECT oid FROM pg_database WHERE datname = current_database())"
        ).fetchone()
    return int(row[0]) if row else 0


async def test_a_turn_whose_agent_is_cancelled_while_its_append_waits_leaves_the_stream_whole(
    store: EventStore, database_url: str
) -> None:
    """The real store, its append lock held by another connection: the agent is cancelled while its second
    turn's append waits for PostgreSQL, and the episode is ended ``cancelled`` meanwhile. Once the lock is
    free both appends go to the server, in either order: the turn then the end (the end refused at first,
    written after the turn it catches up with) or the end alone (the late turn refused). The stream is whole
    either way, and the session knows it as the log has it."""
    session = EpisodeSession(store, PrefixEcho(), policy="main")
    await session.start()
    first = await session.chat([{"role": "user", "content": "a"}])
    with psycopg.connect(libpq_url(database_url), autocommit=True) as holder:
        holder.execute("SELECT pg_advisory_lock(%s)", (APPEND_LOCK,))
        second = asyncio.create_task(
            session.chat([{"role": "user", "content": "a"}, first.message, {"role": "user", "content": "b"}])
        )
        await wait_until(lambda: appends_waiting_for_the_lock(database_url) > 0, 60, "the turn's append")
        second.cancel()
        with pytest.raises(asyncio.CancelledError):
            await second
        finishing = asyncio.create_task(session.finish("cancelled"))
        await asyncio.sleep(0)  # the end may reach the store before the lock is free or after it
        holder.execute("SELECT pg_advisory_unlock(%s)", (APPEND_LOCK,))
    await asyncio.wait_for(finishing, 60)
    recorded = await store.read_stream(session.stream)
    kinds = [record.type for record in recorded]
    assert kinds in (
        ["EpisodeStarted", "TurnCompleted", "TurnCompleted", "EpisodeFinished"],
        ["EpisodeStarted", "TurnCompleted", "EpisodeFinished"],
    ), kinds
    assert [record.version for record in recorded] == list(range(1, len(recorded) + 1))
    assert session.finished
    assert [type(event).__name__ for event in session.events] == kinds  # the session's view is the log's
