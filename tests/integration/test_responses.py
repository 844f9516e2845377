"""``POST /v1/responses`` with the official openai SDK and the OpenAI Agents SDK as clients, over real HTTP
to real inference consumers over NATS and the real log; the translation itself on plain bodies."""

from __future__ import annotations

import base64
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest

from consumers.inference import InferenceConfig
from pipeline.dialects import ChoiceData
from pipeline.dialects.base import ChatResult
from pipeline.dialects.responses import (
    ResponsesRequestError,
    parse_responses_request,
    response_body,
    response_events,
)
from pipeline.log import EventStore
from schemas import ChatMessage, FunctionCall, LLMRequest, ToolCall, TurnCompleted
from tests.conftest import Servers
from tests.integration.test_gateway import (  # noqa: F401 (fixtures)
    CALCULATOR_TOOL,
    Gateway,
    assert_token_exact_child,
    calculator_policy,
    gateway,
    gateway_for,
    llm,
    new_policy,
    turns_of,
)
from tests.support.backends import RuleBackend, calculator_rule
from tests.support.serving import serving

RESPONSES_CALCULATOR: Any = {"type": "function", **CALCULATOR_TOOL["function"]}


def thinking_calculator(request: LLMRequest) -> str:
    """The calculator model, reasoning before it answers."""
    return "<think>\nI should use the tool.\n</think>\n\n" + calculator_rule(request)


@pytest.fixture
async def thinking_gateway(servers: Servers, store: EventStore, llm: Any) -> AsyncIterator[Gateway]:  # noqa: F811
    policy = new_policy()
    config = InferenceConfig(servers.nats_url, policy, backend="scripted", heartbeat_interval=0.5)
    async with serving(config, RuleBackend(thinking_calculator)), gateway_for(store, llm, policy) as served:
        yield served


# ---- the translation ---------------------------------------------------------------------------------


def test_items_become_messages_in_order() -> None:
    call = parse_responses_request(
        {
            "model": "m",
            "instructions": "Be brief.",
            "input": [
                {"role": "developer", "content": "Use tools."},
                {
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_text", "text": "What is 2+2?"}],
                },
                {
                    "type": "reasoning",
                    "id": "rs_1",
                    "summary": [],
                    "content": [{"type": "reasoning_text", "text": "hm"}],
                },
                {
                    "type": "message",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": "Let me see."}],
                },
                {
                    "type": "function_call",
                    "call_id": "c1",
                    "name": "calculate",
                    "arguments": '{"expression": "2+2"}',
                },
                {"type": "function_call", "call_id": "c2", "name": "calculate", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "4"},
                {
                    "type": "function_call_output",
                    "call_id": "c2",
                    "output": [{"type": "input_text", "text": "?"}],
                },
            ],
            "tools": [RESPONSES_CALCULATOR, {"type": "web_search"}],
            "tool_choice": "auto",
            "store": False,
            "include": ["reasoning.encrypted_content"],
            "prompt_cache_key": "k",
            "reasoning": {"effort": "medium", "summary": "auto"},
            "max_output_tokens": 64,
            "truncation": "disabled",
            "service_tier": "auto",
        }
    )
    assert [m.role for m in call.messages] == ["system", "system", "user", "assistant", "tool", "tool"]
    assert call.messages[0].content == "Be brief."
    assert call.messages[3] == ChatMessage(
        role="assistant",
        content="Let me see.",
        reasoning_content="hm",
        tool_calls=[
            ToolCall(id="c1", function=FunctionCall(name="calculate", arguments='{"expression": "2+2"}')),
            ToolCall(id="c2", function=FunctionCall(name="calculate", arguments="{}")),
        ],
    )
    assert [m.tool_call_id for m in call.messages[4:]] == ["c1", "c2"]
    assert [tool.function.name for tool in call.tools] == ["calculate"]  # web_search accepted, not offered
    assert call.sampling.max_tokens == 64
    assert call.tool_choice is not None
    assert call.tool_choice.mode == "auto"


def test_encrypted_reasoning_restores_the_text_this_gateway_gave() -> None:
    encrypted = base64.b64encode(b"exact\nreasoning").decode()
    call = parse_responses_request(
        {
            "input": [
                {"role": "user", "content": "q"},
                {"type": "reasoning", "summary": [], "encrypted_content": encrypted},
                {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c", "output": "r"},
                {"type": "reasoning", "summary": [], "encrypted_content": "gAAAA-not-ours"},
                {"type": "reasoning", "summary": [], "encrypted_content": "\u00e9t\u00e9 not even ASCII"},
                {"role": "assistant", "content": "done"},
            ]
        }
    )
    assert call.messages[1].reasoning_content == "exact\nreasoning"
    assert call.messages[3] == ChatMessage(role="assistant", content="done")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": [{"type": "input_image", "image_url": "x"}]}, "input[0].type"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
            "input[0].content[0].type",
        ),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
        ({"input": []}, "input"),
        ({"input": "hi", "text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format"),
        ({"input": "hi", "truncation": "auto"}, "truncation"),
        ({"input": "hi", "background": True}, "background"),
        ({"input": "hi", "conversation": "conv_1"}, "conversation"),
        ({"input": "hi", "top_logprobs": 3}, "top_logprobs"),
        ({"input": "hi", "tool_choice": {"type": "web_search"}}, "tool_choice"),
        ({"input": "hi", "previous_response_id": "chatcmpl-1"}, "previous_response_id"),
        ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
        (
            {"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": "x"}]},
            "tools[0].function.parameters",
        ),
    ],
)
def test_unserved_input_is_refused_naming_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(ResponsesRequestError) as refused:
        parse_responses_request(body)
    assert refused.value.param == param


def test_a_reply_renders_as_items_and_the_stream_ends_with_the_same_response() -> None:
    turn = str(uuid.uuid4())
    call = parse_responses_request({"input": "q", "tools": [RESPONSES_CALCULATOR]})
    choice = ChoiceData(
        text="Checking.",
        tool_calls=[
            ToolCall(id="call_1", function=FunctionCall(name="calculate", arguments='{"expression": "1"}'))
        ],
        finish_reason="tool_calls",
        completion_token_ids=[5, 6],
        completion_logprobs=[-0.1, -0.2],
        reasoning="think",
    )
    result = ChatResult([choice], prompt_tokens=7, extra={"turnstile": {"turn_ids": [turn]}})
    body = response_body(call, result, model="main", created_at=1)
    assert body["id"] == "resp_" + uuid.UUID(turn).hex
    assert [item["type"] for item in body["output"]] == ["reasoning", "message", "function_call"]
    assert body["output"][2]["call_id"] == "call_1"
    assert body["usage"]["total_tokens"] == 9
    events = response_events(call, result, model="main", created_at=1)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[0]["type"] == "response.created"
    assert events[-1]["type"] == "response.completed"
    assert events[-1]["response"] == body


# ---- the official SDK --------------------------------------------------------------------------------


def responses_client(gateway: Gateway, api_key: str, **options: Any) -> openai.AsyncOpenAI:  # noqa: F811
    return openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key=api_key, **({"max_retries": 0} | options))


@pytest.mark.parametrize("stream", [False, True])
async def test_openai_sdk_tool_round_trip_is_recorded_token_exact(
    thinking_gateway: Gateway, store: EventStore, stream: bool
) -> None:
    session = await thinking_gateway.session()
    client = responses_client(thinking_gateway, session["api_key"])
    conversation: list[Any] = [{"role": "user", "content": "What is 6 * 7?"}]

    async def create(**options: Any) -> Any:
        if not stream:
            return await client.responses.create(model="main", **options)
        async with client.responses.stream(model="main", **options) as events:
            kinds = [event.type async for event in events]
            final = await events.get_final_response()
        assert kinds[:2] == ["response.created", "response.in_progress"]
        assert kinds[-1] == "response.completed"
        return final

    first = await create(input=conversation, tools=[RESPONSES_CALCULATOR], instructions="Use the tool.")
    kinds = [item.type for item in first.output]
    assert kinds == ["reasoning", "function_call"]
    assert first.output[0].content[0].text == "I should use the tool."
    call = first.output[1]
    assert json.loads(call.arguments) == {"expression": "6 * 7"}
    assert first.usage is not None
    assert first.usage.output_tokens > 0
    conversation += [item.model_dump(exclude_none=True) for item in first.output]
    conversation.append({"type": "function_call_output", "call_id": call.call_id, "output": "42"})
    second = await create(input=conversation, tools=[RESPONSES_CALCULATOR], instructions="Use the tool.")
    assert second.output_text == "The answer is 42."

    turns = await turns_of(store, session["session_id"])
    assert [t.turn_id.hex for t in turns] == [first.id.removeprefix("resp_"), second.id.removeprefix("resp_")]
    assert_token_exact_child(turns[0], turns[1])
    assert turns[0].reply.reasoning == "I should use the tool."
    assert turns[0].request.messages[0] == ChatMessage(role="system", content="Use the tool.")


async def test_previous_response_id_continues_the_recorded_conversation(
    gateway: Gateway,  # noqa: F811
    store: EventStore,
) -> None:
    session = await gateway.session()
    client = responses_client(gateway, session["api_key"])
    first = await client.responses.create(
        model="main", input="What is 5 + 4?", tools=[RESPONSES_CALCULATOR], instructions="Be exact."
    )
    call = next(item for item in first.output if item.type == "function_call")
    second = await client.responses.create(
        model="main",
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "9"}],
        tools=[RESPONSES_CALCULATOR],
        instructions="Be exact.",
    )
    assert second.output_text == "The answer is 9."
    assert second.previous_response_id == first.id
    turns = await turns_of(store, session["session_id"])
    assert len(turns) == 2
    assert_token_exact_child(turns[0], turns[1])
    assert [m.role for m in turns[1].request.messages] == ["system", "user", "assistant", "tool"]

    with pytest.raises(openai.BadRequestError) as missing:
        await client.responses.create(model="main", input="hi", previous_response_id="resp_" + "0" * 32)
    assert missing.value.body["param"] == "previous_response_id"  # type: ignore[index]
    assert missing.value.body["code"] == "previous_response_not_found"  # type: ignore[index]
    assert len(await turns_of(store, session["session_id"])) == 2


async def test_bad_items_get_400_in_the_responses_shape_and_the_gateway_stays_up(
    gateway: Gateway,  # noqa: F811
    store: EventStore,
) -> None:
    session = await gateway.session()
    headers = {"Authorization": f"Bearer {session['api_key']}"}
    async with httpx.AsyncClient(base_url=gateway.url, headers=headers) as http:
        bad = await http.post(
            "/v1/responses", json={"input": [{"type": "computer_call_output", "call_id": "c"}]}
        )
        assert bad.status_code == 400
        assert bad.json()["error"]["param"] == "input[0].type"
        assert bad.json()["error"]["type"] == "invalid_request_error"
        structured = await http.post(
            "/v1/responses", json={"input": "hi", "text": {"format": {"type": "json_object"}}}
        )
        assert structured.status_code == 400
        assert structured.json()["error"]["param"] == "text.format"
        good = await http.post("/v1/responses", json={"input": "What is 1 + 1?", "store": False, "user": "u"})
        assert good.status_code == 200, good.text
    assert len(await turns_of(store, session["session_id"])) == 1


# ---- the OpenAI Agents SDK ---------------------------------------------------------------------------


async def test_openai_agents_sdk_default_model_runs_a_tool_loop(
    thinking_gateway: Gateway, store: EventStore
) -> None:
    agents = pytest.importorskip("agents")
    session = await thinking_gateway.session()
    client = responses_client(thinking_gateway, session["api_key"])
    used: list[str] = []

    @agents.function_tool
    def calculate(expression: str) -> str:
        """Evaluate an arithmetic expression."""
        used.append(expression)
        return "56"

    agent = agents.Agent(name="calc", instructions="Use the calculator.", tools=[calculate])
    config = agents.RunConfig(
        model_provider=agents.OpenAIProvider(openai_client=client), tracing_disabled=True
    )
    result = await agents.Runner.run(agent, "What is 7 * 8?", run_config=config)
    assert result.final_output == "The answer is 56."
    assert used == ["7 * 8"]
    turns = await turns_of(store, session["session_id"])
    assert len(turns) == 2
    assert all(isinstance(t, TurnCompleted) and t.completion_token_ids for t in turns)
    assert_token_exact_child(turns[0], turns[1])

    streamed = agents.Runner.run_streamed(agent, "What is 7 * 8?", run_config=config)
    async for _ in streamed.stream_events():
        pass
    assert streamed.final_output == "The answer is 56."
    assert len(await turns_of(store, session["session_id"])) == 4

    # the Agents SDK's server-side conversation: only the new input travels, the gateway has the rest
    again = await agents.Runner.run(
        agent, "Once more: what is 7 * 8?", run_config=config, previous_response_id=result.last_response_id
    )
    assert again.final_output == "The answer is 56."
    turns = await turns_of(store, session["session_id"])
    assert len(turns) == 6
    assert_token_exact_child(turns[1], turns[4])
    assert_token_exact_child(turns[4], turns[5])


# ---- a request shaped like Codex CLI's -------------------------------------------------------------


def sse_events(raw: str) -> list[dict[str, Any]]:
    """The JSON of each ``data:`` line of a server-sent event stream."""
    return [json.loads(line.removeprefix("data: ")) for line in raw.splitlines() if line.startswith("data: ")]


async def test_a_codex_shaped_stream_continues_token_exact_from_encrypted_reasoning(
    thinking_gateway: Gateway, store: EventStore
) -> None:
    session = await thinking_gateway.session()
    headers = {"Authorization": f"Bearer {session['api_key']}"}
    tools = [{**RESPONSES_CALCULATOR, "strict": False}, {"type": "web_search"}, {"type": "local_shell"}]
    items: list[Any] = [
        {
            "type": "message",
            "role": "developer",
            "content": [{"type": "input_text", "text": "Use the tool."}],
        },
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "What is 9 * 9?"}]},
    ]

    def codex(input_items: list[Any]) -> dict[str, Any]:
        return {
            "model": "gpt-5-codex",
            "instructions": "You are Codex.",
            "input": input_items,
            "tools": tools,
            "tool_choice": "auto",
            "parallel_tool_calls": False,
            "reasoning": {"effort": "medium", "summary": "auto"},
            "store": False,
            "stream": True,
            "include": ["reasoning.encrypted_content"],
            "prompt_cache_key": str(uuid.uuid4()),
            "text": {"verbosity": "medium"},
        }

    async with httpx.AsyncClient(base_url=thinking_gateway.url, headers=headers, timeout=30) as http:
        first = sse_events((await http.post("/v1/responses", json=codex(items))).text)
        done = [e["item"] for e in first if e["type"] == "response.output_item.done"]
        assert [item["type"] for item in done] == ["reasoning", "function_call"]
        assert first[-1]["type"] == "response.completed"
        assert first[-1]["response"]["usage"]["output_tokens"] > 0
        # Codex keeps only the opaque reasoning and the call, then sends the tool's output
        reasoning = {"type": "reasoning", "summary": [], "encrypted_content": done[0]["encrypted_content"]}
        call = {key: done[1][key] for key in ("type", "call_id", "name", "arguments")}
        output = {"type": "function_call_output", "call_id": call["call_id"], "output": "81"}
        second = sse_events(
            (await http.post("/v1/responses", json=codex([*items, reasoning, call, output]))).text
        )
    text = "".join(e["delta"] for e in second if e["type"] == "response.output_text.delta")
    assert text == "The answer is 81."
    turns = await turns_of(store, session["session_id"])
    assert len(turns) == 2
    assert_token_exact_child(turns[0], turns[1])
    assert turns[1].request.messages[-1] == ChatMessage(
        role="tool", tool_call_id=call["call_id"], content="81"
    )
    assert [tool.function.name for tool in turns[0].request.tools] == ["calculate"]


def test_a_cut_reply_is_incomplete_and_its_stream_ends_with_response_incomplete() -> None:
    call = parse_responses_request({"input": "q", "max_output_tokens": 2})
    choice = ChoiceData(
        text="ab",
        tool_calls=[],
        finish_reason="length",
        completion_token_ids=[1, 2],
        completion_logprobs=[-0.1, -0.1],
    )
    result = ChatResult([choice], prompt_tokens=3, extra={"turnstile": {"turn_ids": [str(uuid.uuid4())]}})
    body = response_body(call, result, model="main", created_at=1)
    assert body["status"] == "incomplete"
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}
    events = response_events(call, result, model="main", created_at=1)
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"] == body
