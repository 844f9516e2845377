"""The Anthropic Messages API (``POST /v1/messages``) on top of Turnstile's chat calls.

``parse_messages_request`` turns an Anthropic request body into the same ``ChatCall`` every dialect makes
(``pipeline.dialects.base``), so one handler serves every API; ``message_body`` and ``message_events``
turn a reply back into an Anthropic message (whole, or as the events of a stream) and ``anthropic_sse``
renders those events.

How the two shapes meet:

- ``system`` (a string or text blocks) is the leading ``system`` message; a ``system``-role message inside
  ``messages`` (Claude Code sends them mid-conversation) stays a ``system`` message where it stands, so a
  later one extends the prompt instead of rewriting its start (docs/lineages.md). A user
  message's ``tool_result`` blocks become ``tool`` messages (``tool_call_id`` = ``tool_use_id``) and its text
  blocks a user message, in block order; an assistant message's text blocks are joined into its content and
  its ``tool_use`` blocks become tool calls whose id is the block's id, its ``thinking`` block its
  ``reasoning_content`` (``redacted_thinking`` is ignored: opaque, and the recorded tokens hold what the
  model wrote). Text blocks are joined with ``"\n"``; other block kinds (images, documents) are refused.
  A reply's reasoning comes back as a ``thinking`` block whose ``signature`` is the reasoning's text
  (``turnstile:`` + base64), so a block sent back with its text emptied still restores it.
- A ``tool_use`` block carries parsed ``input``; the turn recorded the arguments as the model wrote them.
  ``known_arguments`` (tool call id -> the recorded arguments text) lets the parser send back the exact text
  when the input still equals it, so a conversation that returns the reply it got continues token-exact.
- ``tools`` (``name``, ``description``, ``input_schema``) are function tools; server tools (a ``type`` such
  as ``web_search_20250305``) are accepted and not offered to the policy.
  ``tool_choice`` is checked (``auto``, ``any``, ``tool`` with a known name, ``none``) and recorded with the
  turn like the OpenAI one (``schemas.ToolChoice``: ``none`` is enforced, the others are not).
- Accepted and ignored: ``metadata``, ``cache_control`` on any block or tool, ``context_management``,
  ``output_config`` (but ``output_config.format``, structured output, is refused), ``thinking``
  (``enabled``, ``adaptive`` or ``disabled``: the policy reasons as it does; another type is refused),
  ``service_tier``, ``container``, ``mcp_servers``, ``top_k`` off values and unknown top-level keys; ``seed``
  (not in Anthropic's API) is read when given.
- ``stop_reason``: ``tool_use`` when the reply holds tool calls, ``max_tokens`` when it was cut short
  (Turnstile's ``length``, ``abort`` and ``error``), ``stop_sequence`` when it stopped and one of the
  request's stop sequences is in its text (``stop_sequence`` names the first one found), else ``end_turn``.
- Usage counts the engine's prompt and completion tokens.
"""

from __future__ import annotations

import base64
import binascii
import json
import uuid
from collections.abc import Iterable, Mapping, Sequence
from functools import partial
from typing import Any, Final

from pipeline.dialects.base import (
    ChatCall,
    ChatResult,
    ChoiceData,
    ParseMemo,
    RequestError,
    WireReply,
    check_tool_calls,
    dotted_path,
    invalid,
    parse_sampling,
    same_json,
    shown,
    string_field,
    validated,
)
from schemas import (
    ChatMessage,
    FunctionCall,
    SamplingParams,
    ToolCall,
    ToolChoice,
    ToolSpec,
    default_sampling,
)

ERROR_TYPES: Final[Mapping[int, str]] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    502: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}
THINKING_TYPES: Final = ("enabled", "adaptive", "disabled")
SIGNATURE_PREFIX: Final = "turnstile:"


class AnthropicRequestError(RequestError):
    """A request the Anthropic API would refuse; ``body()`` is the error object an Anthropic server sends."""

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message)


def error_body(status: int, message: str) -> dict[str, Any]:
    """``{"type": "error", "error": {"type": ..., "message": ...}}`` with the type Anthropic uses for
    ``status``."""
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


_invalid = partial(invalid, error=AnthropicRequestError)
_string = partial(string_field, error=AnthropicRequestError)
_sampling = partial(
    parse_sampling, max_tokens_key="max_tokens", stop_key="stop_sequences", error=AnthropicRequestError,
    param_path=dotted_path,
)  # fmt: skip
_validated = partial(validated, error=AnthropicRequestError, param_path=dotted_path)


# ---- requests ----------------------------------------------------------------------------------------


def parse_messages_request(
    body: object,
    *,
    defaults: SamplingParams | None = None,
    known_arguments: Mapping[str, str] | None = None,
    memo: ParseMemo | None = None,
) -> ChatCall:
    """An Anthropic Messages request body -> ``ChatCall`` (``n`` 1, no logprobs).

    Raises ``AnthropicRequestError`` whose message names the offending field
    (``messages[1].content[0].type``).
    """
    if not isinstance(body, dict):
        raise AnthropicRequestError(f"the request body must be a JSON object, got {shown(body)}")
    given = {key: value for key, value in body.items() if value is not None}
    if "max_tokens" not in given:
        raise _invalid("max_tokens", "is required: the most tokens the reply may have", None)
    model = given.get("model", "")
    if not isinstance(model, str):
        raise _invalid("model", "must be a string", model)
    stream = given.get("stream", False)
    if not isinstance(stream, bool):
        raise _invalid("stream", "must be true or false", stream)
    _refuse_unserved(given)
    tools = _parse_tools(given.get("tools", []), memo.part("tools") if memo is not None else None)
    messages_memo = memo.part("messages") if memo is not None else None
    system, conversation = _parse_messages(given.get("messages"), known_arguments, messages_memo)
    system_texts = ([_text_of(given["system"], "system")] if "system" in given else []) + system
    messages = [ChatMessage(role="system", content="\n".join(system_texts))] if system_texts else []
    messages += conversation
    return ChatCall(
        messages=messages,
        tools=tools,
        sampling=_sampling(given, defaults or default_sampling()),
        n=1,
        logprobs=False,
        top_logprobs=0,
        stream=stream,
        include_usage=True,
        model=model,
        tool_choice=_parse_tool_choice(given.get("tool_choice"), tools),
    )


def count_tokens_estimate(body: object) -> int:
    """``POST /v1/messages/count_tokens``: an estimate of the prompt's tokens, not the consumer's count (no
    tokenizer is reachable from the gateway): one token per 4 UTF-8 bytes, rounded up, of each message's
    text, reasoning and tool calls and of each tool's JSON, plus 4 per message. The body is checked like
    a Messages request (``max_tokens`` is not needed)."""
    if isinstance(body, dict) and "max_tokens" not in body:
        body = {**body, "max_tokens": 1}
    call = parse_messages_request(body)

    def tokens(text: str) -> int:
        return -(-len(text.encode()) // 4)

    total = 0
    for message in call.messages:
        total += 4 + tokens(message.content or "") + tokens(message.reasoning_content or "")
        for tool_call in message.tool_calls or []:
            total += tokens(tool_call.function.name) + tokens(tool_call.function.arguments)
    return total + sum(tokens(json.dumps(tool.model_dump(mode="json"))) for tool in call.tools)


def _refuse_unserved(given: Mapping[str, Any]) -> None:
    """400 for what would change the output and is not served; ``thinking`` is checked, not enforced."""
    thinking = given.get("thinking")
    if thinking is not None:
        kind = thinking.get("type") if isinstance(thinking, dict) else thinking
        if kind not in THINKING_TYPES:
            raise _invalid("thinking.type", f"must be one of {', '.join(THINKING_TYPES)}", kind)
    output_config = given.get("output_config", {})
    if not isinstance(output_config, dict):
        raise _invalid("output_config", "must be an object", output_config)
    if output_config.get("format") is not None:
        raise _invalid("output_config.format", "structured output is not served", output_config["format"])
    if given.get("output_format") is not None:
        raise _invalid("output_format", "structured output is not served", given["output_format"])


def _text_of(raw: object, path: str) -> str:
    """A string, or a list of text blocks joined with newlines."""
    if isinstance(raw, str):
        return raw
    if not isinstance(raw, list):
        raise _invalid(path, "must be a string or a list of text blocks", raw)
    texts = []
    for index, block in enumerate(raw):
        block_path = f"{path}[{index}]"
        if not isinstance(block, dict) or block.get("type") != "text":
            kind = block.get("type") if isinstance(block, dict) else block
            raise _invalid(f"{block_path}.type", "only 'text' blocks are accepted here", kind)
        texts.append(_string(block, "text", block_path))
    return "\n".join(texts)


def _parse_messages(
    raw: object, known_arguments: Mapping[str, str] | None, memo: ParseMemo | None = None
) -> tuple[list[str], list[ChatMessage]]:
    """The messages, ``system``-role ones where they stand (the first list is kept empty for callers that
    took merged system texts from it)."""
    if not isinstance(raw, list) or not raw:
        raise _invalid("messages", "must be a non-empty list of message objects", raw)

    def parse_item(index: int, item: object) -> str | list[ChatMessage]:
        return _parse_item(item, f"messages[{index}]", known_arguments or {})

    if memo is not None:
        parsed = memo.parse(raw, parse_item)
    else:
        parsed = [parse_item(index, item) for index, item in enumerate(raw)]
    system: list[str] = []
    messages: list[ChatMessage] = []
    for one in parsed:
        if isinstance(one, str):
            messages.append(ChatMessage(role="system", content=one))
        else:
            messages += one
    if all(message.role == "system" for message in messages):
        raise _invalid("messages", "must hold a user or assistant message besides system ones", raw)
    return system, messages


def _parse_item(item: object, path: str, known_arguments: Mapping[str, str]) -> str | list[ChatMessage]:
    """One message of ``messages``: a system message's text, or the messages it makes (a user message
    with tool results makes one tool message each)."""
    if not isinstance(item, dict):
        raise _invalid(path, "must be a message object", item)
    role = item.get("role")
    if role not in ("user", "assistant", "system"):
        raise _invalid(f"{path}.role", "must be 'user', 'assistant' or 'system'", role)
    content = item.get("content")
    if role == "system":  # where it stands (made here, so the parse memo hands back the same object)
        return [ChatMessage(role="system", content=_text_of(content, f"{path}.content"))]
    if role == "user":
        return _user_messages(content, f"{path}.content")
    return [_assistant_message(content, f"{path}.content", known_arguments)]


def _blocks(content: object, path: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise _invalid(path, "must be a string or a list of content blocks", content)
    for index, block in enumerate(content):
        if not isinstance(block, dict):
            raise _invalid(f"{path}[{index}]", "must be a content block object", block)
    return content


def _user_messages(content: object, path: str) -> list[ChatMessage]:
    messages: list[ChatMessage] = []
    texts: list[str] = []

    def flush_text() -> None:
        if texts:
            messages.append(ChatMessage(role="user", content="\n".join(texts)))
            texts.clear()

    for index, block in enumerate(_blocks(content, path)):
        block_path = f"{path}[{index}]"
        kind = block.get("type")
        if kind == "text":
            texts.append(_string(block, "text", block_path))
        elif kind == "tool_result":
            flush_text()
            tool_use_id = _string(block, "tool_use_id", block_path)
            if not tool_use_id:
                raise _invalid(f"{block_path}.tool_use_id", "must be the id of a tool_use block", tool_use_id)
            result = block.get("content", "")
            messages.append(
                ChatMessage(
                    role="tool", tool_call_id=tool_use_id, content=_text_of(result, f"{block_path}.content")
                )
            )
        else:
            raise _invalid(f"{block_path}.type", "user content blocks must be 'text' or 'tool_result'", kind)
    flush_text()
    if not messages:
        raise _invalid(path, "must hold at least one block", content)
    return messages


def _assistant_message(content: object, path: str, known_arguments: Mapping[str, str]) -> ChatMessage:
    reasoning: str | None = None
    texts: list[str] = []
    calls: list[ToolCall] = []
    for index, block in enumerate(_blocks(content, path)):
        block_path = f"{path}[{index}]"
        kind = block.get("type")
        if kind == "text":
            texts.append(_string(block, "text", block_path))
        elif kind == "thinking":
            reasoning = _string(block, "thinking", block_path) or _signed(block.get("signature"))
        elif kind == "redacted_thinking":
            continue  # opaque to us; the recorded tokens hold what the model wrote
        elif kind == "tool_use":
            call_id = _string(block, "id", block_path)
            name = _string(block, "name", block_path)
            arguments = block.get("input", {})
            if not call_id or not name:
                raise _invalid(f"{block_path}", "a tool_use block needs a non-empty id and name", block)
            if not isinstance(arguments, dict):
                raise _invalid(f"{block_path}.input", "must be an object", arguments)
            calls.append(
                ToolCall(
                    id=call_id,
                    function=FunctionCall(
                        name=name, arguments=_arguments_text(call_id, arguments, known_arguments)
                    ),
                )
            )
        else:
            raise _invalid(
                f"{block_path}.type",
                "assistant content blocks must be 'text', 'thinking' or 'tool_use'",
                kind,
            )
    # input was checked to be an object above; the text may be a recorded one (as the model wrote it)
    check_tool_calls(calls, path, error=AnthropicRequestError, json_arguments=False)
    return ChatMessage(
        role="assistant", content="\n".join(texts), tool_calls=calls or None, reasoning_content=reasoning
    )


def _signed(signature: object) -> str | None:
    """The reasoning a thinking block's ``signature`` carries (this gateway's: base64 of the text)."""
    if isinstance(signature, str) and signature.startswith(SIGNATURE_PREFIX):
        try:
            return base64.b64decode(signature.removeprefix(SIGNATURE_PREFIX), validate=True).decode("utf-8")
        except (binascii.Error, UnicodeDecodeError):
            return None
    return None


def signature(reasoning: str) -> str:
    """A thinking block's ``signature``: the reasoning's text (base64), so a client that sends the block back
    with its text emptied still restores it."""
    return SIGNATURE_PREFIX + base64.b64encode(reasoning.encode()).decode()


def _arguments_text(call_id: str, arguments: dict[str, Any], known: Mapping[str, str]) -> str:
    """The recorded arguments text when ``arguments`` still equal it, else the arguments as JSON."""
    recorded = known.get(call_id)
    if recorded is not None:
        try:
            if same_json(json.loads(recorded), arguments):  # as the other dialects compare (true is not 1)
                return recorded
        except ValueError:
            pass
    return json.dumps(arguments, ensure_ascii=False)


def _parse_tools(raw: object, memo: ParseMemo | None = None) -> list[ToolSpec]:
    if not isinstance(raw, list):
        raise _invalid("tools", "must be a list of tools", raw)
    if memo is not None:  # agents send the same tools on every call: the same objects come back
        parsed = memo.parse(raw, _parse_tool)
    else:
        parsed = [_parse_tool(index, tool) for index, tool in enumerate(raw)]
    return [tool for tool in parsed if tool is not None]


def _parse_tool(index: int, tool: object) -> ToolSpec | None:
    """A tool offered to the policy; None for a server tool (accepted, not offered)."""
    path = f"tools[{index}]"
    if not isinstance(tool, dict):
        raise _invalid(path, "must be a tool object", tool)
    if tool.get("type") not in (None, "custom"):
        if not isinstance(tool.get("type"), str):
            raise _invalid(f"{path}.type", "must be a string", tool.get("type"))
        return None  # a server tool (web_search_..., bash_..., ...): accepted, not offered to the policy
    schema = tool.get("input_schema")
    if not isinstance(schema, dict):
        raise _invalid(f"{path}.input_schema", "is required: a JSON Schema object", schema)
    function = {
        "name": tool.get("name"),
        "description": tool.get("description") or "",
        "parameters": schema,
    }
    return _validated(ToolSpec, {"type": "function", "function": function}, path)


def _parse_tool_choice(raw: object, tools: list[ToolSpec]) -> ToolChoice | None:
    if raw is None:
        return None
    kind = raw.get("type") if isinstance(raw, dict) else None
    if kind in ("auto", "none"):
        return ToolChoice(mode="none" if kind == "none" else "auto")
    if kind == "any":
        if not tools:
            raise _invalid("tool_choice", "'any' needs tools", raw)
        return ToolChoice(mode="required")
    if kind == "tool" and isinstance(raw, dict):
        names = [tool.function.name for tool in tools]
        if raw.get("name") not in names:
            raise _invalid("tool_choice.name", f"must name one of the tools {names}", raw.get("name"))
        return ToolChoice(mode="function", name=raw["name"])
    raise _invalid(
        "tool_choice", "must be {'type': 'auto' | 'any' | 'none'} or {'type': 'tool', 'name': ...}", raw
    )


# ---- responses ---------------------------------------------------------------------------------------


def stop_reason(choice: ChoiceData, stop_sequences: Sequence[str]) -> tuple[str, str | None]:
    """Anthropic's ``stop_reason`` and ``stop_sequence`` for a reply."""
    if choice.tool_calls:
        return "tool_use", None
    if choice.finish_reason != "stop":
        return "max_tokens", None
    found = [(choice.text.find(stop), stop) for stop in stop_sequences if stop and stop in choice.text]
    if found:
        return "stop_sequence", min(found)[1]
    return "end_turn", None


def content_blocks(choice: ChoiceData) -> list[dict[str, Any]]:
    """A ``thinking`` block (when the model reasoned), a text block (when there is text), then a ``tool_use``
    block per tool call. The thinking block's ``signature`` carries its text (``signature``)."""
    blocks: list[dict[str, Any]] = []
    if choice.reasoning is not None:
        blocks.append(
            {"type": "thinking", "thinking": choice.reasoning, "signature": signature(choice.reasoning)}
        )
    if choice.text:
        blocks.append({"type": "text", "text": choice.text})
    for call in choice.tool_calls:
        blocks.append(
            {"type": "tool_use", "id": call.id, "name": call.function.name, "input": tool_input(call)}
        )
    return blocks


def tool_input(call: ToolCall) -> dict[str, Any]:
    """The call's arguments as an object (arguments that are not a JSON object: ``{"arguments": text}``)."""
    try:
        parsed = json.loads(call.function.arguments)
    except ValueError:
        parsed = None
    return parsed if isinstance(parsed, dict) else {"arguments": call.function.arguments}


def message_body(
    *,
    message_id: str,
    model: str,
    choice: ChoiceData,
    prompt_tokens: int,
    stop_sequences: Sequence[str] = (),
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """An Anthropic ``message`` object; ``extra`` keys are added at the top level."""
    reason, sequence = stop_reason(choice, stop_sequences)
    body = {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content_blocks(choice),
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": {"input_tokens": prompt_tokens, "output_tokens": len(choice.completion_token_ids)},
    }
    return {**body, **(extra or {})}


def message_events(
    *,
    message_id: str,
    model: str,
    choice: ChoiceData,
    prompt_tokens: int,
    stop_sequences: Sequence[str] = (),
    extra: Mapping[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """The events of a streamed message: ``message_start`` (with ``extra``); per block
    ``content_block_start``, one delta (``text_delta``, or ``input_json_delta`` with the arguments JSON) and
    ``content_block_stop``; then ``message_delta`` (stop reason, usage) and ``message_stop``. The reply is
    complete before streaming begins."""
    reason, sequence = stop_reason(choice, stop_sequences)
    start = {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": prompt_tokens, "output_tokens": 0},
        **(extra or {}),
    }
    events: list[dict[str, Any]] = [{"type": "message_start", "message": start}]
    for index, block in enumerate(content_blocks(choice)):
        deltas: list[dict[str, Any]] = []
        if block["type"] == "text":
            opening: dict[str, Any] = {"type": "text", "text": ""}
            delta = {"type": "text_delta", "text": block["text"]}
        elif block["type"] == "thinking":
            opening = {"type": "thinking", "thinking": "", "signature": ""}
            delta = {"type": "thinking_delta", "thinking": block["thinking"]}
            deltas = [{"type": "signature_delta", "signature": block["signature"]}]
        else:
            opening = {**block, "input": {}}
            delta = {
                "type": "input_json_delta",
                "partial_json": json.dumps(block["input"], ensure_ascii=False),
            }
        events += [
            {"type": "content_block_start", "index": index, "content_block": opening},
            *({"type": "content_block_delta", "index": index, "delta": each} for each in [delta, *deltas]),
            {"type": "content_block_stop", "index": index},
        ]
    usage = {"input_tokens": prompt_tokens, "output_tokens": len(choice.completion_token_ids)}
    events += [
        {
            "type": "message_delta",
            "delta": {"stop_reason": reason, "stop_sequence": sequence},
            "usage": usage,
        },
        {"type": "message_stop"},
    ]
    return events


def anthropic_sse(events: Iterable[Mapping[str, Any]]) -> bytes:
    """Server-sent events as Anthropic streams them: ``event: <type>`` and ``data: {json}`` per event."""
    return b"".join(
        b"event: "
        + str(event["type"]).encode()
        + b"\ndata: "
        + json.dumps(event, separators=(",", ":")).encode()
        + b"\n\n"
        for event in events
    )


class AnthropicMessages:
    """The ``Dialect`` of ``POST /v1/messages``, also at ``/v1/v1/messages``: the Anthropic SDK appends
    ``/v1/messages`` to its base URL, so one base URL ending in ``/v1`` serves both SDKs."""

    name: str = "anthropic"
    paths: tuple[str, ...] = ("/v1/messages", "/v1/v1/messages")

    def parse(
        self,
        body: object,
        *,
        defaults: SamplingParams,
        known_arguments: Mapping[str, str],
        memo: ParseMemo | None = None,
    ) -> ChatCall:
        return parse_messages_request(body, defaults=defaults, known_arguments=known_arguments, memo=memo)

    def render(self, call: ChatCall, result: ChatResult, *, model: str) -> WireReply:
        shape: dict[str, Any] = {
            "message_id": f"msg_{uuid.uuid4().hex}",
            "model": model,
            "choice": result.choices[0],
            "prompt_tokens": result.prompt_tokens,
            "stop_sequences": call.sampling.stop,
            "extra": result.extra,
        }
        if call.stream:
            return WireReply(events=anthropic_sse(message_events(**shape)))
        return WireReply(body=message_body(**shape))

    def error_body(self, error: RequestError) -> dict[str, Any]:
        return error_body(error.status, error.message)
