"""The HTTP gateway with the official openai and anthropic SDKs as clients, over real HTTP on a free port,
to real inference consumers over NATS and the real log; proxy-style agents driven by runners."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from consumers.gateway import GatewayConfig, serve_gateway
from consumers.inference import InferenceConfig
from pipeline.dialects import ChoiceData
from pipeline.dialects.anthropic import AnthropicRequestError, parse_messages_request, stop_reason
from pipeline.dialects.base import restore_arguments
from pipeline.episodes import EpisodeSession
from pipeline.episodes.fold import whole_events
from pipeline.examples import ARITHMETIC_TASKS
from pipeline.examples.tools import CALCULATOR, run_calculator, score
from pipeline.gateway import create_gateway, serving_http
from pipeline.inference.client import NatsLLMClient
from pipeline.log import EventStore
from pipeline.runners import load_agent
from pipeline.runners.proxy import ProxyAgentAdapter
from pipeline.runners.runner import Runner, RunnerConfig, TaskSpec
from schemas import (
    ChatMessage,
    EpisodeFinished,
    EpisodeStarted,
    Event,
    FunctionCall,
    PolicyVersionPublished,
    RewardAssigned,
    SamplingParams,
    ToolCall,
    ToolChoice,
    TurnCompleted,
)
from tests.conftest import Servers
from tests.support.backends import RuleBackend, calculator_rule
from tests.support.processes import running
from tests.support.serving import serving
from tests.support.waiting import wait_until

ADMIN = "admin-" + uuid.uuid4().hex
TURNSTILE = [sys.executable, "-m", "consumers.cli"]
CALCULATOR_TOOL: Any = CALCULATOR.model_dump()
ANTHROPIC_CALCULATOR: Any = {
    "name": "calculate",
    "description": CALCULATOR.function.description,
    "input_schema": CALCULATOR.function.parameters,
}


def new_policy() -> str:
    return f"p{uuid.uuid4().hex[:10]}"


@dataclass
class Gateway:
    url: str
    admin: httpx.AsyncClient
    policy: str

    async def session(self, **spec: Any) -> dict[str, Any]:
        response = await self.admin.post("/admin/sessions", json={"policy": self.policy, **spec})
        assert response.status_code == 201, response.text
        body: dict[str, Any] = response.json()
        return body

    def openai(self, api_key: str) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0)

    def anthropic(self, api_key: str) -> anthropic.AsyncAnthropic:
        return anthropic.AsyncAnthropic(base_url=self.url, api_key=api_key, max_retries=0)


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


@asynccontextmanager
async def gateway_for(
    store: EventStore, llm: NatsLLMClient, policy: str, **options: Any
) -> AsyncIterator[Gateway]:
    """A gateway on a free port whose sessions default to ``policy``, and an admin client for it."""
    app = create_gateway(store, llm, admin_key=ADMIN, policy_default=policy, **options)
    headers = {"Authorization": f"Bearer {ADMIN}"}
    async with serving_http(app) as url, httpx.AsyncClient(base_url=url, headers=headers) as admin:
        yield Gateway(url, admin, policy)


@pytest.fixture
async def gateway(
    store: EventStore, llm: NatsLLMClient, calculator_policy: str, request: pytest.FixtureRequest
) -> AsyncIterator[Gateway]:
    async with gateway_for(store, llm, calculator_policy, **getattr(request, "param", {})) as served:
        yield served


async def events_of(store: EventStore, episode_id: str) -> list[Event]:
    recorded = await store.read_stream(f"episode-{episode_id}")
    return whole_events([r.event for r in recorded if r.event is not None])


async def turns_of(store: EventStore, episode_id: str) -> list[TurnCompleted]:
    return [e for e in await events_of(store, episode_id) if isinstance(e, TurnCompleted)]


def assert_token_exact_child(parent: TurnCompleted, child: TurnCompleted) -> None:
    """The child was prompted with the parent's exact tokens first. On the test backends this proves the
    gateway sent the right prefix (they copy it: tests/support/backends.py); engines are checked elsewhere."""
    assert child.parent_turn_id == parent.turn_id
    prefix = [*parent.prompt_token_ids, *parent.completion_token_ids]
    assert child.prompt_token_ids[: len(prefix)] == prefix


# ---- OpenAI ------------------------------------------------------------------------------------------


async def openai_calculator(client: openai.AsyncOpenAI, question: str, **options: Any) -> list[Any]:
    """The calculator loop written for the OpenAI SDK; the completions it got."""
    messages: list[Any] = [{"role": "user", "content": question}]
    completions = []
    for _ in range(4):
        completion = await client.chat.completions.create(
            model="anything", messages=messages, tools=[CALCULATOR_TOOL], **options
        )
        completions.append(completion)
        message = completion.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            function = getattr(call, "function", None)
            assert function is not None
            tool_call = ToolCall(
                id=call.id, function=FunctionCall(name=function.name, arguments=function.arguments)
            )
            messages.append({"role": "tool", "tool_call_id": call.id, "content": run_calculator(tool_call)})
    return completions


async def test_openai_sdk_multi_turn_tool_calls_are_recorded_token_exact(
    gateway: Gateway, store: EventStore
) -> None:
    session = await gateway.session(
        task={"question": "What is 17 * 3?"}, task_id="t1", tags={"via": "openai"}
    )
    assert session["base_url"] == f"{gateway.url}/v1"
    async with gateway.openai(session["api_key"]) as client:
        first, second = await openai_calculator(client, "What is 17 * 3?", seed=7)
        models = await client.models.list()

    call = first.choices[0].message.tool_calls[0]
    assert first.choices[0].finish_reason == "tool_calls"
    assert second.choices[0].message.content == "The answer is 51."
    assert second.model == gateway.policy
    assert [m.id for m in models.data] == [gateway.policy]
    turns = await turns_of(store, session["session_id"])
    assert len(turns) == 2
    assert turns[0].reply.tool_calls[0].id == call.id
    assert turns[0].request.sampling.seed == 7
    assert_token_exact_child(turns[0], turns[1])
    assert second.usage is not None
    assert second.usage.prompt_tokens == len(turns[1].prompt_token_ids)
    assert second.usage.completion_tokens == len(turns[1].completion_token_ids)
    extra = second.model_dump()["turnstile"]
    assert extra["turn_ids"] == [str(turns[1].turn_id)]
    assert extra["completion_token_ids"] == [turns[1].completion_token_ids]
    # the prompt's ids as the turn records them: the parent's first prefix_tokens ids, then the added ones
    # (a reply stays small as the conversation grows); the whole prompt only when asked for
    assert extra["parent_turn_id"] == str(turns[0].turn_id)
    assert extra["prefix_tokens"] == len(turns[0].prompt_token_ids) + len(turns[0].completion_token_ids)
    parent_ids = [*turns[0].prompt_token_ids, *turns[0].completion_token_ids]
    assert parent_ids[: extra["prefix_tokens"]] + extra["added_prompt_token_ids"] == turns[1].prompt_token_ids
    assert "prompt_token_ids" not in extra
    first_extra = first.model_dump()["turnstile"]
    assert (first_extra["parent_turn_id"], first_extra["prefix_tokens"]) == (None, 0)
    assert first_extra["added_prompt_token_ids"] == turns[0].prompt_token_ids

    reward = await gateway.admin.post(
        f"/admin/sessions/{session['session_id']}/reward", json={"value": 1.0, "turn_id": "last"}
    )
    assert reward.status_code == 200, reward.text
    ended = await gateway.admin.post(f"/admin/sessions/{session['session_id']}/end", json={})
    assert ended.json()["termination"] == "done"
    events = await events_of(store, session["session_id"])
    assert [type(e).__name__ for e in events] == [
        "EpisodeStarted",
        "TurnCompleted",
        "TurnDelivered",
        "TurnCompleted",
        "TurnDelivered",
        "RewardAssigned",
        "EpisodeFinished",
    ]  # fmt: skip (each reply's delivery is recorded with the session's next event)
    started, rewarded = events[0], events[5]
    assert isinstance(started, EpisodeStarted)
    assert (started.task_id, started.tags, started.policy) == ("t1", {"via": "openai"}, gateway.policy)
    assert isinstance(rewarded, RewardAssigned)
    assert (rewarded.turn_id, rewarded.value) == (turns[1].turn_id, 1.0)

    async with gateway.openai(session["api_key"]) as client:
        with pytest.raises(openai.ConflictError, match="ended"):  # an ended session's key: 409, not 401
            await client.chat.completions.create(model="x", messages=[{"role": "user", "content": "more"}])


async def test_openai_n_logprobs_and_sampling_reach_the_turns(gateway: Gateway, store: EventStore) -> None:
    session = await gateway.session(sampling={"temperature": 0.5, "max_tokens": 40})
    async with gateway.openai(session["api_key"]) as client:
        completion = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "What is 2 + 2?"}], n=2, logprobs=True,
            top_p=0.9, stop=["###"], max_completion_tokens=30,
        )  # fmt: skip
    turns = await turns_of(store, session["session_id"])
    assert len(completion.choices) == len(turns) == 2
    assert {t.parent_turn_id for t in turns} == {None}
    sampling = turns[0].request.sampling
    assert (sampling.temperature, sampling.top_p, sampling.max_tokens, sampling.stop) == (
        0.5,
        0.9,
        30,
        ["###"],
    )
    logprobs = completion.choices[0].logprobs
    assert logprobs is not None
    assert logprobs.content is not None
    assert [entry.logprob for entry in logprobs.content] == turns[0].completion_logprobs


# ---- Anthropic ---------------------------------------------------------------------------------------


async def anthropic_calculator(client: anthropic.AsyncAnthropic, question: str, **options: Any) -> list[Any]:
    """The calculator loop written for the Anthropic SDK; the messages it got."""
    messages: list[Any] = [{"role": "user", "content": question}]
    replies = []
    for _ in range(4):
        reply = await client.messages.create(
            model="claude-anything", max_tokens=64, system="Use the calculator.", messages=messages,
            tools=[ANTHROPIC_CALCULATOR], **options,
        )  # fmt: skip
        replies.append(reply)
        messages.append({"role": "assistant", "content": [block.model_dump() for block in reply.content]})
        uses = [block for block in reply.content if block.type == "tool_use"]
        if not uses:
            break
        results = []
        for use in uses:
            call = ToolCall(id=use.id, function=FunctionCall(name=use.name, arguments=json.dumps(use.input)))
            results.append({"type": "tool_result", "tool_use_id": use.id, "content": run_calculator(call)})
        messages.append({"role": "user", "content": results})
    return replies


async def test_anthropic_sdk_multi_turn_tool_use_is_recorded_token_exact(
    gateway: Gateway, store: EventStore
) -> None:
    session = await gateway.session(task={"question": "What is 6 * 7?"})
    async with gateway.anthropic(session["api_key"]) as client:
        first, second = await anthropic_calculator(client, "What is 6 * 7?", stop_sequences=["###"])

    assert first.stop_reason == "tool_use"
    [use] = first.content
    assert use.type == "tool_use"
    assert (use.name, use.input) == ("calculate", {"expression": "6 * 7"})
    assert second.stop_reason == "end_turn"
    assert [(b.type, getattr(b, "text", None)) for b in second.content] == [("text", "The answer is 42.")]
    turns = await turns_of(store, session["session_id"])
    assert len(turns) == 2
    assert turns[0].reply.tool_calls[0].id == use.id  # tool_use ids are the recorded tool call ids
    first_request = turns[0].request
    assert [(m.role, m.content) for m in first_request.messages] == [
        ("system", "Use the calculator."), ("user", "What is 6 * 7?"),
    ]  # fmt: skip
    assert first_request.tools[0].function.parameters == CALCULATOR.function.parameters
    assert first_request.sampling.stop == ["###"]
    assert first_request.sampling.max_tokens == 64
    tool_message = turns[1].request.messages[-1]
    assert (tool_message.role, tool_message.tool_call_id, tool_message.content) == ("tool", use.id, "42")
    assert_token_exact_child(turns[0], turns[1])
    assert (second.usage.input_tokens, second.usage.output_tokens) == (
        len(turns[1].prompt_token_ids), len(turns[1].completion_token_ids),
    )  # fmt: skip

    # the session's own key rewards and ends it; then it is refused
    own = {"x-api-key": session["api_key"]}
    async with httpx.AsyncClient(base_url=gateway.url, headers=own) as http:
        assert (await http.post("/v1/session/reward", json={"value": 0.5})).status_code == 200
        assert (await http.post("/v1/session/end", json={"termination": "done"})).status_code == 200
        refused = await http.post("/v1/session/reward", json={"value": 1.0})
    assert refused.status_code == 409
    assert "ended (done)" in refused.json()["error"]["message"]
    events = await events_of(store, session["session_id"])
    assert isinstance(events[-2], RewardAssigned)
    assert events[-2].turn_id is None
    assert isinstance(events[-1], EpisodeFinished)
    assert events[-1].termination == "done"
    async with gateway.anthropic(session["api_key"]) as client:
        with pytest.raises(anthropic.ConflictError, match="ended"):
            await client.messages.create(
                model="m", max_tokens=8, messages=[{"role": "user", "content": "hi"}]
            )


async def test_anthropic_tool_arguments_round_trip_exactly_when_json_would_differ(
    servers: Servers, store: EventStore, llm: NatsLLMClient
) -> None:
    """The model wrote its arguments without spaces; the client sends back parsed input: the gateway
    restores the recorded text so the next turn still extends the first token-exactly."""
    policy = new_policy()

    def rule(request: Any) -> str:
        if request.messages[-1].role == "tool":
            return "done"
        return '<tool_call>{"name": "calculate", "arguments": "{\\"expression\\":\\"1+1\\"}"}</tool_call>'

    config = InferenceConfig(servers.nats_url, policy, backend="scripted", heartbeat_interval=0.5)
    async with serving(config, RuleBackend(rule)), gateway_for(store, llm, policy) as gateway:
        session = await gateway.session()
        async with gateway.anthropic(session["api_key"]) as client:
            await anthropic_calculator(client, "1+1?")
    first, second = await turns_of(store, session["session_id"])
    assert first.reply.tool_calls[0].function.arguments == '{"expression":"1+1"}'
    assert second.request.messages[-2].tool_calls is not None
    assert second.request.messages[-2].tool_calls[0].function.arguments == '{"expression":"1+1"}'
    assert_token_exact_child(first, second)


@pytest.mark.parametrize("route", ["chat", "responses"])
async def test_openai_tool_arguments_sent_back_re_serialized_still_continue_the_turn(
    gateway: Gateway, store: EventStore, route: str
) -> None:
    """opencode (the Vercel AI SDK) sends a tool call's arguments back through ``JSON.stringify``, without
    the model's spaces: the gateway restores the recorded text, so the next call continues the turn."""
    session = await gateway.session()
    headers = {"Authorization": f"Bearer {session['api_key']}"}
    question = {"role": "user", "content": "What is 2 + 3?"}
    tools = [CALCULATOR_TOOL]
    async with httpx.AsyncClient(base_url=gateway.url, headers=headers) as http:
        if route == "chat":
            first = await http.post("/v1/chat/completions", json={"messages": [question], "tools": tools})
            call = first.json()["choices"][0]["message"]["tool_calls"][0]
            compact = json.dumps(json.loads(call["function"]["arguments"]), separators=(",", ":"))
            assert compact != call["function"]["arguments"]
            call["function"]["arguments"] = compact
            sent = [question, {"role": "assistant", "content": "", "tool_calls": [call]}]
            sent.append({"role": "tool", "tool_call_id": call["id"], "content": "5"})
            second = await http.post("/v1/chat/completions", json={"messages": sent, "tools": tools})
        else:
            tool = {"type": "function", **CALCULATOR_TOOL["function"]}
            first = await http.post("/v1/responses", json={"input": [question], "tools": [tool]})
            item = next(i for i in first.json()["output"] if i["type"] == "function_call")
            item["arguments"] = json.dumps(json.loads(item["arguments"]), separators=(",", ":"))
            output = {"type": "function_call_output", "call_id": item["call_id"], "output": "5"}
            sent = [question, item, output]
            second = await http.post("/v1/responses", json={"input": sent, "tools": [tool]})
        assert second.status_code == 200, second.text
    first_turn, second_turn = await turns_of(store, session["session_id"])
    assert_token_exact_child(first_turn, second_turn)
    recorded = second_turn.request.messages[-2].tool_calls
    assert recorded is not None
    assert recorded[0].function.arguments == first_turn.reply.tool_calls[0].function.arguments


def test_re_serialized_arguments_are_restored_only_when_they_hold_the_same_json() -> None:
    known = {"a": '{"x": 1, "y": [true, "z"]}'}

    def sent_back(arguments: str, call_id: str = "a") -> str:
        call = ToolCall(id=call_id, function=FunctionCall(name="f", arguments=arguments))
        message = ChatMessage(role="assistant", content="", tool_calls=[call])
        restored = restore_arguments([message], known)[0].tool_calls
        assert restored is not None
        return restored[0].function.arguments

    assert sent_back('{"y":[true,"z"],"x":1.0}') == known["a"]  # order, spacing, 1 and 1.0: one JSON value
    assert sent_back('{"x":1,"y":[1,"z"]}') == '{"x":1,"y":[1,"z"]}'  # true is not 1
    assert sent_back('{"x":2,"y":[true,"z"]}') == '{"x":2,"y":[true,"z"]}'  # another value
    assert sent_back("not json") == "not json"
    assert sent_back('{"x":1,"y":[true,"z"]}', call_id="b") == '{"x":1,"y":[true,"z"]}'  # not recorded here


def test_messages_tool_inputs_are_restored_to_the_recorded_text_by_the_same_json_rule() -> None:
    known = {"toolu_1": '{"x": 1, "y": [true, "z"]}'}

    def sent_back(tool_input: dict[str, object]) -> str:
        tool_use = {"type": "tool_use", "id": "toolu_1", "name": "f", "input": tool_input}
        tool_result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "ok"}
        body = {
            "max_tokens": 5,
            "messages": [
                {"role": "user", "content": "go"},
                {"role": "assistant", "content": [tool_use]},
                {"role": "user", "content": [tool_result]},
            ],
        }
        calls = parse_messages_request(body, known_arguments=known).messages[1].tool_calls
        assert calls is not None
        return calls[0].function.arguments

    assert sent_back({"y": [True, "z"], "x": 1.0}) == known["toolu_1"]  # the same JSON value
    assert sent_back({"x": 1, "y": [1, "z"]}) == '{"x": 1, "y": [1, "z"]}'  # 1 is not true
    assert sent_back({"x": 2, "y": [True, "z"]}) == '{"x": 2, "y": [true, "z"]}'  # another value


def test_anthropic_translation_keeps_block_order_and_reads_stop_reasons() -> None:
    tool_use = {"type": "tool_use", "id": "toolu_1", "name": "calculate", "input": {"expression": "1+1"}}
    result_text = [{"type": "text", "text": "2"}]
    tool_result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": result_text}
    body = {
        "model": "m",
        "max_tokens": 9,
        "system": [{"type": "text", "text": "Be brief."}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "Checking."}, tool_use]},
            {"role": "user", "content": [tool_result, {"type": "text", "text": "and?"}]},
        ],
        "tools": [ANTHROPIC_CALCULATOR],
        "tool_choice": {"type": "any"},
        "top_k": 5,
        "metadata": {"user_id": "u"},
    }
    call = parse_messages_request(body, defaults=SamplingParams(temperature=0.3))
    assert [(m.role, m.content, m.tool_call_id) for m in call.messages] == [
        ("system", "Be brief.", None), ("user", "a\nb", None), ("assistant", "Checking.", None),
        ("tool", "2", "toolu_1"), ("user", "and?", None),
    ]  # fmt: skip
    assert call.messages[2].tool_calls is not None
    assert call.messages[2].tool_calls[0].function.arguments == '{"expression": "1+1"}'
    assert (call.sampling.max_tokens, call.sampling.top_k, call.sampling.temperature) == (9, 5, 0.3)
    assert call.tool_choice == ToolChoice(mode="required")

    def choice(text: str, finish: Any = "stop") -> ChoiceData:
        return ChoiceData(text, [], finish, [1], [-0.1])

    assert stop_reason(choice("done"), ["###"]) == ("end_turn", None)
    assert stop_reason(choice("x END y ###"), ["###", "END"]) == ("stop_sequence", "END")
    assert stop_reason(choice("cut", "length"), []) == ("max_tokens", None)
    with pytest.raises(AnthropicRequestError, match=r"messages\[0\]\.role"):
        parse_messages_request({"max_tokens": 5, "messages": [{"role": "tool", "content": "x"}]})


async def test_a_call_over_max_turns_is_refused_and_the_session_ends_max_turns(
    gateway: Gateway, store: EventStore
) -> None:
    session = await gateway.session(max_turns=1)
    async with gateway.openai(session["api_key"]) as client:
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "one"}])
        with pytest.raises(openai.BadRequestError) as refused:
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "two"}])
    assert refused.value.code == "max_turns_exceeded"
    ended = await gateway.admin.post(f"/admin/sessions/{session['session_id']}/end")
    assert (ended.json()["termination"], ended.json()["turns"]) == ("max_turns", 1)


# ---- streaming ---------------------------------------------------------------------------------------


async def test_openai_streaming_reassembles_the_reply_with_a_usage_chunk(
    gateway: Gateway, store: EventStore
) -> None:
    session = await gateway.session()
    async with gateway.openai(session["api_key"]) as client:
        stream = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "What is 5 - 3?"}], tools=[CALCULATOR_TOOL],
            stream=True, stream_options={"include_usage": True},
        )  # fmt: skip
        chunks = [chunk async for chunk in stream]
    [turn] = await turns_of(store, session["session_id"])
    calls = [call for c in chunks if c.choices for call in c.choices[0].delta.tool_calls or []]
    assert [(call.id, call.function.arguments if call.function else None) for call in calls] == [
        (turn.reply.tool_calls[0].id, '{"expression": "5 - 3"}')
    ]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    usage = chunks[-1].usage
    assert usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (
        len(turn.prompt_token_ids), len(turn.completion_token_ids),
    )  # fmt: skip


async def test_anthropic_streaming_events_build_the_same_message(gateway: Gateway, store: EventStore) -> None:
    session = await gateway.session()
    question = [{"role": "user", "content": "What is 9 / 3?"}]
    async with gateway.anthropic(session["api_key"]) as client:
        async with client.messages.stream(
            model="m", max_tokens=64, messages=question, tools=[ANTHROPIC_CALCULATOR]
        ) as stream:
            kinds = [event.type async for event in stream]
            streamed = await stream.get_final_message()
        plain = await client.messages.create(
            model="m", max_tokens=64, messages=question, tools=[ANTHROPIC_CALCULATOR]
        )
    assert kinds[0] == "message_start"
    assert kinds[-1] == "message_stop"
    assert {"content_block_start", "content_block_stop", "message_delta"} <= set(kinds)
    assert streamed.stop_reason == plain.stop_reason == "tool_use"
    assert streamed.content[0].type == plain.content[0].type == "tool_use"
    assert streamed.content[0].input == plain.content[0].input == {"expression": "9 / 3"}
    turns = await turns_of(store, session["session_id"])
    assert streamed.content[0].id == turns[0].reply.tool_calls[0].id
    assert streamed.usage.output_tokens == len(turns[0].completion_token_ids)
    assert turns[0].completion_token_ids == turns[1].completion_token_ids


async def openai_text(gateway: Gateway, api_key: str, messages: Any, *, stream: bool) -> str:
    async with gateway.openai(api_key) as client:
        if stream:
            chunks = await client.chat.completions.create(
                model="m", messages=messages, max_tokens=12, stream=True
            )
            return "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])
        completion = await client.chat.completions.create(model="m", messages=messages, max_tokens=12)
        return completion.choices[0].message.content or ""


async def anthropic_text(gateway: Gateway, api_key: str, messages: Any, *, stream: bool) -> str:
    async with gateway.anthropic(api_key) as client:
        if stream:
            async with client.messages.stream(model="m", max_tokens=12, messages=messages) as events:
                message = await events.get_final_message()
        else:
            message = await client.messages.create(model="m", max_tokens=12, messages=messages)
        return "".join(getattr(block, "text", "") for block in message.content)


async def test_streamed_and_plain_calls_record_identical_tokens_on_the_tiny_model(
    servers: Servers, store: EventStore, llm: NatsLLMClient, tiny_model_dir: Path
) -> None:
    """Seeded sampling on a real model: streamed calls record the plain calls' exact tokens, in both APIs."""
    policy = new_policy()
    config = InferenceConfig(servers.nats_url, policy, backend="torch", model=tiny_model_dir)
    question = [{"role": "user", "content": "Tell me a story."}]
    recorded = []
    async with serving(config), gateway_for(store, llm, policy) as gateway:
        for call, stream in (
            (openai_text, False),
            (openai_text, True),
            (anthropic_text, False),
            (anthropic_text, True),
        ):
            session = await gateway.session(sampling={"seed": 11, "temperature": 1.0})
            text = await call(gateway, session["api_key"], question, stream=stream)
            [turn] = await turns_of(store, session["session_id"])
            assert text == turn.reply.text
            recorded.append((turn.prompt_token_ids, turn.completion_token_ids, turn.completion_logprobs))
    assert len(recorded[0][1]) == 12
    assert recorded[0] == recorded[1] == recorded[2] == recorded[3]


async def test_openai_logprobs_show_each_tokens_text_bytes_and_top_alternatives_on_the_tiny_model(
    servers: Servers, store: EventStore, llm: NatsLLMClient, tiny_model_dir: Path
) -> None:
    policy = new_policy()
    config = InferenceConfig(servers.nats_url, policy, backend="torch", model=tiny_model_dir)
    async with serving(config), gateway_for(store, llm, policy) as gateway:
        session = await gateway.session(sampling={"seed": 3, "max_tokens": 10})
        async with gateway.openai(session["api_key"]) as client:
            completion = await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "Hello!"}], logprobs=True, top_logprobs=2
            )
            plain = await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "Hello!"}], logprobs=True
            )
    first, second = await turns_of(store, session["session_id"])
    logprobs = completion.choices[0].logprobs
    assert logprobs is not None
    assert logprobs.content is not None
    entries = logprobs.content
    assert [entry.logprob for entry in entries] == first.completion_logprobs
    assert all(entry.bytes is not None and not entry.token.startswith("<") for entry in entries[:-1])
    assert all(len(entry.top_logprobs) == 2 for entry in entries)
    assert all(entry.top_logprobs[0].logprob >= entry.logprob for entry in entries)
    spelled = b"".join(bytes(entry.bytes or []) for entry in entries if entry.token != "<|im_end|>")
    assert spelled.decode("utf-8", errors="replace") == completion.choices[0].message.content
    assert plain.choices[0].logprobs is not None
    assert plain.choices[0].logprobs.content is not None
    assert all(entry.top_logprobs == [] for entry in plain.choices[0].logprobs.content)  # none asked
    assert [e.logprob for e in plain.choices[0].logprobs.content] == second.completion_logprobs


# ---- bad input, bad keys, admission ------------------------------------------------------------------


async def test_malformed_bodies_get_400_in_each_apis_shape_and_the_gateway_stays_up(gateway: Gateway) -> None:
    session = await gateway.session()
    key = session["api_key"]
    async with httpx.AsyncClient(base_url=gateway.url, headers={"Authorization": f"Bearer {key}"}) as http:
        not_json = await http.post("/v1/chat/completions", content=b"{not json")
        bad_role = await http.post(
            "/v1/chat/completions", json={"model": "m", "messages": [{"role": "robot"}]}
        )
        no_max_tokens = await http.post(
            "/v1/messages", json={"model": "m", "messages": [{"role": "user", "content": "x"}]}
        )
        image = await http.post(
            "/v1/messages",
            json={
                "model": "m",
                "max_tokens": 5,
                "messages": [{"role": "user", "content": [{"type": "image"}]}],
            },
        )
        not_json_anthropic = await http.post("/v1/messages", content=b"[")
        unknown = await http.get("/v1/nothing-here")
    assert not_json.status_code == 400
    assert not_json.json()["error"]["type"] == "invalid_request_error"
    assert "not valid JSON" in not_json.json()["error"]["message"]
    assert bad_role.status_code == 400
    assert bad_role.json()["error"]["param"] == "messages[0].role"
    for response, names in (
        (no_max_tokens, "max_tokens"),
        (image, "messages[0].content[0].type"),
        (not_json_anthropic, "JSON"),
    ):
        assert response.status_code == 400
        body = response.json()
        assert body["type"] == "error"
        assert body["error"]["type"] == "invalid_request_error"
        assert names in body["error"]["message"]
    assert unknown.status_code == 404
    assert "error" in unknown.json()

    async with gateway.openai(key) as client:
        with pytest.raises(openai.BadRequestError) as refused:
            await client.chat.completions.create(model="m", messages=[], temperature=-1)
        assert "messages" in str(refused.value)
        with pytest.raises(openai.BadRequestError, match="NUL"):
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "a\x00b"}])
        ok = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "What is 1 + 1?"}]
        )
    assert ok.choices[0].finish_reason == "tool_calls"
    async with gateway.anthropic(key) as anthropic_client:
        with pytest.raises(anthropic.BadRequestError, match="tool_choice"):
            await anthropic_client.messages.create(
                model="m", max_tokens=5, messages=[{"role": "user", "content": "x"}],
                tool_choice={"type": "tool", "name": "missing"},
            )  # fmt: skip


async def test_bad_keys_get_401_and_learn_nothing_about_other_sessions(
    gateway: Gateway, store: EventStore
) -> None:
    mine, other = await gateway.session(), await gateway.session()
    async with httpx.AsyncClient(base_url=gateway.url) as http:
        chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        no_key = await http.post("/v1/chat/completions", json=chat)
        wrong = await http.post(
            "/v1/chat/completions", json=chat, headers={"Authorization": "Bearer ts-nope"}
        )
        wrong_anthropic = await http.post(
            "/v1/messages", json={**chat, "max_tokens": 5}, headers={"x-api-key": other["api_key"] + "x"}
        )
        as_admin = await http.post(
            "/admin/sessions", json={}, headers={"Authorization": f"Bearer {mine['api_key']}"}
        )
        others_reward = await http.post(
            f"/admin/sessions/{other['session_id']}/reward", json={"value": 1.0},
            headers={"Authorization": f"Bearer {mine['api_key']}"},
        )  # fmt: skip
        missing_reward = await http.post(
            f"/admin/sessions/{uuid.uuid4().hex}/reward", json={"value": 1.0},
            headers={"Authorization": f"Bearer {mine['api_key']}"},
        )  # fmt: skip
    for response in (no_key, wrong, as_admin, others_reward, missing_reward):
        assert response.status_code == 401, response.text
        assert other["session_id"] not in response.text
    assert others_reward.json() == missing_reward.json()  # an existing and a made-up session look alike
    assert wrong.json()["error"]["code"] == "invalid_api_key"
    assert wrong_anthropic.status_code == 401
    assert wrong_anthropic.json()["error"]["type"] == "authentication_error"
    assert [type(e).__name__ for e in await events_of(store, other["session_id"])] == ["EpisodeStarted"]

    async with gateway.openai("ts-wrong") as client:
        with pytest.raises(openai.AuthenticationError):
            await client.models.list()
    async with gateway.openai(ADMIN) as client:  # the admin key sees the policies, and makes no turns
        assert gateway.policy in [m.id for m in (await client.models.list()).data]
        with pytest.raises(openai.AuthenticationError):
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])


async def test_rewards_by_turn_id_last_and_episode(gateway: Gateway, store: EventStore) -> None:
    session = await gateway.session()
    sid = session["session_id"]
    async with gateway.openai(session["api_key"]) as client:
        await openai_calculator(client, "What is 2 * 8?")
    turns = await turns_of(store, sid)
    post = gateway.admin.post
    assert (
        await post(f"/admin/sessions/{sid}/reward", json={"value": 0.25, "turn_id": str(turns[0].turn_id)})
    ).status_code == 200
    assert (
        await post(f"/admin/sessions/{sid}/reward", json={"value": 0.5, "turn_id": "last"})
    ).status_code == 200
    assert (await post(f"/admin/sessions/{sid}/reward", json={"value": 1.0})).status_code == 200
    bad_turn = await post(f"/admin/sessions/{sid}/reward", json={"value": 1.0, "turn_id": str(uuid.uuid4())})
    bad_value = await post(f"/admin/sessions/{sid}/reward", json={"value": "lots"})
    unknown_field = await post(f"/admin/sessions/{sid}/reward", json={"value": 1.0, "turn": "last"})
    assert [r.status_code for r in (bad_turn, bad_value, unknown_field)] == [400, 400, 400]
    assert "no such turn" in bad_turn.json()["error"]["message"]
    status = (await gateway.admin.get(f"/admin/sessions/{sid}")).json()
    assert (status["turns"], status["reward"], status["last_turn_id"]) == (2, 1.75, str(turns[1].turn_id))
    ended = await post(
        f"/admin/sessions/{sid}/end", json={"termination": "truncated", "metrics": {"steps": 3}}
    )
    assert ended.json()["termination"] == "truncated"
    rewards = [e for e in await events_of(store, sid) if isinstance(e, RewardAssigned)]
    assert [(r.turn_id, r.value, r.source) for r in rewards] == [
        (turns[0].turn_id, 0.25, "gateway"), (turns[1].turn_id, 0.5, "gateway"), (None, 1.0, "gateway"),
    ]  # fmt: skip
    finished = (await events_of(store, sid))[-1]
    assert isinstance(finished, EpisodeFinished)
    assert (finished.termination, finished.metrics["steps"], finished.metrics["reward"]) == (
        "truncated",
        3,
        1.75,
    )
    assert (await post(f"/admin/sessions/{sid}/end", json={})).status_code == 409  # ended: not open any more


async def test_a_session_with_an_episode_id_the_log_holds_gets_409_naming_its_stream(
    gateway: Gateway, store: EventStore
) -> None:
    first = await gateway.session(episode_id=f"mine-{uuid.uuid4().hex}")
    episode_id = first["session_id"]
    recorded = await store.read_all()
    taken = await gateway.admin.post("/admin/sessions", json={"episode_id": episode_id})
    assert taken.status_code == 409
    error = taken.json()["error"]
    assert error["param"] == "episode_id"
    assert error["message"].startswith(
        f"episode {episode_id!r} already exists: stream 'episode-{episode_id}' holds it"
    )
    assert await store.read_all() == recorded
    assert (await gateway.session())["session_id"] != episode_id  # the gateway goes on


@pytest.mark.parametrize("gateway", [{"capacity": 2, "max_staleness": 1, "retry_after": 3}], indirect=True)
async def test_capacity_and_staleness_refuse_new_sessions_with_429(
    gateway: Gateway, store: EventStore
) -> None:
    first, second = await gateway.session(), await gateway.session()
    full = await gateway.admin.post("/admin/sessions", json={})
    assert full.status_code == 429
    assert full.headers["retry-after"] == "3"
    assert "capacity of 2" in full.json()["error"]["message"]
    async with gateway.openai(first["api_key"]) as client:  # the consumers answer with version 0
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    await gateway.admin.post(f"/admin/sessions/{first['session_id']}/end", json={})
    third = await gateway.session()  # a slot is free again, and nothing newer is published

    await store.append(
        f"policy-{gateway.policy}",
        [PolicyVersionPublished(policy=gateway.policy, version=2, checkpoint="c2")],
    )
    await gateway.admin.post(f"/admin/sessions/{second['session_id']}/end", json={})
    await asyncio.sleep(1.1)  # the published version is looked up at most once a second
    stale = await gateway.admin.post("/admin/sessions", json={})
    assert stale.status_code == 429, stale.text
    assert "version 2" in stale.json()["error"]["message"]
    assert stale.headers["retry-after"] == "3"
    listing = (await gateway.admin.get("/admin/sessions")).json()
    assert [s["session_id"] for s in listing["data"]] == [third["session_id"]]


@pytest.mark.parametrize("gateway", [{"idle_timeout": 0.3}], indirect=True)
async def test_idle_sessions_end_as_timeout(gateway: Gateway, store: EventStore) -> None:
    session = await gateway.session()

    async def ended() -> bool:
        return isinstance((await events_of(store, session["session_id"]))[-1], EpisodeFinished)

    await wait_until(ended, 60, "the idle session to end")  # a bound for a loaded machine
    events = await events_of(store, session["session_id"])
    assert isinstance(events[-1], EpisodeFinished)
    assert events[-1].termination == "timeout"
    async with gateway.openai(session["api_key"]) as client:
        with pytest.raises(openai.ConflictError, match=r"ended \(timeout\)"):
            await client.models.list()


# ---- the service and the command ---------------------------------------------------------------------


async def test_serve_gateway_serves_until_stopped_and_cancels_open_sessions(
    servers: Servers, database_url: str, store: EventStore, calculator_policy: str
) -> None:
    config = GatewayConfig(
        database_url, servers.nats_url, admin_key=ADMIN, policy_default=calculator_policy, port=0
    )
    stop = asyncio.Event()
    ready: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    service = asyncio.create_task(serve_gateway(config, stop=stop, ready=ready.set_result))
    url = await asyncio.wait_for(ready, 30)
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {ADMIN}"}) as admin:
        session = (await admin.post("/admin/sessions", json={"task": {"q": 1}})).json()
    async with openai.AsyncOpenAI(base_url=session["base_url"], api_key=session["api_key"]) as client:
        await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "What is 3 + 4?"}]
        )
    stop.set()
    await asyncio.wait_for(service, 30)
    events = await events_of(store, session["session_id"])
    assert [type(e).__name__ for e in events] == [
        "EpisodeStarted", "TurnCompleted", "TurnDelivered", "EpisodeFinished",
    ]  # fmt: skip
    assert isinstance(events[-1], EpisodeFinished)
    assert events[-1].termination == "cancelled"
    runner_ids = [
        r.metadata.get("runner") for r in await store.read_stream(f"episode-{session['session_id']}")
    ]
    assert runner_ids[0]  # the gateway's lease: a dead gateway's sessions are recovered as aborted


def test_serve_gateway_refuses_to_start_without_an_admin_key() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TURNSTILE_")}
    result = subprocess.run(
        [*TURNSTILE, "serve", "gateway", "--admin-key-env", "TURNSTILE_NO_SUCH_KEY"],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2
    assert "no admin key: set TURNSTILE_NO_SUCH_KEY" in " ".join(result.stderr.split())


# ---- proxy-style agents ------------------------------------------------------------------------------


class OpenAIProxyAgent:
    """A calculator agent written for the OpenAI SDK, given only a base URL and a key."""

    async def run(self, task: dict[str, Any], base_url: str, api_key: str) -> float:
        async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
            completions = await openai_calculator(client, str(task["question"]), max_tokens=64)
        return score(completions[-1].choices[0].message.content or "", task["answer"])


class AnthropicProxyAgent:
    """The same, written for the Anthropic SDK (its base URL may end in /v1 too)."""

    async def run(self, task: dict[str, Any], base_url: str, api_key: str) -> None:
        async with anthropic.AsyncAnthropic(base_url=base_url, api_key=api_key, max_retries=0) as client:
            replies = await anthropic_calculator(client, str(task["question"]))
        text = "".join(getattr(block, "text", "") for block in replies[-1].content)
        async with httpx.AsyncClient(base_url=base_url, headers={"x-api-key": api_key}) as http:
            response = await http.post(
                "session/reward", json={"value": score(text, task["answer"]), "turn_id": "last"}
            )
            response.raise_for_status()


async def talkative_proxy_agent(task: dict[str, Any], base_url: str, api_key: str) -> None:
    async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
        for n in range(10):
            await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": f"turn {n}"}]
            )


async def test_proxy_agents_run_under_a_runner_with_groups(
    store: EventStore, llm: NatsLLMClient, calculator_policy: str
) -> None:
    for spec in (
        "tests.integration.test_gateway:OpenAIProxyAgent",
        "tests.integration.test_gateway:AnthropicProxyAgent",
    ):
        agent = load_agent(spec)
        assert isinstance(agent, ProxyAgentAdapter)
        config = RunnerConfig(policy=calculator_policy, agent_name=spec, group_size=2)
        runner = Runner(agent, store=store, llm=llm, config=config)
        outcomes = await runner.run_group(
            TaskSpec(task={"question": "What is 12 * 12?", "answer": 144}, task_id="sq")
        )
        assert [(o.termination, o.reward, o.turns) for o in outcomes] == [("done", 1.0, 2)] * 2, outcomes
        for outcome in outcomes:
            first, second = await turns_of(store, outcome.episode_id)
            assert_token_exact_child(first, second)
            started = (await events_of(store, outcome.episode_id))[0]
            assert isinstance(started, EpisodeStarted)
            assert started.group_size == 2


async def test_proxy_agent_over_max_turns_ends_max_turns_and_its_key_dies_with_the_episode(
    store: EventStore, llm: NatsLLMClient, calculator_policy: str
) -> None:
    agent = load_agent("tests.integration.test_gateway:talkative_proxy_agent")
    config = RunnerConfig(policy=calculator_policy, agent_name="talkative", max_turns=3, retries=0)
    [outcome] = await Runner(agent, store=store, llm=llm, config=config).run_group(
        TaskSpec(task={}, task_id="t")
    )
    assert (outcome.termination, outcome.turns) == ("max_turns", 3)

    keys: list[tuple[str, str]] = []

    class Peeking:
        async def run(self, task: dict[str, Any], base_url: str, api_key: str) -> float:
            keys.append((base_url, api_key))
            return 1.0

    session = EpisodeSession(store, llm, policy=calculator_policy)
    await session.start()
    assert await ProxyAgentAdapter(Peeking()).run({}, session.llm) == 1.0
    [(base_url, api_key)] = keys
    async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
        with pytest.raises(openai.ConflictError, match="ended"):  # its key died with the episode
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "late"}])
    await session.finish("done")


async def test_turnstile_run_drives_a_proxy_agent_through_the_gateway(
    servers: Servers, database_url: str, calculator_policy: str, store: EventStore
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TURNSTILE_")}
    env |= {"TURNSTILE_DATABASE_URL": database_url, "TURNSTILE_NATS_URL": servers.nats_url}
    async with running(
        *TURNSTILE, "run", "--agent", "tests.integration.test_gateway:OpenAIProxyAgent",
        "--tasks", str(ARITHMETIC_TASKS), "--policy", calculator_policy, "--group-size", "2",
        "--max-tokens", "64",
        env=env, stderr=asyncio.subprocess.PIPE,
    ) as process:  # fmt: skip
        _, stderr = await asyncio.wait_for(process.communicate(), 180)
        assert process.returncode == 0, stderr.decode()
    events = [r.event for r in await store.read_all(0, 10_000) if r.event is not None]
    finished = Counter(e.termination for e in events if isinstance(e, EpisodeFinished))
    rewards = [e.value for e in events if isinstance(e, RewardAssigned)]
    assert finished == Counter({"done": 32})
    assert rewards == [1.0] * 32
    assert sum(isinstance(e, TurnCompleted) for e in events) == 64
