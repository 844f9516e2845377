"""Episode-session and runner logic on the in-memory store with an in-process LLM client: no PostgreSQL,
no NATS.

The same logic runs against the real servers in test_episodes.py and test_runner.py; these tests pin the
parts that are pure bookkeeping (parents, token prefixes, expected versions, endings) quickly.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.episodes import (
    RUNNER_METADATA,
    EpisodeLLM,
    EpisodeSession,
    FunctionAgent,
    MaxTurnsExceeded,
    fold_episode,
    run_episode,
)
from pipeline.episodes.fold import EpisodeOutcome, whole_events
from pipeline.episodes.refusals import InvalidLLMCall
from pipeline.episodes.session import turn_event
from pipeline.errors import TurnstileError, WrongExpectedVersion
from pipeline.inference.client import InferenceError
from pipeline.log import InMemoryStore
from pipeline.log.appends import encode_event
from pipeline.runners import Runner, RunnerConfig, TaskSpec
from schemas import (
    ChatMessage,
    EpisodeFinished,
    EpisodeStarted,
    Event,
    LLMRequest,
    LLMResponse,
    RewardAssigned,
    SamplingParams,
    Timings,
    ToolChoice,
    ToolSpec,
    TurnCompleted,
    TurnEdit,
    TurnReply,
    TurnRequest,
)
from schemas.common import FLOAT32_TINY
from tests.support.agents import FailingAgent, ThreeTurnAgent
from tests.support.backends import PrefixEcho
from tests.support.factories import turn as factory_turn


async def recorded(store: InMemoryStore, session: EpisodeSession) -> list[Event]:
    return whole_events([r.event for r in await store.read_stream(session.stream) if r.event is not None])


async def test_a_continuing_turn_is_sent_as_its_parents_exact_tokens_and_recorded_with_its_parent() -> None:
    store, llm = InMemoryStore(), PrefixEcho()
    session = EpisodeSession(store, llm, policy="main", task={"id": 1})
    outcome = await run_episode(ThreeTurnAgent(), session)

    assert (outcome.termination, outcome.turns, outcome.reward) == ("done", 3, 1.0)
    events = await recorded(store, session)
    assert [e.type for e in events] == [
        "EpisodeStarted",
        "TurnCompleted",
        "TurnCompleted",
        "TurnCompleted",
        "RewardAssigned",
        "EpisodeFinished",
    ]
    turns = [e for e in events if isinstance(e, TurnCompleted)]
    assert [t.parent_turn_id for t in turns] == [None, turns[0].turn_id, turns[1].turn_id]
    assert llm.requests[0].prefix is None
    for before, request in zip(turns, llm.requests[1:], strict=False):
        assert request.prefix is not None
        assert request.prefix.token_ids == [*before.prompt_token_ids, *before.completion_token_ids]
        assert request.prefix.message_count == len(before.request.messages) + 1
    assert fold_episode(events).total_reward == 1.0
    # The finish's token counts are those of the whole turns, though they are recorded as deltas.
    stored = [r.event for r in await store.read_stream(session.stream)]
    assert [e.is_delta for e in stored if isinstance(e, TurnCompleted)] == [False, True, True]
    finished = events[-1]
    assert isinstance(finished, EpisodeFinished)
    assert finished.metrics["prompt_tokens"] == sum(len(t.prompt_token_ids) for t in turns)
    assert finished.metrics["completion_tokens"] == sum(len(t.completion_token_ids) for t in turns)
    assert (finished.metrics["turns"], finished.metrics["reward"]) == (3.0, 1.0)


async def test_a_changed_history_starts_a_new_root_instead_of_a_prefix() -> None:
    store, llm = InMemoryStore(), PrefixEcho()
    session = EpisodeSession(store, llm, policy="main")
    await session.start()
    first = await session.chat([{"role": "user", "content": "hi"}])
    edited = {"role": "assistant", "content": first.text + " (edited)"}
    await session.chat([{"role": "user", "content": "hi"}, edited, {"role": "user", "content": "and?"}])
    assert llm.requests[1].prefix is None
    turns = [e for e in await recorded(store, session) if isinstance(e, TurnCompleted)]
    assert [t.parent_turn_id for t in turns] == [None, None]


async def test_a_session_appends_with_expected_versions_so_a_second_writer_is_refused() -> None:
    store = InMemoryStore()
    session = EpisodeSession(store, PrefixEcho(), policy="main", episode_id="e-twice")
    await session.start()
    rival = EpisodeSession(store, PrefixEcho(), policy="main", episode_id="e-twice")
    with pytest.raises(WrongExpectedVersion):
        await rival.start()
    await session.chat([{"role": "user", "content": "one"}])
    assert [r.version for r in await store.read_stream(session.stream)] == [1, 2]


async def test_an_agent_cancelled_mid_turn_ends_cancelled_with_its_turn_recorded() -> None:
    store = InMemoryStore()
    gate = asyncio.Event()

    class Stalling(PrefixEcho):
        async def __call__(self, request: LLMRequest) -> LLMResponse:
            if self.requests:
                gate.set()
                await asyncio.Event().wait()  # the second call never answers
            return await super().__call__(request)

    async def agent(task: dict[str, Any], llm: EpisodeLLM) -> None:
        reply = await llm.chat([{"role": "user", "content": "a"}])
        await llm.chat([{"role": "user", "content": "a"}, reply.message, {"role": "user", "content": "b"}])

    session = EpisodeSession(store, Stalling(), policy="main")
    running = asyncio.create_task(run_episode(FunctionAgent(agent), session))
    await gate.wait()
    running.cancel()
    with pytest.raises(asyncio.CancelledError):
        await running
    episode = fold_episode(await recorded(store, session))
    assert len(episode.turns) == 1
    assert episode.finished is not None
    assert episode.finished.termination == "cancelled"


class WriterStore(InMemoryStore):
    """The in-memory store with a writer of its own, as ``EventStore`` has: each append waits at ``gate``
    (while ``hold`` is set) and is written by a task of its own, which a cancelled caller does not stop;
    ``landed_first`` writes it before the wait instead (the caller is cancelled before it hears back)."""

    def __init__(self) -> None:
        super().__init__()
        self.hold, self.landed_first = False, False
        self.gate, self.waiting = asyncio.Event(), asyncio.Event()
        self.writes: list[asyncio.Task[Any]] = []
        self.refused: list[BaseException] = []

    async def append(self, stream: str, events: Any, expected_version: int | None = None, **kw: Any) -> Any:
        if not self.hold:
            return await super().append(stream, events, expected_version, **kw)
        self.hold = False

        async def write() -> Any:
            if self.landed_first:
                recorded = await InMemoryStore.append(self, stream, events, expected_version, **kw)
                self.waiting.set()
                await self.gate.wait()
                return recorded
            self.waiting.set()
            await self.gate.wait()
            try:
                return await InMemoryStore.append(self, stream, events, expected_version, **kw)
            except WrongExpectedVersion as refused:
                self.refused.append(refused)
                raise

        self.writes.append(asyncio.create_task(write()))
        return await asyncio.shield(self.writes[-1])


async def interrupted_turn(store: WriterStore) -> EpisodeSession:
    """A session whose second turn's append is in flight (held at the store's gate) when its caller is
    cancelled."""
    session = EpisodeSession(store, PrefixEcho(), policy="main")
    await session.start()
    first = await session.chat([{"role": "user", "content": "a"}])
    store.hold = True
    second = asyncio.create_task(
        session.chat([{"role": "user", "content": "a"}, first.message, {"role": "user", "content": "b"}])
    )
    await store.waiting.wait()
    second.cancel()
    with pytest.raises(asyncio.CancelledError):
        await second
    return session


async def test_a_turn_recorded_after_its_caller_was_cancelled_is_taken_in_before_the_end() -> None:
    """The store wrote the turn, but the agent was cancelled before hearing so: the session's end is first
    refused at the version it knew, then written after the turn, which the session took in from the log."""
    store = WriterStore()
    store.landed_first = True
    session = await interrupted_turn(store)
    store.gate.set()
    await session.finish("cancelled")
    events = await recorded(store, session)
    assert [type(e).__name__ for e in events] == [
        "EpisodeStarted",
        "TurnCompleted",
        "TurnCompleted",
        "EpisodeFinished",
    ]
    assert [r.version for r in await store.read_stream(session.stream)] == [1, 2, 3, 4]
    assert session.finished
    assert session.events[-1] == events[-1]
    await session.finish("cancelled")  # finished: nothing more
    assert len(await store.read_stream(session.stream)) == 4


async def test_a_turn_still_in_flight_when_the_end_is_written_is_refused_and_the_stream_stays_whole() -> None:
    """The agent was cancelled while its turn waited to be written; the end was written first, at the
    version the session knew: the late turn is refused by its expected version; nothing follows the end."""
    store = WriterStore()
    session = await interrupted_turn(store)
    await session.finish("cancelled")
    store.gate.set()
    with pytest.raises(WrongExpectedVersion):
        await store.writes[-1]
    events = await recorded(store, session)
    assert [type(e).__name__ for e in events] == ["EpisodeStarted", "TurnCompleted", "EpisodeFinished"]
    assert len(store.refused) == 1


async def test_an_end_recorded_after_its_caller_was_cancelled_stands_and_is_not_written_twice() -> None:
    store = WriterStore()
    session = EpisodeSession(store, PrefixEcho(), policy="main")
    await session.start()
    await session.chat([{"role": "user", "content": "a"}])
    store.hold, store.landed_first = True, True
    finishing = asyncio.create_task(session.finish("cancelled"))
    await store.waiting.wait()
    finishing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await finishing
    store.gate.set()
    await session.finish("error", error="the runner stopped")  # refused, caught up: the first end stands
    events = await recorded(store, session)
    assert [type(e).__name__ for e in events] == ["EpisodeStarted", "TurnCompleted", "EpisodeFinished"]
    finished = events[-1]
    assert isinstance(finished, EpisodeFinished)
    assert finished.termination == "cancelled"
    assert session.finished


@pytest.mark.parametrize("rewards", [[], [0.25, -1.0]])
async def test_an_episodes_outcome_from_its_recorded_events_equals_the_folds(rewards: list[float]) -> None:
    """run_episode ends with ``EpisodeOutcome.of_events``, which makes no turn whole: it must say what the
    fold of the same events says (turns, rewards summed or None, termination, error)."""
    store = InMemoryStore()
    session = EpisodeSession(store, PrefixEcho(), policy="main")

    async def agent(task: dict[str, Any], llm: EpisodeLLM) -> None:
        messages: list[Any] = [{"role": "user", "content": "q0"}]
        for index in range(12):
            reply = await llm.chat(messages)
            messages = [*messages, reply.message, {"role": "user", "content": f"q{index + 1}"}]
        for value in rewards:
            await session.reward(value)

    outcome = await run_episode(FunctionAgent(agent), session)
    assert outcome == EpisodeOutcome.of(fold_episode(await recorded(store, session)))
    expected_reward = sum(rewards) if rewards else None
    assert (outcome.turns, outcome.reward, outcome.termination) == (12, expected_reward, "done")
    with pytest.raises(TurnstileError, match="not finished"):
        EpisodeOutcome.of_events(session.events[:-1])


async def test_a_runner_group_retries_a_failing_slot_and_a_resumed_group_counts_each_slot_once() -> None:
    store, llm = InMemoryStore(), PrefixEcho()
    config = RunnerConfig(
        policy="main", agent_name="tests.support.agents:FailingAgent", group_size=3, retries=1
    )
    runner = Runner(FailingAgent(), store=store, llm=llm, config=config)
    outcomes = await runner.run_group(TaskSpec(task={"id": 7, "fail": True}, task_id="t7"), "g1")

    assert [o.termination for o in outcomes] == ["error"] * 3
    assert all(o.retry_of is not None for o in outcomes)  # each slot ran twice: an attempt and its retry
    assert await store.head() == 3 * 2 * 3  # 6 episodes x (started, turn, finished)
    again = Runner(FailingAgent(), store=store, llm=llm, config=config)
    resumed = await again.run_group(TaskSpec(task={"id": 7, "fail": True}, task_id="t7"), "g1", resume=True)
    assert [o.episode_id for o in resumed] == [o.episode_id for o in outcomes]
    assert await store.head() == 18  # a redelivered task finds its episodes recorded: nothing runs again


async def test_a_rival_writer_on_a_live_session_makes_its_next_turn_fail_and_nothing_is_recorded() -> None:
    store = InMemoryStore()
    session = EpisodeSession(store, PrefixEcho(), policy="main")
    await session.start()
    await session.chat([{"role": "user", "content": "one"}])
    await store.append(session.stream, [RewardAssigned(value=1.0, source="rival")])  # any version
    with pytest.raises(WrongExpectedVersion, match="expected 2, actual 3"):
        await session.chat([{"role": "user", "content": "two"}])
    recorded = [r.type for r in await store.read_stream(session.stream)]
    assert recorded == ["EpisodeStarted", "TurnCompleted", "RewardAssigned"]


class Timed(PrefixEcho):
    """PrefixEcho whose replies carry timings and a prefix break, after a short wait."""

    async def __call__(self, request: LLMRequest) -> LLMResponse:
        await asyncio.sleep(0.01)
        response = await super().__call__(request)
        timings = Timings(queued_ms=1.5, first_token_ms=2.5, total_ms=4.0)
        return response.model_copy(update={"timings": timings, "prefix_break": True})


async def test_the_session_records_what_it_was_given_and_what_the_consumer_answered() -> None:
    store, llm = InMemoryStore(), Timed()
    session = EpisodeSession(
        store, llm, policy="main", task={"q": 1}, task_id="t7", agent="my-agent", group_id="g1",
        group_size=4, sampling=SamplingParams(temperature=0.5), tags={"k": "v"}, retry_of="e0",
        runner_id="runner-1", max_turns=1,
    )  # fmt: skip
    await session.start()
    reply = await session.chat([{"role": "user", "content": "hi"}])
    with pytest.raises(MaxTurnsExceeded):
        await session.chat([{"role": "user", "content": "again"}])
    assert session.max_turns_hit is True
    await session.reward(0.5)
    await session.finish("done")
    with pytest.raises(TurnstileError, match="is finished; start a new episode"):
        await session.chat([{"role": "user", "content": "after"}])

    records = await store.read_stream(session.stream)
    started, turn, reward, finished = (r.event for r in records)
    assert isinstance(started, EpisodeStarted)
    assert (started.task, started.task_id, started.agent, started.group_id, started.group_size) == (
        {"q": 1}, "t7", "my-agent", "g1", 4,
    )  # fmt: skip
    assert (started.sampling.temperature, started.tags, started.retry_of) == (0.5, {"k": "v"}, "e0")
    assert records[0].metadata == {RUNNER_METADATA: "runner-1"}  # the runner that holds the episode
    assert all(not r.metadata for r in records[1:])
    assert isinstance(turn, TurnCompleted)
    assert turn.request.sampling.temperature == 0.5  # the episode's sampling reaches the request
    assert (turn.policy_version, turn.engine_id, turn.prefix_break) == (3, "in-process", True)
    assert turn.timings == Timings(queued_ms=1.5, first_token_ms=2.5, total_ms=4.0)
    assert (reply.policy_version, reply.turn_id) == (3, turn.turn_id)
    assert isinstance(reward, RewardAssigned)
    assert (reward.value, reward.source, reward.turn_id) == (0.5, "agent", None)
    assert isinstance(finished, EpisodeFinished)
    metrics = finished.metrics
    assert (metrics["turns"], metrics["reward"]) == (1.0, 0.5)
    assert metrics["prompt_tokens"] == len(turn.prompt_token_ids)
    assert metrics["completion_tokens"] == len(turn.completion_token_ids)
    assert 0.01 <= metrics["llm_s"] <= metrics["duration_s"]  # the LLM call waited 10 ms


async def test_a_session_made_with_only_a_policy_records_the_documented_defaults() -> None:
    store = InMemoryStore()
    session = EpisodeSession(store, PrefixEcho(), policy="main")
    await session.start()
    [record] = await store.read_stream(session.stream)
    started = record.event
    assert isinstance(started, EpisodeStarted)
    assert (started.task, started.task_id, started.agent, started.group_id, started.group_size) == (
        {}, "", "", None, 1,
    )  # fmt: skip
    assert (started.sampling, started.tags, started.retry_of) == (SamplingParams(), {}, None)
    assert not record.metadata


async def test_llm_chat_train_false_records_a_side_call_and_sampling_keywords_still_reach_the_turn() -> None:
    session = EpisodeSession(InMemoryStore(), PrefixEcho(), policy="main")
    await session.start()
    question = [{"role": "user", "content": "q"}]
    await session.llm.chat(question, temperature=0.5)
    await session.llm.chat([{"role": "user", "content": "a title for this chat"}], train=False, max_tokens=7)
    turns = session.episode().turns
    assert [t.train for t in turns] == [None, False]  # None: trained, as on every older turn
    assert (turns[0].request.sampling.temperature, turns[1].request.sampling.max_tokens) == (0.5, 7)


# --- a turn put together from validated parts is the turn validation would make --------------------

TEXT = st.text(alphabet=st.characters(blacklist_categories=["Cs"]), max_size=12)  # JSON-encodable str
IDS = st.lists(st.integers(min_value=0, max_value=2**31 - 1), max_size=8)


@st.composite
def chat_messages(draw: st.DrawFn) -> ChatMessage:
    role = draw(st.sampled_from(["system", "user", "assistant", "tool"]))
    calls = None
    if role == "assistant" and draw(st.booleans()):
        calls = [{"id": "c1", "function": {"name": "f", "arguments": draw(TEXT)}}]
    return ChatMessage.model_validate(
        {
            "role": role,
            "content": draw(st.none() | TEXT),
            "name": draw(st.none() | TEXT),
            "tool_calls": calls,
            "tool_call_id": draw(st.none() | st.just("c1")),
            "reasoning_content": draw(st.none() | TEXT),
        }
    )


TOOLS = st.lists(
    st.builds(
        lambda name, schema: ToolSpec.model_validate({"function": {"name": name, "parameters": schema}}),
        st.sampled_from(["calc", "search"]),
        st.sampled_from([{}, {"type": "object", "properties": {"b": {}, "a": {}}}]),
    ),
    max_size=2,
)


@st.composite
def exchanges(draw: st.DrawFn) -> tuple[LLMRequest, LLMResponse, TurnCompleted | None, int]:
    """A request, its reply (both validated, as a session has them) and a parent with what it shares."""
    messages = draw(st.lists(chat_messages(), min_size=1, max_size=4))
    request = LLMRequest.model_validate(
        {
            "policy": "main",
            "episode_id": "e1",
            "messages": messages,
            "tools": draw(TOOLS),
            "sampling": {
                "temperature": draw(st.just(0.0) | st.floats(FLOAT32_TINY, 2)),
                "stop": draw(st.lists(TEXT, max_size=2)),
            },
            "tool_choice": draw(st.none() | st.builds(ToolChoice, mode=st.sampled_from(["auto", "none"]))),
        }
    )
    completion = draw(IDS)
    parent = factory_turn(seed=draw(st.integers(0, 9))) if draw(st.booleans()) else None
    response = LLMResponse.model_validate(
        {
            "request_id": request.request_id,
            "text": draw(TEXT),
            "tool_calls": draw(
                st.lists(
                    st.builds(lambda a: {"id": "t", "function": {"name": "f", "arguments": a}}, TEXT),
                    max_size=2,
                )
            ),
            "finish_reason": draw(st.sampled_from(["stop", "length", "tool_calls"])),
            "reasoning": draw(st.none() | TEXT),
            "prompt_token_ids": draw(IDS),
            "prompt_prefix_tokens": draw(st.integers(0, 2**31 - 1)) if parent else 0,
            "completion_token_ids": completion,
            "completion_logprobs": draw(
                st.lists(st.floats(-1e30, 0.0), min_size=len(completion), max_size=len(completion))
            ),
            "policy_version": draw(st.integers(0, 2**31 - 1)),
            "consumer_id": draw(TEXT),
            "timings": {"queued_ms": draw(st.floats(0, 1e9)), "total_ms": draw(st.floats(0, 1e9))},
            "prefix_break": draw(st.booleans()),
            "render_drift": draw(st.none() | st.booleans()),
            "chat_template": draw(st.none() | st.just("0123456789ab")),
        }
    )
    shared = draw(st.integers(0, len(messages) - 1)) if parent else 0
    return request, response, parent, shared


@settings(max_examples=200, deadline=None, derandomize=True)
@given(
    exchange=exchanges(),
    delivered=st.sampled_from([None, False]),
    train=st.sampled_from([None, True, False]),
    model=st.sampled_from([None, "claude-sonnet-4-5"]),
    edit=st.sampled_from([None, TurnEdit(turn_id=uuid.UUID(int=7), changes=["tool call c (Bash): ..."])]),
)
def test_a_turn_put_together_without_validation_equals_the_validated_turn_and_encodes_the_same(
    exchange: tuple[LLMRequest, LLMResponse, TurnCompleted | None, int],
    delivered: bool | None,
    train: bool | None,
    model: str | None,
    edit: TurnEdit | None,
) -> None:
    """``turn_event`` skips validation (its parts were validated as the request and the reply): what it
    makes must be the event that validating the same values makes, down to the stored bytes."""
    request, response, parent, shared = exchange
    built = turn_event(
        request, response, parent, shared, delivered=delivered, train=train, model=model, edit=edit
    )
    tools_from_parent = parent is not None and bool(request.tools)
    validated = TurnCompleted(
        event_id=built.event_id,
        turn_id=built.turn_id,
        parent_turn_id=parent.turn_id if parent else None,
        prefix_messages=shared,
        prefix_tokens=response.prompt_prefix_tokens,
        tools_from_parent=tools_from_parent,
        request=TurnRequest(
            messages=request.messages[shared:],
            tools=[] if tools_from_parent else request.tools,
            sampling=request.sampling,
            tool_choice=request.tool_choice,
        ),
        reply=TurnReply(
            text=response.text,
            tool_calls=response.tool_calls,
            finish_reason=response.finish_reason,
            reasoning=response.reasoning,
        ),
        prompt_token_ids=response.prompt_token_ids,
        completion_token_ids=response.completion_token_ids,
        completion_logprobs=response.completion_logprobs,
        policy_version=response.policy_version,
        engine_id=response.consumer_id,
        timings=response.timings,
        prefix_break=response.prefix_break,
        render_drift=response.render_drift,
        chat_template=response.chat_template,
        delivered=delivered,
        train=train,
        model=model,
        edit=edit,
    )
    for name in TurnCompleted.model_fields:
        assert (name, getattr(built, name)) == (name, getattr(validated, name))
        assert type(getattr(built, name)) is type(getattr(validated, name))
    assert built == validated
    assert encode_event(built) == encode_event(validated)  # the log's data, token bytes and content hash
    assert built.model_dump_json() == validated.model_dump_json()


async def test_a_reply_with_a_logprob_count_unlike_its_token_count_fails_the_turn_and_records_nothing() -> (
    None
):
    class Short(PrefixEcho):
        async def __call__(self, request: LLMRequest) -> LLMResponse:
            response = await super().__call__(request)
            return response.model_copy(update={"completion_logprobs": [-0.5]})

    store = InMemoryStore()
    session = EpisodeSession(store, Short(), policy="main")
    await session.start()
    with pytest.raises(InferenceError, match="in-process answered 1 completion_logprobs for 3"):
        await session.chat([{"role": "user", "content": "hi"}])
    assert [r.type for r in await store.read_stream(session.stream)] == ["EpisodeStarted"]


@settings(max_examples=100, deadline=None, derandomize=True)
@given(
    messages=st.lists(chat_messages(), min_size=1, max_size=5),
    tools=TOOLS,
    choice=st.none() | st.builds(ToolChoice, mode=st.sampled_from(["auto", "required"])),
)
def test_a_request_of_models_is_put_together_as_validating_their_dicts_makes_it(
    messages: list[ChatMessage], tools: list[ToolSpec], choice: ToolChoice | None
) -> None:
    session = EpisodeSession(InMemoryStore(), PrefixEcho(), policy="main", episode_id="e1")
    sampling = SamplingParams(max_tokens=6)
    built = session._new_request(messages, tools, sampling, choice, None)
    validated = session._new_request(
        [message.model_dump() for message in messages],
        [tool.model_dump() for tool in tools],
        sampling,
        choice,
        None,
    )
    assert built.model_dump(exclude={"request_id"}) == validated.model_dump(exclude={"request_id"})
    assert built == validated.model_copy(update={"request_id": built.request_id})
    assert built.messages[0] is messages[0]  # the agent's own objects, not copies
    assert built.request_id != validated.request_id


async def test_a_nul_in_a_message_that_a_continuing_turn_adds_is_refused_naming_it() -> None:
    session = EpisodeSession(InMemoryStore(), PrefixEcho(), policy="main")
    await session.start()
    question = ChatMessage(role="user", content="hi")
    reply = await session.chat([question])
    with pytest.raises(InvalidLLMCall, match=r"messages\.2\.content holds a NUL character"):
        await session.chat([question, reply.message, ChatMessage(role="user", content="a\x00b")])
    assert len(session.turns) == 1


class AppendLog(InMemoryStore):
    """The in-memory store, keeping the event types of each append."""

    def __init__(self) -> None:
        super().__init__()
        self.appends: list[list[str]] = []

    async def append(self, stream: str, events: Any, expected_version: int | None = None, **kw: Any) -> Any:
        self.appends.append([event.type for event in events])
        return await super().append(stream, events, expected_version, **kw)


async def test_an_episodes_closing_rewards_are_recorded_with_its_finish_in_one_append() -> None:
    store = AppendLog()
    outcome = await run_episode(ThreeTurnAgent(), EpisodeSession(store, PrefixEcho(), policy="main"))
    assert (outcome.termination, outcome.reward) == ("done", 1.0)
    assert store.appends[-1] == ["RewardAssigned", "EpisodeFinished"]
    assert len(store.appends) == 5  # started, three turns, rewards + finish


async def test_rewards_scored_before_one_that_fails_are_recorded_with_the_error_finish() -> None:
    store = AppendLog()
    session = EpisodeSession(store, PrefixEcho(), policy="main")

    async def agent(task: dict[str, Any], llm: EpisodeLLM) -> dict[str, float]:
        reply = await llm.chat([{"role": "user", "content": "q"}])
        return {str(reply.turn_id): 0.5, "not-a-turn": 1.0}

    outcome = await run_episode(FunctionAgent(agent), session)
    assert outcome.termination == "error"
    assert "reward for turn 'not-a-turn': not a turn id" in (outcome.error or "")
    assert store.appends[-1] == ["RewardAssigned", "EpisodeFinished"]
    events = await recorded(store, session)
    reward, finished = events[-2:]
    assert isinstance(reward, RewardAssigned)
    assert isinstance(finished, EpisodeFinished)
    assert (reward.value, reward.turn_id, finished.metrics["reward"]) == (0.5, session.turns[0].turn_id, 0.5)
