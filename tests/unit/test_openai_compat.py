"""The OpenAI chat.completions translation, and the openai SDK served in process through it."""

from __future__ import annotations

import copy
import json
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionFunctionToolParam, ChatCompletionMessageFunctionToolCall

from pipeline.dialects import ChatCall, ChatResult, ChoiceData, OpenAIRequestError, openai_client
from pipeline.dialects.anthropic import parse_messages_request
from pipeline.dialects.base import ParseMemo
from pipeline.dialects.openai import completion_body, completion_chunks, parse_chat_request, sse
from pipeline.errors import TurnstileError
from schemas import ChatMessage, FunctionCall, FunctionSpec, SamplingParams, ToolCall, ToolChoice, ToolSpec

WEATHER_TOOL: ChatCompletionFunctionToolParam = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        "strict": True,
    },
}
TOOL_CONVERSATION: dict[str, Any] = {
    "model": "gpt-4o",
    "messages": [
        {"role": "developer", "content": "Answer briefly."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Weather"}, {"type": "text", "text": "in Oslo?"}],
        },
        {
            "role": "assistant",
            "content": None,
            "refusal": None,
            "tool_calls": [
                {
                    "index": 0,
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "-3 C"}]},
    ],
    "tools": [WEATHER_TOOL],
    "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
    "temperature": 0.5,
    "top_p": 0.9,
    "seed": 7,
    "n": 2,
    "logprobs": True,
    "top_logprobs": 0,
    "stream": True,
    "stream_options": {"include_usage": True},
    "user": "agent-17",
    "metadata": {"run": "a"},
    "parallel_tool_calls": False,
}
OSLO_CALL = ToolCall(id="call_1", function=FunctionCall(name="get_weather", arguments='{"city": "Oslo"}'))


def test_parses_a_multi_turn_tool_conversation() -> None:
    call = parse_chat_request(TOOL_CONVERSATION)

    assert call.messages == [
        ChatMessage(role="system", content="Answer briefly."),
        ChatMessage(role="user", content="Weather\nin Oslo?"),
        ChatMessage(role="assistant", content=None, tool_calls=[OSLO_CALL]),
        ChatMessage(role="tool", content="-3 C", tool_call_id="call_1"),
    ]
    assert call.tools == [
        ToolSpec(
            function=FunctionSpec(
                name="get_weather",
                description="Weather in a city",
                parameters={"type": "object", "properties": {"city": {"type": "string"}}},
            )
        )
    ]
    assert call.tool_choice == ToolChoice(mode="function", name="get_weather")
    assert call.sampling == SamplingParams(temperature=0.5, top_p=0.9, seed=7)
    assert (call.n, call.logprobs, call.top_logprobs, call.stream, call.include_usage, call.model) == (
        2,
        True,
        0,
        True,
        True,
        "gpt-4o",
    )


def _with(path: str, value: object) -> dict[str, Any]:
    """TOOL_CONVERSATION with the value at a dotted path (integers index lists) replaced."""
    body = copy.deepcopy(TOOL_CONVERSATION)
    *parents, last = [int(part) if part.isdigit() else part for part in path.split(".")]
    target: Any = body
    for part in parents:
        target = target[part]
    target[last] = value
    return body


def _without(key: str) -> dict[str, Any]:
    return {name: value for name, value in TOOL_CONVERSATION.items() if name != key}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (_without("messages"), "messages"),
        (_with("messages", []), "messages"),
        (_with("messages.1", "hello"), "messages[1]"),
        (_with("messages.1.role", "robot"), "messages[1].role"),
        (_with("messages.1.content", None), "messages[1].content"),
        (_with("messages.1.content", 42), "messages[1].content"),
        (_with("messages.1.content.0", "Weather"), "messages[1].content[0]"),
        (
            _with("messages.1.content.1", {"type": "image_url", "image_url": {}}),
            "messages[1].content[1].type",
        ),
        (_with("messages.1.content.0.text", 3), "messages[1].content[0].text"),
        (_with("messages.1.name", 5), "messages[1].name"),
        (
            _with("messages.2.tool_calls.0.function.arguments", {"city": "Oslo"}),
            "messages[2].tool_calls[0].function.arguments",
        ),
        (_with("messages.2.tool_calls.0.id", ""), "messages[2].tool_calls[0].id"),
        (_with("messages.3.tool_call_id", None), "messages[3].tool_call_id"),
        (_with("tools", {"get_weather": {}}), "tools"),
        (_with("tools.0.type", "custom"), "tools[0].type"),
        (_with("tools.0.function.name", ""), "tools[0].function.name"),
        (_with("tools.0.function.parameters", "object"), "tools[0].function.parameters"),
        (_with("tool_choice", "sometimes"), "tool_choice"),
        (_with("tool_choice.function.name", "get_time"), "tool_choice.function.name"),
        (_with("temperature", -0.1), "temperature"),
        (_with("top_p", 0), "top_p"),
        (_with("max_completion_tokens", 0), "max_completion_tokens"),
        (_with("max_tokens", "many"), "max_tokens"),
        (_with("stop", ["END", 3]), "stop[1]"),
        (_with("stop", 3), "stop"),
        (_with("seed", "lucky"), "seed"),
        (_with("n", 0), "n"),
        (_with("logprobs", "maybe"), "logprobs"),
        (_with("top_logprobs", 21), "top_logprobs"),
        (_with("stream", "sometimes"), "stream"),
        (_with("stream_options", {"include_usage": "yes please"}), "stream_options.include_usage"),
        (_with("model", 4), "model"),
        # bounded inputs: booleans are not integers, float32 underflow, tool calls that cannot be answered
        (_with("max_tokens", True), "max_tokens"),
        (_with("max_completion_tokens", True), "max_completion_tokens"),
        (_with("seed", False), "seed"),
        (_with("top_k", True), "top_k"),
        (_with("max_tokens", 5.0), "max_tokens"),
        (_with("temperature", True), "temperature"),
        (_with("top_p", 1e-300), "top_p"),
        (_with("top_p", 1e-39), "top_p"),
        (_with("temperature", 1e-300), "temperature"),
        (
            _with("messages.2.tool_calls", [TOOL_CONVERSATION["messages"][2]["tool_calls"][0]] * 2),
            "messages[2].tool_calls[1].id",
        ),
        (
            _with("messages.2.tool_calls.0.function.arguments", "not json"),
            "messages[2].tool_calls[0].function.arguments",
        ),
        (
            _with("messages.2.tool_calls.0.function.arguments", "[1, 2]"),
            "messages[2].tool_calls[0].function.arguments",
        ),
        (
            _with("messages.2.tool_calls.0.function.arguments", "null"),
            "messages[2].tool_calls[0].function.arguments",
        ),
    ],
)
def test_bad_input_names_the_param(body: dict[str, Any], param: str) -> None:
    with pytest.raises(OpenAIRequestError) as caught:
        parse_chat_request(body)

    assert caught.value.param == param
    assert caught.value.status == 400
    assert caught.value.message.startswith(f"invalid {param}: ")
    assert caught.value.body() == {
        "error": {
            "message": caught.value.message,
            "type": "invalid_request_error",
            "param": param,
            "code": None,
        }
    }


def test_sampling_values_at_the_float32_edge_and_zero_temperature_are_accepted() -> None:
    call = parse_chat_request(_with("top_p", 1.2e-38) | {"temperature": 0, "max_tokens": 1})
    assert call.sampling.top_p == 1.2e-38
    assert call.sampling.temperature == 0
    assert call.sampling.max_tokens == 1


def test_top_logprobs_needs_logprobs() -> None:
    body = {**TOOL_CONVERSATION, "logprobs": False, "top_logprobs": 2}

    with pytest.raises(OpenAIRequestError, match="needs logprobs set to true") as caught:
        parse_chat_request(body)
    assert caught.value.param == "top_logprobs"


def test_a_body_that_is_not_an_object_is_refused() -> None:
    with pytest.raises(OpenAIRequestError, match="must be a JSON object") as caught:
        parse_chat_request([{"role": "user", "content": "hi"}])
    assert caught.value.param is None


def test_required_tool_choice_needs_tools() -> None:
    body = {**_without("tools"), "tool_choice": "required"}

    with pytest.raises(OpenAIRequestError, match="'required' needs tools") as caught:
        parse_chat_request(body)
    assert caught.value.param == "tool_choice"


USER_ONLY: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def test_max_completion_tokens_wins_over_max_tokens() -> None:
    both = parse_chat_request({**USER_ONLY, "max_tokens": 10, "max_completion_tokens": 20})
    legacy = parse_chat_request({**USER_ONLY, "max_tokens": 10, "max_completion_tokens": None})

    assert both.sampling.max_tokens == 20
    assert legacy.sampling.max_tokens == 10


def test_defaults_fill_what_the_request_leaves_out() -> None:
    defaults = SamplingParams(temperature=0.6, top_k=20, max_tokens=1024, stop=["</s>"])

    call = parse_chat_request({**USER_ONLY, "temperature": None, "top_p": 0.8}, defaults=defaults)

    assert call.sampling == SamplingParams(
        temperature=0.6, top_p=0.8, top_k=20, max_tokens=1024, stop=["</s>"]
    )
    assert (call.n, call.logprobs, call.stream, call.include_usage, call.tool_choice) == (
        1,
        False,
        False,
        False,
        None,
    )


def test_stop_as_a_string_and_top_k_off() -> None:
    call = parse_chat_request({**USER_ONLY, "stop": "END", "top_k": -1}, defaults=SamplingParams(top_k=40))

    assert call.sampling.stop == ["END"]
    assert call.sampling.top_k is None


def test_assistant_reasoning_is_kept() -> None:
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hey", "reasoning_content": "r"},
    ]

    call = parse_chat_request({"messages": messages})

    assert call.messages[1] == ChatMessage(role="assistant", content="hey", reasoning_content="r")
    assert call.model == ""


# ---- responses ----------------------------------------------------------------------------------------

TOOL_CHOICE = ChoiceData(
    text="",
    tool_calls=[OSLO_CALL],
    finish_reason="tool_calls",
    completion_token_ids=[5, 6, 7],
    completion_logprobs=[-0.5, -0.25, -0.125],
)
TEXT_CHOICE = ChoiceData(
    text="It is cold.",
    tool_calls=[],
    finish_reason="abort",
    completion_token_ids=[8, 9],
    completion_logprobs=[-1.0, -2.0],
    token_texts=["It is", " cold."],
)


def test_completion_body_in_openai_shape() -> None:
    body = completion_body(
        completion_id="chatcmpl-1",
        created=100,
        model="policy",
        choices=[TOOL_CHOICE, TEXT_CHOICE],
        prompt_tokens=11,
        logprobs=True,
        extra={"turnstile": {"turn_id": "t1"}},
    )

    assert body == {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 100,
        "model": "policy",
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": None,
                    "refusal": None,
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                        }
                    ],
                },
                "logprobs": {
                    "content": [
                        {"token": "<5>", "logprob": -0.5, "bytes": None, "top_logprobs": []},
                        {"token": "<6>", "logprob": -0.25, "bytes": None, "top_logprobs": []},
                        {"token": "<7>", "logprob": -0.125, "bytes": None, "top_logprobs": []},
                    ],
                    "refusal": None,
                },
                "finish_reason": "tool_calls",
            },
            {
                "index": 1,
                "message": {"role": "assistant", "content": "It is cold.", "refusal": None},
                "logprobs": {
                    "content": [
                        {"token": "It is", "logprob": -1.0, "bytes": list(b"It is"), "top_logprobs": []},
                        {"token": " cold.", "logprob": -2.0, "bytes": list(b" cold."), "top_logprobs": []},
                    ],
                    "refusal": None,
                },
                "finish_reason": "length",
            },
        ],
        "usage": {"prompt_tokens": 11, "completion_tokens": 5, "total_tokens": 16},
        "turnstile": {"turn_id": "t1"},
    }


def test_extra_may_not_replace_openai_fields() -> None:
    with pytest.raises(ValueError, match=r"\['usage'\]"):
        completion_body(
            completion_id="c",
            created=0,
            model="m",
            choices=[TEXT_CHOICE],
            prompt_tokens=1,
            logprobs=False,
            extra={"usage": {}},
        )


def test_choice_data_refuses_per_token_lists_of_other_lengths() -> None:
    with pytest.raises(ValueError, match="1 logprobs for 2 completion tokens"):
        ChoiceData("ab", [], "stop", [1, 2], [-0.5])
    with pytest.raises(ValueError, match="3 token texts for 2 completion tokens"):
        ChoiceData("ab", [], "stop", [1, 2], [-0.5, -0.5], ["a", "b", "c"])


def test_chunks_carry_the_same_content_tool_calls_and_logprobs_as_the_body() -> None:
    mixed = ChoiceData(
        text="Checking.",
        tool_calls=[OSLO_CALL],
        finish_reason="tool_calls",
        completion_token_ids=[1, 2, 3],
        completion_logprobs=[-0.5, -0.25, -1.0],
        token_texts=["Checking.", "<tool_call>", "..."],
    )
    fields: dict[str, Any] = {
        "completion_id": "c",
        "created": 1,
        "model": "m",
        "choices": [mixed, TEXT_CHOICE],
        "prompt_tokens": 4,
        "logprobs": True,
    }
    body = completion_body(**fields)

    chunks = completion_chunks(**fields, include_usage=True, extra={"turnstile": {"turn_id": "t"}})

    for index, choice in enumerate(body["choices"]):
        deltas = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == index]
        assert "".join(d["delta"].get("content") or "" for d in deltas) == choice["message"]["content"]
        assert [e for d in deltas if d["logprobs"] for e in d["logprobs"]["content"]] == choice["logprobs"][
            "content"
        ]
        calls = [call for d in deltas for call in d["delta"].get("tool_calls", [])]
        assert [{k: v for k, v in call.items() if k != "index"} for call in calls] == choice["message"].get(
            "tool_calls", []
        )
        assert [d["finish_reason"] for d in deltas][-1] == choice["finish_reason"]
    assert [c["choices"][0]["delta"].get("content") for c in chunks[4:7]] == ["", "It is", " cold."]
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == {"prompt_tokens": 4, "completion_tokens": 5, "total_tokens": 9}
    assert chunks[-1]["turnstile"] == {"turn_id": "t"}
    assert all("turnstile" not in c for c in chunks[:-1])


def test_sse_renders_data_lines_and_done() -> None:
    assert sse([{"a": 1}, {"b": "é"}]) == b'data: {"a":1}\n\ndata: {"b":"\\u00e9"}\n\ndata: [DONE]\n\n'


# ---- the openai SDK, in process -----------------------------------------------------------------------


class RecordingHandler:
    """Answers every call with ``result`` (or raises ``error``) and keeps the calls it received."""

    def __init__(self, result: ChatResult | None = None, error: Exception | None = None) -> None:
        self.result, self.error = result, error
        self.calls: list[ChatCall] = []

    async def __call__(self, call: ChatCall) -> ChatResult:
        self.calls.append(call)
        if self.error is not None:
            raise self.error
        assert self.result is not None
        return self.result


HELLO = ChoiceData(
    text="Hello there!",
    tool_calls=[],
    finish_reason="stop",
    completion_token_ids=[11, 12, 13],
    completion_logprobs=[-0.5, -0.25, -0.125],
    token_texts=["Hello", " there", "!"],
)


async def test_sdk_plain_completion() -> None:
    handler = RecordingHandler(ChatResult([HELLO], prompt_tokens=9, extra={"turnstile": {"turn_id": "t1"}}))

    async with openai_client(handler, model="policy-a") as client:
        response = await client.chat.completions.create(
            model="gpt-4o",
            messages=[{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi"}],
            max_completion_tokens=64,
            temperature=0.2,
            stop="\n\n",
            user="agent-1",
        )

    assert response.choices[0].message.content == "Hello there!"
    assert response.choices[0].finish_reason == "stop"
    assert response.choices[0].logprobs is None
    assert response.model == "policy-a"
    assert response.usage is not None
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (9, 3)
    assert response.model_extra == {"turnstile": {"turn_id": "t1"}}
    [call] = handler.calls
    assert call.messages == [
        ChatMessage(role="system", content="Be kind."),
        ChatMessage(role="user", content="Hi"),
    ]
    assert call.sampling == SamplingParams(temperature=0.2, max_tokens=64, stop=["\n\n"])
    assert (call.model, call.stream, call.logprobs) == ("gpt-4o", False, False)


async def test_sdk_tool_call_completion() -> None:
    choice = ChoiceData("", [OSLO_CALL], "tool_calls", [1, 2], [-0.5, -0.5])
    handler = RecordingHandler(ChatResult([choice], prompt_tokens=20))

    async with openai_client(handler, model="policy-a") as client:
        response = await client.chat.completions.create(
            model="policy-a",
            messages=[{"role": "user", "content": "Weather in Oslo?"}],
            tools=[WEATHER_TOOL],
            tool_choice="auto",
        )

    message = response.choices[0].message
    assert message.content is None
    assert message.tool_calls is not None
    tool_call = message.tool_calls[0]
    assert isinstance(tool_call, ChatCompletionMessageFunctionToolCall)
    assert (tool_call.id, tool_call.function.name) == ("call_1", "get_weather")
    assert json.loads(tool_call.function.arguments) == {"city": "Oslo"}
    assert response.choices[0].finish_reason == "tool_calls"
    assert handler.calls[0].tools[0].function.name == "get_weather"
    assert handler.calls[0].tool_choice == ToolChoice(mode="auto")


async def test_sdk_streaming_reassembles_the_text_and_reports_usage() -> None:
    handler = RecordingHandler(ChatResult([HELLO], prompt_tokens=9))

    async with openai_client(handler, model="policy-a") as client:
        stream = await client.chat.completions.create(
            model="policy-a",
            messages=[{"role": "user", "content": "Hi"}],
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]

    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Hello there!"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None
    assert (
        chunks[-1].usage.prompt_tokens,
        chunks[-1].usage.completion_tokens,
        chunks[-1].usage.total_tokens,
    ) == (
        9,
        3,
        12,
    )
    assert (handler.calls[0].stream, handler.calls[0].include_usage) == (True, True)


async def test_sdk_streamed_tool_calls_accumulate() -> None:
    choice = ChoiceData("Let me look.", [OSLO_CALL], "tool_calls", [1, 2, 3], [-0.1, -0.2, -0.3])
    handler = RecordingHandler(ChatResult([choice], prompt_tokens=5))

    async with openai_client(handler, model="policy-a") as client:
        stream = await client.chat.completions.create(
            model="policy-a", messages=[{"role": "user", "content": "Oslo?"}], stream=True
        )
        chunks = [chunk async for chunk in stream]

    calls = [call for c in chunks for call in (c.choices[0].delta.tool_calls or [])]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Let me look."
    assert [(call.index, call.id) for call in calls] == [(0, "call_1")]
    assert calls[0].function is not None
    assert calls[0].function.arguments == '{"city": "Oslo"}'
    assert all(c.usage is None for c in chunks)


async def test_sdk_logprobs() -> None:
    handler = RecordingHandler(ChatResult([HELLO], prompt_tokens=9))

    async with openai_client(handler, model="policy-a") as client:
        response = await client.chat.completions.create(
            model="policy-a", messages=[{"role": "user", "content": "Hi"}], logprobs=True, top_logprobs=0
        )

    logprobs = response.choices[0].logprobs
    assert logprobs is not None
    assert logprobs.content is not None
    assert [(e.token, e.logprob, e.bytes) for e in logprobs.content] == [
        ("Hello", -0.5, list(b"Hello")),
        (" there", -0.25, list(b" there")),
        ("!", -0.125, list(b"!")),
    ]
    assert handler.calls[0].logprobs is True


async def test_sdk_bad_request_names_the_param() -> None:
    handler = RecordingHandler(ChatResult([HELLO], prompt_tokens=9))

    async with openai_client(handler, model="policy-a") as client:
        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(
                model="policy-a",
                messages=[
                    {"role": "user", "content": "Look:"},
                    {
                        "role": "user",
                        "content": [{"type": "image_url", "image_url": {"url": "http://x/cat.png"}}],
                    },
                ],
            )

    assert caught.value.status_code == 400
    assert "messages[1].content[0].type" in str(caught.value)
    assert caught.value.param == "messages[1].content[0].type"
    assert caught.value.type == "invalid_request_error"
    assert handler.calls == []


async def test_sdk_handler_errors_keep_their_status() -> None:
    too_long = OpenAIRequestError(
        "the prompt is 9000 tokens, more than 8192", param="messages", code="too_long"
    )
    broken = TurnstileError("no inference consumer for policy 'policy-a'")

    async with openai_client(RecordingHandler(error=too_long), model="policy-a") as client:
        with pytest.raises(openai.BadRequestError, match="9000 tokens") as refused:
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}])
    async with openai_client(RecordingHandler(error=broken), model="policy-a") as client:
        with pytest.raises(openai.InternalServerError, match="no inference consumer") as failed:
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}])

    assert (refused.value.param, refused.value.code) == ("messages", "too_long")
    assert failed.value.status_code == 500
    assert failed.value.type == "server_error"


async def test_sdk_models_and_unknown_paths() -> None:
    async with openai_client(RecordingHandler(), model="policy-a") as client:
        models = await client.models.list()
        with pytest.raises(openai.NotFoundError, match=r"POST /v1/embeddings"):
            await client.embeddings.create(model="policy-a", input="hi")

    assert [model.id for model in models.data] == ["policy-a"]


def test_a_parse_memo_parses_only_what_a_call_adds_and_hands_back_the_same_objects() -> None:
    memo = ParseMemo()
    user = {"role": "user", "content": "a"}
    reply = {"role": "assistant", "content": "b"}
    first = parse_chat_request({"messages": [user]}, memo=memo)
    grown = [user, reply, {"role": "user", "content": "c"}]
    second = parse_chat_request({"messages": copy.deepcopy(grown)}, memo=memo)  # new JSON, equal items
    assert second.messages[0] is first.messages[0]  # not parsed again: the session compares by identity
    assert second.messages == parse_chat_request({"messages": grown}).messages  # what no memo gives
    side = parse_chat_request({"messages": [{"role": "user", "content": "a title?"}]}, memo=memo)
    again = parse_chat_request({"messages": [*grown, reply, {"role": "user", "content": "d"}]}, memo=memo)
    assert [m is n for m, n in zip(again.messages, second.messages, strict=False)] == [True] * 3  # kept
    assert side.messages[0].content == "a title?"
    edited = parse_chat_request({"messages": [{"role": "user", "content": "A"}, reply]}, memo=memo)
    assert (edited.messages[0].content, edited.messages[0] is first.messages[0]) == ("A", False)
    with pytest.raises(OpenAIRequestError) as refused:  # a bad new message is refused, named by its index
        parse_chat_request({"messages": [*grown, {"role": "bot", "content": "x"}]}, memo=memo)
    assert refused.value.param == "messages[3].role"
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    with_tools = parse_chat_request({"messages": [user], "tools": [tool]}, memo=memo)
    again_tools = parse_chat_request({"messages": [user], "tools": [copy.deepcopy(tool)]}, memo=memo)
    assert again_tools.tools[0] is with_tools.tools[0]  # tools too: their schemas are checked once


def test_a_parse_memo_keeps_anthropic_system_messages_and_tool_results_as_without_one() -> None:
    body = {
        "max_tokens": 8,
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "4"}]},
        ],
    }
    memo = ParseMemo()
    once = parse_messages_request(copy.deepcopy(body), memo=memo)
    twice = parse_messages_request(copy.deepcopy(body), memo=memo)
    assert once.messages == twice.messages == parse_messages_request(body).messages
    assert [m.role for m in twice.messages] == ["system", "user", "assistant", "tool"]
    assert twice.messages[1] is once.messages[1]


def test_anthropic_tool_use_blocks_with_one_id_are_refused() -> None:
    block = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}}
    body = {
        "model": "claude",
        "max_tokens": 10,
        "messages": [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": [block, {**block, "input": {"city": "Bergen"}}]},
        ],
    }
    with pytest.raises(TurnstileError, match="repeats an earlier tool call's id"):
        parse_messages_request(body)
