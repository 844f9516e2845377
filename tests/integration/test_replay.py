"""`turnstile replay` and `turnstile episodes`: transcripts, time travel and reruns, from the log.

Episodes are recorded for real (EpisodeSession -> NATS -> a rule-driven inference consumer -> PostgreSQL);
the commands run as a user runs them, in a process of their own with TURNSTILE_DATABASE_URL set.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from consumers.inference import InferenceConfig
from pipeline.batches.format import unpack_arrays
from pipeline.episodes import Agent, EpisodeSession, expand_turns, fold_episode, run_episode
from pipeline.episodes.fold import whole_events
from pipeline.errors import WrongExpectedVersion
from pipeline.examples.calculator import CalculatorAgent
from pipeline.examples.openai_agent import OpenAIAgent
from pipeline.inference.client import NatsLLMClient
from pipeline.log import EventStore, InMemoryStore
from pipeline.materialize.config import MaterializerConfig
from pipeline.materialize.writer import Materializer
from pipeline.replay import (
    EpisodeFilter,
    compare_request,
    list_episodes,
    load_episode,
    parse_since,
    rerun_by_id,
    rerun_episode,
    token_text,
)
from pipeline.settings import libpq_url
from schemas import (
    ChatMessage,
    EpisodeFinished,
    EpisodeStarted,
    Event,
    LLMRequest,
    RewardAssigned,
    SamplingParams,
    ToolSpec,
    TurnCompleted,
    TurnEdit,
    TurnReply,
    TurnRequest,
)
from tests.conftest import Servers
from tests.support.backends import RuleBackend, calculator_rule, echo_rule
from tests.support.replay_agents import (
    CountingAgent,
    ListeningCountingAgent,
    LongAgent,
    RewordedCountingAgent,
)
from tests.support.serving import serving

TURNSTILE = [sys.executable, "-m", "consumers.cli"]
CALCULATOR = "pipeline.examples.calculator:CalculatorAgent"
COUNTING = "tests.support.replay_agents:CountingAgent"
LONG = "tests.support.replay_agents:LongAgent"
OPENAI_AGENT = "pipeline.examples.openai_agent:OpenAIAgent"


def turnstile(database_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TURNSTILE_")}
    return subprocess.run(
        [*TURNSTILE, *args],
        capture_output=True,
        text=True,
        env={**env, "TURNSTILE_DATABASE_URL": database_url},
        timeout=120,
    )


def event_count(database_url: str) -> int:
    with psycopg.connect(libpq_url(database_url)) as connection:
        row = connection.execute("SELECT count(*) FROM events").fetchone()
    assert row is not None
    return int(row[0])


@pytest.fixture
async def llm(servers: Servers) -> AsyncIterator[NatsLLMClient]:
    client = await NatsLLMClient.connect(servers.nats_url, heartbeat_timeout=2.0, wait_for_consumer=5.0)
    yield client
    await client.close()


@pytest.fixture
async def policy(servers: Servers) -> AsyncIterator[str]:
    """A policy served by a consumer that uses the calculator when asked arithmetic, else echoes."""
    name = f"p{uuid.uuid4().hex[:10]}"

    def rule(request: LLMRequest) -> str:
        question = next(m.content or "" for m in request.messages if m.role == "user")
        return calculator_rule(request) if question.startswith("What is") else echo_rule(request)

    config = InferenceConfig(servers.nats_url, name, backend="scripted", heartbeat_interval=0.5)
    async with serving(config, RuleBackend(rule)):
        yield name


async def record(
    store: EventStore,
    llm: NatsLLMClient,
    policy: str,
    agent: Agent,
    *,
    agent_name: str,
    task: dict[str, Any],
    episode_id: str | None = None,
) -> str:
    session = EpisodeSession(
        store, llm, policy=policy, agent=agent_name, task=task, task_id=str(task.get("id", "t")),
        episode_id=episode_id,
    )  # fmt: skip
    outcome = await run_episode(agent, session)
    assert outcome.termination == "done", outcome.error
    return session.episode_id


async def calculator_episode(store: EventStore, llm: NatsLLMClient, policy: str, **options: Any) -> str:
    task = {"id": "arith-t", "question": "What is 17 * 3?", "answer": 51}
    return await record(store, llm, policy, CalculatorAgent(), agent_name=CALCULATOR, task=task, **options)


async def test_transcript_shows_each_turn_its_tool_call_and_the_reward(
    store: EventStore, llm: NatsLLMClient, policy: str, database_url: str
) -> None:
    episode_id = await calculator_episode(store, llm, policy)

    shown = turnstile(database_url, "replay", episode_id)

    assert shown.returncode == 0, shown.stderr
    out = shown.stdout
    assert f"Episode {episode_id}" in out
    assert f"agent {CALCULATOR}" in out
    assert "finished: done" in out
    assert "Turn 1 of 2" in out
    assert "Turn 2 of 2" in out
    assert "continues turn 1" in out
    assert "user: What is 17 * 3?" in out
    assert 'tool call calculate {"expression": "17 * 3"}' in out
    assert "tool calculate (" in out  # the tool's message, new in turn 2
    assert "reply: The answer is 51." in out
    assert "finish tool_calls" in out
    assert "mean logprob -0.250" in out
    assert "reward 1 (agent)" in out
    # the episode's reward sits on the last turn and flows back undiscounted (--discount 1.0)
    assert "reward 0 · return 1\n" in out
    assert "reward 1 · return 1\n" in out
    assert out.count("policy v0 · consumer ") == 2
    assert "tools: calculate" in out


async def test_json_dumps_the_folded_episode_with_tokens_and_discounted_returns(
    store: EventStore, llm: NatsLLMClient, policy: str, database_url: str
) -> None:
    episode_id = await calculator_episode(store, llm, policy)
    recorded = whole_events([r.event for r in await store.read_stream(f"episode-{episode_id}") if r.event])
    turns = [e for e in recorded if isinstance(e, TurnCompleted)]

    shown = turnstile(database_url, "replay", episode_id, "--json", "--discount", "0.5")

    assert shown.returncode == 0, shown.stderr
    dumped = json.loads(shown.stdout)
    assert dumped["episode_id"] == episode_id
    assert dumped["status"] == "finished"
    assert dumped["finished"]["termination"] == "done"
    assert len(dumped["turns"]) == 2
    for turn, event in zip(dumped["turns"], turns, strict=True):
        assert turn["completion_token_ids"] == event.completion_token_ids
        assert turn["prompt_token_ids"] == event.prompt_token_ids
        assert TurnCompleted.model_validate({k: turn[k] for k in TurnCompleted.model_fields}) == event
    assert [t["reward"] for t in dumped["turns"]] == [0.0, 1.0]
    assert [t["discounted_return"] for t in dumped["turns"]] == [0.5, 1.0]
    assert dumped["total_reward"] == 1.0


async def test_a_prefix_is_enough_unknown_and_ambiguous_ids_are_explained(
    store: EventStore, llm: NatsLLMClient, policy: str, database_url: str
) -> None:
    stem = uuid.uuid4().hex[:10]
    first = await calculator_episode(store, llm, policy, episode_id=f"{stem}a1")
    second = await calculator_episode(store, llm, policy, episode_id=f"{stem}a2")
    longer = await calculator_episode(store, llm, policy, episode_id=f"{stem}a2x")

    by_prefix = turnstile(database_url, "replay", f"{stem}a1")
    assert by_prefix.returncode == 0, by_prefix.stderr
    assert f"Episode {first}" in by_prefix.stdout

    exact = turnstile(database_url, "replay", second)  # also the beginning of `longer`: the exact id wins
    assert exact.returncode == 0, exact.stderr
    assert f"Episode {second}\n" in exact.stdout

    ambiguous = turnstile(database_url, "replay", f"{stem}a")
    assert ambiguous.returncode == 2
    assert f"episode id '{stem}a' is ambiguous" in ambiguous.stderr
    for candidate in (first, second, longer):
        assert candidate in ambiguous.stderr
    assert "give more of the id" in ambiguous.stderr

    unknown = turnstile(database_url, "replay", "zz" + stem)
    assert unknown.returncode == 2
    assert f"no episode 'zz{stem}' in the log" in unknown.stderr
    assert "turnstile episodes" in unknown.stderr
    assert unknown.stdout == ""

    wildcard = turnstile(database_url, "replay", "%")  # not an id, and never a LIKE wildcard
    assert wildcard.returncode == 2
    assert "is not an episode id" in wildcard.stderr


async def test_until_shows_the_state_as_of_that_turn(
    store: EventStore, llm: NatsLLMClient, policy: str, database_url: str
) -> None:
    episode_id = await calculator_episode(store, llm, policy)

    shown = turnstile(database_url, "replay", episode_id[:12], "--until", "1")

    assert shown.returncode == 0, shown.stderr
    assert "Turn 1 of 2" in shown.stdout
    assert "Turn 2" not in shown.stdout
    assert "running as of turn 1 (2 recorded)" in shown.stdout
    assert "The answer is 51." not in shown.stdout
    assert "reward 0 · return 0\n" in shown.stdout  # the reward came after turn 2
    as_json = json.loads(turnstile(database_url, "replay", episode_id, "--until", "1", "--json").stdout)
    assert (len(as_json["turns"]), as_json["status"], as_json["rewards"]) == (1, "running", [])

    too_far = turnstile(database_url, "replay", episode_id, "--until", "3")
    assert too_far.returncode == 2
    assert "--until 3" in too_far.stderr
    assert "has 2 recorded turns" in too_far.stderr


async def test_tokens_are_shown_shaded_by_logprob(
    store: EventStore, llm: NatsLLMClient, policy: str, database_url: str
) -> None:
    episode_id = await calculator_episode(store, llm, policy)
    replayed = await load_episode(store, episode_id)
    first = replayed.episode.turns[0]

    shown = turnstile(database_url, "replay", episode_id, "--tokens")

    assert shown.returncode == 0, shown.stderr
    assert "completion tokens: " + " ".join(map(str, first.completion_token_ids[:8])) in shown.stdout
    shaded = token_text([7, 8, 9], [0.0, -0.7, -12.0])
    assert shaded.plain == "7 8 9"
    colours = [tuple(span.style.bgcolor.get_truecolor()) for span in shaded.spans]  # type: ignore[union-attr]
    assert colours == [(0, 200, 0), (255, 199, 0), (255, 0, 0)]  # likely green, even yellow, unlikely red


async def test_tokens_with_a_tokenizer_show_the_decoded_texts(
    store: EventStore, llm: NatsLLMClient, policy: str, database_url: str, tiny_model_dir: Path
) -> None:
    transformers = pytest.importorskip("transformers")
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tiny_model_dir))
    episode_id = await calculator_episode(store, llm, policy)
    replayed = await load_episode(store, episode_id)
    last = replayed.episode.turns[-1]

    shown = turnstile(database_url, "replay", episode_id, "--tokens", "--model", str(tiny_model_dir))

    assert shown.returncode == 0, shown.stderr
    decoded = "".join(tokenizer.decode([i]).replace("\n", "\\n") for i in last.completion_token_ids[:6])
    assert "completion tokens: " + decoded in shown.stdout


async def test_rerun_of_the_unchanged_agent_is_identical_and_writes_nothing(
    store: EventStore, llm: NatsLLMClient, policy: str, database_url: str
) -> None:
    episode_id = await calculator_episode(store, llm, policy)
    before = event_count(database_url)

    rerun = turnstile(database_url, "replay", episode_id, "--rerun")

    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert rerun.stdout.startswith(f"identical  {episode_id}  2 of 2 recorded turns replayed")
    assert event_count(database_url) == before
    as_json = json.loads(turnstile(database_url, "replay", episode_id, "--rerun", "--json").stdout)
    assert (as_json["identical"], as_json["replayed_turns"], as_json["divergence"]) == (True, 2, None)


async def test_rerun_of_an_agent_with_a_changed_prompt_diverges_at_turn_2_with_a_diff(
    store: EventStore, llm: NatsLLMClient, policy: str, database_url: str
) -> None:
    episode_id = await record(store, llm, policy, CountingAgent(), agent_name=COUNTING, task={"id": "c"})

    rerun = turnstile(
        database_url,
        "replay",
        episode_id,
        "--rerun",
        "--agent",
        "tests.support.replay_agents:RewordedCountingAgent",
    )

    assert rerun.returncode == 1, rerun.stderr
    out = rerun.stdout
    assert f"diverged  {episode_id}  at turn 2 (messages): message 3 of 3 (user) differs" in out
    assert "--- recorded turn 2, message 3" in out
    assert "+++ rerun turn 2, message 3" in out
    assert "-  now say 2" in out
    assert "+  now please say 2" in out
    assert "role: user" in out


async def test_rerun_hands_the_agent_every_character_of_each_recorded_reply_and_sees_one_changed(
    store: EventStore, llm: NatsLLMClient, policy: str, database_url: str
) -> None:
    """The README's promise: a rerun answers with the recording exactly and reports a change in substance.
    A reply sent back with only its last character changed diverges at turn 2; the unchanged agent hears
    every recorded reply to its last character."""
    episode_id = await record(store, llm, policy, CountingAgent(), agent_name=COUNTING, task={"id": "c"})
    recorded = [turn.reply.text for turn in (await load_episode(store, episode_id)).episode.turns]
    assert len(recorded) == 3
    assert all(recorded), recorded  # replies with a last character to change

    ListeningCountingAgent.heard.clear()
    same = await rerun_by_id(store, episode_id, agent="tests.support.replay_agents:ListeningCountingAgent")
    assert same.identical
    assert ListeningCountingAgent.heard == recorded

    rerun = turnstile(
        database_url, "replay", episode_id, "--rerun", "--agent",
        "tests.support.replay_agents:EditedReplyCountingAgent",
    )  # fmt: skip
    assert rerun.returncode == 1, rerun.stdout + rerun.stderr
    out = rerun.stdout
    assert f"diverged  {episode_id}  at turn 2 (messages): message 2 of 3 (assistant) differs" in out
    edited = recorded[0][:-1] + ("?" if recorded[0].endswith("!") else "!")
    assert f"+  {edited.splitlines()[-1]}" in out
    assert f"-  {recorded[0].splitlines()[-1]}" in out


async def test_rerun_reports_too_few_and_too_many_turns(
    store: EventStore, llm: NatsLLMClient, policy: str
) -> None:
    episode_id = await record(store, llm, policy, CountingAgent(), agent_name=COUNTING, task={"id": "c"})

    same = await rerun_by_id(store, episode_id)
    short = await rerun_by_id(store, episode_id, agent="tests.support.replay_agents:ShortCountingAgent")
    long = await rerun_by_id(store, episode_id, agent="tests.support.replay_agents:LongCountingAgent")
    # as of turn 2 the recording is a prefix: the agent is stopped there, and that is no divergence
    until = await rerun_by_id(store, episode_id, until=2)

    assert (same.identical, same.replayed_turns) == (True, 3)
    assert short.divergence is not None
    assert (short.divergence.turn, short.divergence.field) == (3, "turns")
    assert short.divergence.summary.startswith("the agent stopped after 2 turns; 3 were recorded")
    assert long.divergence is not None
    assert (long.divergence.turn, long.divergence.field) == (4, "turns")
    assert long.divergence.summary == "the agent asked for a 4th turn; 3 were recorded"
    assert (until.identical, until.replayed_turns, until.recorded_turns) == (True, 2, 2)
    assert "the recording ends after 2 turns" in until.note


async def test_rerun_of_the_openai_sdk_agent_is_identical_and_a_sampling_change_diverges(
    store: EventStore, llm: NatsLLMClient, policy: str
) -> None:
    task = {"id": "sdk", "question": "What is 6 * 7?", "answer": 42}
    episode_id = await record(store, llm, policy, OpenAIAgent(), agent_name=OPENAI_AGENT, task=task)

    same = await rerun_by_id(store, episode_id)
    terse = await rerun_by_id(store, episode_id, agent="tests.support.replay_agents:TerseOpenAIAgent")

    assert (same.identical, same.replayed_turns, same.recorded_turns) == (True, 2, 2)
    assert terse.divergence is not None
    assert (terse.divergence.turn, terse.divergence.field) == (1, "sampling")
    assert terse.divergence.summary == "sampling differs (max_tokens)"
    assert '-  "max_tokens": 64,' in terse.divergence.diff
    assert '+  "max_tokens": 16,' in terse.divergence.diff


def counting_turn(messages: list[ChatMessage], text: str) -> TurnCompleted:
    return TurnCompleted(
        request=TurnRequest(messages=messages, sampling=SamplingParams(max_tokens=8)),
        reply=TurnReply(text=text, finish_reason="stop"),
        prompt_token_ids=[1, 2],
        completion_token_ids=[3],
        completion_logprobs=[-0.5],
        policy_version=0,
        engine_id="e",
    )


async def test_rerun_compares_the_ending_and_knows_a_failed_llm_call_was_not_recorded() -> None:
    started = EpisodeStarted(episode_id="hand", task={"id": 7}, task_id="7", agent=COUNTING, policy="p")
    first = counting_turn([ChatMessage(role="user", content="task 7: count to three")], "one")
    turns = [first]
    for n in (2, 3):
        previous = turns[-1]
        follow_up = ChatMessage(role="user", content=f"now say {n}")
        reply = ChatMessage(role="assistant", content=previous.reply.text)
        turns.append(counting_turn([*previous.request.messages, reply, follow_up], f"say {n}"))
    timeout_line = "pipeline.inference.client.InferenceTimeout: LLM request timed out after 5 s"
    llm_failed = fold_episode([started, first, EpisodeFinished(termination="error", error=timeout_line)])
    agent_failed = fold_episode(
        [started, *turns, EpisodeFinished(termination="error", error="KeyError: 'x'")]
    )
    done = fold_episode([started, *turns, RewardAssigned(value=1.0), EpisodeFinished(termination="done")])

    after_failure = await rerun_episode(llm_failed, CountingAgent(), agent_name=COUNTING)
    not_failing = await rerun_episode(agent_failed, CountingAgent(), agent_name=COUNTING)
    identical = await rerun_episode(done, CountingAgent(), agent_name=COUNTING)

    assert (after_failure.identical, after_failure.replayed_turns) == (True, 1)
    assert after_failure.note.startswith(f"the recording ends after 1 turn (ended error: {timeout_line})")
    assert not_failing.divergence is not None
    assert (not_failing.divergence.turn, not_failing.divergence.field) == (None, "outcome")
    assert not_failing.divergence.summary == (
        "the recorded episode ended error; the rerun ended done (no error instead of KeyError: 'x')"
    )
    assert (identical.identical, identical.replayed_turns, identical.termination) == (True, 3, "done")


async def test_rerun_compares_tools_sampling_and_the_reward(
    store: EventStore, llm: NatsLLMClient, policy: str
) -> None:
    episode_id = await record(
        store, llm, policy, CountingAgent(), agent_name=COUNTING, task={"id": "r", "reward": 0.25}
    )
    recorded = (await load_episode(store, episode_id)).episode

    class OtherReward(CountingAgent):
        async def run(self, task: dict[str, Any], llm: Any) -> float:
            await super().run(task, llm)
            return 0.75

    changed = await rerun_episode(recorded, OtherReward(), agent_name="inline")
    assert changed.divergence is not None
    assert changed.divergence.field == "reward"
    assert "returned reward 0.75 (episode)" in changed.divergence.summary

    request = recorded.turns[0].request
    sent = LLMRequest(policy="p", messages=request.messages, sampling=request.sampling.model_copy())
    assert compare_request(1, request, sent) is None
    hotter = sent.model_copy(update={"sampling": request.sampling.model_copy(update={"temperature": 0.2})})
    sampling = compare_request(1, request, hotter)
    assert sampling is not None
    assert (sampling.field, sampling.summary) == ("sampling", "sampling differs (temperature)")
    assert '+  "temperature": 0.2' in sampling.diff
    with_tools = TurnRequest.model_validate(
        {**request.model_dump(), "tools": [{"function": {"name": "calculate"}}]}
    )
    tools = compare_request(1, with_tools, sent)
    assert tools is not None
    assert (tools.field, tools.summary) == ("tools", "tools differ (sent: none; recorded: calculate)")


async def test_rerun_all_where_reports_each_episode_and_exits_1_on_a_divergence(
    store: EventStore, llm: NatsLLMClient, policy: str, database_url: str
) -> None:
    same = [
        await record(store, llm, policy, CountingAgent(), agent_name=COUNTING, task={"id": f"s{n}"})
        for n in range(2)
    ]
    # recorded under the name CountingAgent by code that has changed since: its rerun diverges
    changed = await record(store, llm, policy, RewordedCountingAgent(), agent_name=COUNTING, task={"id": "x"})
    other = await calculator_episode(store, llm, policy)
    materializer = Materializer(database_url, MaterializerConfig())
    await materializer.open()
    await materializer.catch_up()
    await materializer.close()
    before = event_count(database_url)

    rerun = turnstile(database_url, "replay", "--rerun", "--all", "--where", f"agent = '{COUNTING}'")

    assert rerun.returncode == 1, rerun.stderr
    lines = [line for line in rerun.stdout.splitlines() if line.startswith(("identical", "diverged"))]
    assert [line.split()[:2] for line in lines] == [
        ["identical", same[0]], ["identical", same[1]], ["diverged", changed],
    ]  # fmt: skip
    assert "at turn 2 (messages)" in lines[2]
    assert "3 episodes rerun: 2 identical, 1 diverged" in rerun.stdout
    assert other not in rerun.stdout

    calculator_only = turnstile(
        database_url, "replay", "--rerun", "--all", "--where", f"agent = '{CALCULATOR}'"
    )
    assert calculator_only.returncode == 0, calculator_only.stdout + calculator_only.stderr
    assert "1 episode rerun: 1 identical, 0 diverged" in calculator_only.stdout

    injected = turnstile(
        database_url, "replay", "--rerun", "--all", "--where", "true); DELETE FROM events; --"
    )
    assert injected.returncode == 2
    assert "read-only" in injected.stderr
    assert event_count(database_url) == before


async def test_episodes_lists_from_the_log_newest_first_with_filters(
    store: EventStore, llm: NatsLLMClient, policy: str, database_url: str
) -> None:
    finished = [
        await record(
            store, llm, policy, CountingAgent(), agent_name=COUNTING, task={"id": f"e{n}", "reward": n / 2}
        )
        for n in range(3)
    ]
    running = EpisodeSession(store, llm, policy=policy, agent=COUNTING, task_id="open")
    await running.start()
    await running.chat([ChatMessage(role="user", content="hello")])

    listed = turnstile(database_url, "episodes", "--status", "finished")

    assert listed.returncode == 0, listed.stderr
    positions = [listed.stdout.index(episode_id) for episode_id in reversed(finished)]
    assert positions == sorted(positions)  # newest first
    assert running.episode_id not in listed.stdout
    assert "3 episodes, newest first" in listed.stderr

    async def ids(**filters: Any) -> list[str]:
        rows, _ = await list_episodes(store, EpisodeFilter(**filters))
        return [row.episode_id for row in rows]

    assert await ids(status="running") == [running.episode_id]
    assert await ids(min_reward=0.5) == [finished[2], finished[1]]
    assert await ids(max_reward=0.5, termination="done") == [finished[1], finished[0]]
    assert await ids(policy="nope") == []
    assert await ids(since=parse_since("1h"), limit=2) == [running.episode_id, finished[2]]
    assert await ids(since=parse_since("2999-01-01")) == []
    assert await ids(agent=COUNTING, status="finished", limit=1) == [finished[2]]
    newest = json.loads(turnstile(database_url, "episodes", "--json", "--limit", "1").stdout)
    assert [(row["episode_id"], row["status"], row["turns"], row["reward"]) for row in newest] == [
        (running.episode_id, "running", 1, None)
    ]

    bad = turnstile(database_url, "episodes", "--since", "yesterday")
    assert bad.returncode == 2
    assert "--since 'yesterday'" in bad.stderr


async def test_parse_since_and_the_rerun_store() -> None:
    now = dt.datetime(2026, 11, 23, 12, 0, tzinfo=dt.UTC)
    assert parse_since("90m", now) == now - dt.timedelta(minutes=90)
    assert parse_since("2d", now) == now - dt.timedelta(days=2)
    assert parse_since("2026-11-23T10:00+00:00", now) == dt.datetime(2026, 11, 23, 10, tzinfo=dt.UTC)

    scratch = InMemoryStore()  # what reruns record into (the store contract covers the rest)
    started = EpisodeStarted(episode_id="e", task_id="t", agent="a", policy="p")
    first = await scratch.append("episode-e", [started], 0)
    again = started.model_copy(update={"event_id": uuid.uuid4()})
    with pytest.raises(WrongExpectedVersion, match="expected 0, actual 1"):
        await scratch.append("episode-e", [again], 0)
    assert (first.version, first.positions, len(await scratch.read_stream("episode-e"))) == (1, (1,), 1)


async def test_a_100_turn_episode_folds_replays_reruns_and_samples_token_exactly(
    store: EventStore, llm: NatsLLMClient, policy: str, database_url: str
) -> None:
    episode_id = await record(store, llm, policy, LongAgent(), agent_name=LONG, task={"id": "long"})
    recorded = [r for r in await store.read_stream(f"episode-{episode_id}")]
    turns = [r.event for r in recorded if isinstance(r.event, TurnCompleted)]
    assert len(turns) == 100
    assert all(t.prefix_tokens > 0 and len(t.request.messages) == 1 for t in turns[1:])
    whole = expand_turns(turns)
    assert len(whole[-1].prompt_token_ids) > 20_000
    sizes = [len(r.event.model_dump_json()) for r in recorded if isinstance(r.event, TurnCompleted)]
    assert max(sizes[1:]) < 1.5 * min(sizes[1:])  # a turn's record does not grow with the history

    shown = turnstile(database_url, "replay", episode_id)
    assert shown.returncode == 0, shown.stderr
    assert "Turn 100 of 100" in shown.stdout
    assert "continues turn 99" in shown.stdout
    rerun = turnstile(database_url, "replay", episode_id, "--rerun")
    assert rerun.stdout.startswith(f"identical  {episode_id}  100 of 100 recorded turns replayed"), (
        rerun.stdout
    )

    for style in ("individual", "concat"):
        config = MaterializerConfig(name=f"long_{style}", style=style, batch_samples=10**6)
        materializer = Materializer(database_url, config)
        await materializer.open(create=True)
        await materializer.catch_up()
        await materializer.close()
        with psycopg.connect(libpq_url(database_url)) as connection:
            rows = connection.execute(
                f"SELECT turn_ids, arrays FROM {config.schema}.samples WHERE episode_id = %s", (episode_id,)
            ).fetchall()
        samples = {tuple(str(t) for t in ids): unpack_arrays(bytes(arrays))[:2] for ids, arrays in rows}
        if style == "concat":
            path = tuple(str(t.turn_id) for t in whole)
            ids = [*whole[-1].prompt_token_ids, *whole[-1].completion_token_ids]
            assert list(samples) == [path]
            assert samples[path][0] == ids
        else:
            assert len(samples) == 100
            for turn in whole:
                ids, mask = samples[(str(turn.turn_id),)]
                assert ids == [*turn.prompt_token_ids, *turn.completion_token_ids]
                assert mask == [0] * len(turn.prompt_token_ids) + [1] * len(turn.completion_token_ids)


async def test_episodes_lineages_reports_each_lineage_its_turns_training_and_why_it_started(
    store: EventStore, database_url: str
) -> None:
    """``turnstile episodes --lineages``: the loop (first call, trained), a title call without tools (a side
    call, not trained) and an edited continuation (an edit, with what changed)."""
    tools = [ToolSpec.model_validate({"function": {"name": "bash", "parameters": {"type": "object"}}})]

    def turn(
        prompt: list[int], completion: list[int], *, offered: bool = True, **update: Any
    ) -> TurnCompleted:
        request = TurnRequest(
            messages=[ChatMessage(role="user", content="q")], tools=tools if offered else []
        )
        made = TurnCompleted(
            request=request,
            reply=TurnReply(text="a", finish_reason="stop"),
            prompt_token_ids=prompt,
            completion_token_ids=completion,
            completion_logprobs=[-0.5] * len(completion),
            policy_version=0,
            engine_id="e",
            model="big",
        )
        return made.model_copy(update=update)

    first = turn([1, 10, 2], [20, 2])
    title = turn([1, 50, 2], [51, 2], offered=False)
    second = turn([1, 10, 2, 20, 2, 1, 30, 2], [21, 2])
    edited = turn([1, 10, 2, 20, 3, 1, 32, 2], [23, 2])
    edited = edited.model_copy(
        update={"edit": TurnEdit(turn_id=first.turn_id, changes=["command 'a' -> 'b'"])}
    )
    episode_id = uuid.uuid4().hex
    started = EpisodeStarted(episode_id=episode_id, task_id="t", agent="tests", policy="lineages")
    events: list[Event] = [started, first, title, second, edited, EpisodeFinished(termination="done")]
    await store.append(f"episode-{episode_id}", events, 0)

    listed = turnstile(database_url, "episodes", "--lineages", "--json", "--limit", "1")
    assert listed.returncode == 0, listed.stderr
    (row,) = json.loads(listed.stdout)
    assert row["episode_id"] == episode_id
    shown = [
        (
            lineage["started_because"],
            [t["index"] for t in lineage["turns"]],
            [t["trained"] for t in lineage["turns"]],
        )
        for lineage in row["lineages"]
    ]
    assert shown == [
        ("first call", [0, 2], [True, True]),
        ("side call", [1], [False]),
        ("edit", [3], [True]),
    ]
    assert row["lineages"][1]["turns"][0]["why_not_trained"] == "side call"
    assert row["lineages"][2]["edit"] == ["command 'a' -> 'b'"]
    table = turnstile(database_url, "episodes", "--lineages", "--limit", "1")
    assert table.returncode == 0, table.stderr
    for text in ("first call", "side call", "0 2", "1 (side call)", "command 'a' -> 'b'"):
        assert text in table.stdout
