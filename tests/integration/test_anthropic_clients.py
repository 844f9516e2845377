"""Anthropic Messages as clients send it today (Claude Code's shape: system text inside ``messages``,
adaptive thinking, ``cache_control``, ``context_management``, ``output_config``, ``metadata``, ~15 tools,
streamed to ``/v1/messages?beta=true``) and ``/v1/messages/count_tokens``, with the official anthropic SDK
over real HTTP to real inference consumers and the real log."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anthropic
import pytest

from consumers.inference import InferenceConfig
from pipeline.dialects.anthropic import (
    AnthropicRequestError,
    count_tokens_estimate,
    parse_messages_request,
    signature,
)
from pipeline.log import EventStore
from schemas import ChatMessage
from tests.conftest import Servers
from tests.integration.test_gateway import (  # noqa: F401 (fixtures)
    ANTHROPIC_CALCULATOR,
    Gateway,
    assert_token_exact_child,
    calculator_policy,
    gateway,
    gateway_for,
    llm,
    new_policy,
    turns_of,
)
from tests.integration.test_responses import thinking_calculator
from tests.support.backends import RuleBackend
from tests.support.serving import serving

CACHED = {"type": "ephemeral"}
CLAUDE_CODE_TOOLS: Any = [
    ANTHROPIC_CALCULATOR,
    *(
        {
            "name": f"Tool{index}",
            "description": f"Tool number {index}.",
            "input_schema": {
                "type": "object",
                "properties": {"path": {"type": "string"}, "limit": {"type": "integer"}},
                "required": ["path"],
                "additionalProperties": False,
                "$schema": "http://json-schema.org/draft-07/schema#",
            },
        }
        for index in range(13)
    ),
    {"type": "web_search_20250305", "name": "web_search", "max_uses": 5},
]
CLAUDE_CODE_TOOLS[-2] = {**CLAUDE_CODE_TOOLS[-2], "cache_control": CACHED}


@pytest.fixture
async def thinking_gateway(servers: Servers, store: EventStore, llm: Any) -> AsyncIterator[Gateway]:  # noqa: F811
    policy = new_policy()
    config = InferenceConfig(servers.nats_url, policy, backend="scripted", heartbeat_interval=0.5)
    async with serving(config, RuleBackend(thinking_calculator)), gateway_for(store, llm, policy) as served:
        yield served


def claude_code_request(messages: list[Any]) -> dict[str, Any]:
    """What Claude Code sends (trimmed): the extras clients send today, all of them."""
    return {
        "model": "claude-sonnet-4-5",
        "max_tokens": 128000,
        "system": [
            {"type": "text", "text": "You are Claude Code.", "cache_control": CACHED},
            {"type": "text", "text": "Be careful with files.", "cache_control": CACHED},
        ],
        "messages": messages,
        "tools": CLAUDE_CODE_TOOLS,
        "thinking": {"type": "adaptive"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "high"},
        "metadata": {"user_id": "user_abc_account__session_1"},
        "temperature": 1,
    }


# ---- the translation ---------------------------------------------------------------------------------


def test_system_messages_inside_messages_keep_their_place() -> None:
    """Claude Code sends system messages mid-conversation: each stays where it stands, so a later one
    extends the prompt instead of rewriting its start (docs/lineages.md)."""
    call = parse_messages_request(
        claude_code_request(
            [
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "<system-reminder>x</system-reminder>"}],
                },
                {"role": "system", "content": "Extra rules."},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "What is 2 + 3?", "cache_control": CACHED}],
                },
            ]
        )
    )
    leading = ChatMessage(role="system", content="You are Claude Code.\nBe careful with files.")
    assert call.messages[0] == leading
    assert call.messages[2] == ChatMessage(role="system", content="Extra rules.")
    assert [m.role for m in call.messages] == ["system", "user", "system", "user"]
    assert [tool.function.name for tool in call.tools] == ["calculate", *(f"Tool{i}" for i in range(13))]
    assert call.sampling.max_tokens == 128000


def test_thinking_blocks_in_history_restore_the_reasoning() -> None:
    reasoning = "I should\nuse the tool."
    history = [
        {"role": "user", "content": "What is 2 + 3?"},
        {
            "role": "assistant",
            "content": [
                {"type": "redacted_thinking", "data": "opaque"},
                {"type": "thinking", "thinking": "", "signature": signature(reasoning)},
                {"type": "tool_use", "id": "t1", "name": "calculate", "input": {"expression": "2 + 3"}},
            ],
        },
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "5"}]},
    ]
    call = parse_messages_request({"max_tokens": 10, "messages": history})
    assert call.messages[1].reasoning_content == reasoning
    plain = parse_messages_request(
        {
            "max_tokens": 10,
            "messages": [
                history[0],
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "visible", "signature": "EqQBCkYIBxgCKkB..."}
                    ],
                },
            ],
        }
    )
    assert plain.messages[1].reasoning_content == "visible"


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            "messages[0].content[0].type",
        ),
        (
            {"messages": [{"role": "assistant", "content": [{"type": "server_tool_use"}]}]},
            "messages[0].content[0].type",
        ),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "system", "content": "only system"}]}, "messages"),
        ({"thinking": {"type": "sometimes"}}, "thinking.type"),
        ({"output_config": {"format": {"type": "json_schema", "schema": {}}}}, "output_config.format"),
    ],
)
def test_unserved_input_is_refused_naming_the_field(change: dict[str, Any], field: str) -> None:
    body = claude_code_request([{"role": "user", "content": "hi"}]) | change
    with pytest.raises(AnthropicRequestError) as refused:
        parse_messages_request(body)
    assert refused.value.message.startswith(f"invalid {field}:")


def test_count_tokens_estimate_grows_with_the_request() -> None:
    short = count_tokens_estimate({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    longer = count_tokens_estimate({"model": "m", "messages": [{"role": "user", "content": "hi " * 400}]})
    assert short == 4 + 1
    assert longer == 4 + 300
    with_tools = count_tokens_estimate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": CLAUDE_CODE_TOOLS}
    )
    assert with_tools > short + 14 * 10


# ---- the official SDK, shaped like Claude Code ------------------------------------------------------


async def test_a_claude_code_shaped_conversation_streams_and_records_token_exact(
    thinking_gateway: Gateway, store: EventStore
) -> None:
    session = await thinking_gateway.session()
    httpx2 = pytest.importorskip("httpx2")  # what this anthropic SDK is built on
    requests: list[Any] = []

    async def seen(request: Any) -> None:
        requests.append(request)

    http = httpx2.AsyncClient(event_hooks={"request": [seen]})
    claude = anthropic.AsyncAnthropic(
        base_url=thinking_gateway.url, api_key=session["api_key"], max_retries=0, http_client=http
    )
    messages: list[Any] = [
        {"role": "user", "content": [{"type": "text", "text": "What is 6 * 7?", "cache_control": CACHED}]},
        {
            "role": "system",
            "content": [{"type": "text", "text": "Answer with the tool.", "cache_control": CACHED}],
        },
        {"role": "user", "content": [{"type": "text", "text": "<system-reminder>ctx</system-reminder>"}]},
    ]

    async def turn() -> Any:
        body = claude_code_request(messages)
        body.pop("model")
        extra = {"temperature": body.pop("temperature")}  # not a parameter of this SDK's beta stream()
        async with claude.beta.messages.stream(
            model="main",
            betas=[
                "claude-code-20250219",
                "interleaved-thinking-2025-05-14",
                "context-management-2025-06-27",
            ],
            extra_body=extra,
            extra_query={"beta": "true"},  # as Claude Code sends it
            **body,
        ) as stream:
            kinds = [event.type async for event in stream]
            message = await stream.get_final_message()
        assert kinds[0] == "message_start"
        assert kinds[-1] == "message_stop"
        return message

    first = await turn()
    assert [block.type for block in first.content] == ["thinking", "tool_use"]
    assert first.content[0].thinking == "I should use the tool."
    assert first.content[0].signature == signature("I should use the tool.")
    assert first.content[1].input == {"expression": "6 * 7"}
    assert first.stop_reason == "tool_use"
    messages.append(
        {"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in first.content]}
    )
    messages.append(
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": first.content[1].id, "content": "42"}],
        }
    )
    second = await turn()
    assert [block.type for block in second.content] == ["thinking", "text"]
    assert second.content[1].text == "The answer is 42."

    assert all(r.url.params.get("beta") == "true" for r in requests)
    assert all("claude-code-20250219" in r.headers["anthropic-beta"] for r in requests)
    turns = await turns_of(store, session["session_id"])
    assert len(turns) == 2
    assert turns[0].request.messages[0] == ChatMessage(
        role="system", content="You are Claude Code.\nBe careful with files."
    )
    # the system message inside messages keeps its place (docs/lineages.md)
    assert ChatMessage(role="system", content="Answer with the tool.") in turns[0].request.messages[1:]
    assert len(turns[0].request.tools) == 14  # web_search accepted, not offered
    assert_token_exact_child(turns[0], turns[1])
    assert not turns[1].prefix_break
    await http.aclose()


async def test_count_tokens_answers_without_recording_a_turn(
    gateway: Gateway,  # noqa: F811
    store: EventStore,
) -> None:
    session = await gateway.session()
    claude = gateway.anthropic(session["api_key"])
    counted = await claude.messages.count_tokens(
        model="main", messages=[{"role": "user", "content": "What is 6 * 7?"}], tools=[ANTHROPIC_CALCULATOR]
    )
    assert counted.input_tokens > 4
    beta = await claude.beta.messages.count_tokens(
        model="main", messages=[{"role": "user", "content": "What is 6 * 7?"}], tools=[ANTHROPIC_CALCULATOR]
    )
    assert beta.input_tokens == counted.input_tokens
    with pytest.raises(anthropic.BadRequestError) as refused:
        await claude.messages.count_tokens(model="main", messages=[])
    assert refused.value.body["type"] == "error"  # type: ignore[index]
    with pytest.raises(anthropic.AuthenticationError):
        await gateway.anthropic("ts-wrong").messages.count_tokens(
            model="main", messages=[{"role": "user", "content": "hi"}]
        )
    assert await turns_of(store, session["session_id"]) == []
