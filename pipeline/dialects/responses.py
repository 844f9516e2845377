"""The OpenAI Responses API (``POST /v1/responses``): what Codex CLI and the OpenAI Agents SDK speak.

``parse_responses_request`` turns a Responses request into a ``ResponsesCall`` (a ``ChatCall`` plus what the
reply echoes); ``response_body`` and ``response_events`` turn the recorded reply into a ``response`` object,
whole or as the events of a stream.

How the two shapes meet:

- ``instructions`` becomes a leading ``system`` message; ``input`` is a string (one user message) or a list
  of items: messages (``user``, ``system``, ``developer`` -> system, ``assistant``; a string or
  ``input_text`` / ``output_text`` / ``refusal`` parts, joined with ``"\\n"``), ``function_call`` items (tool
  calls of the assistant message they follow: ``call_id`` is the tool call id), ``function_call_output``
  items (``tool`` messages) and ``reasoning`` items (the next assistant message's reasoning). Any other item
  or part type is refused with 400 naming it.
- A reply is a ``reasoning`` item (when the policy reasoned: its text in ``content`` as ``reasoning_text``,
  and again in ``encrypted_content``, base64, so a client that sends back only the opaque field restores the
  exact reasoning), a ``message`` item with one ``output_text`` part (when there is text), and a
  ``function_call`` item per tool call. The response id is ``resp_`` + the recorded turn's id (hex):
  ``previous_response_id`` names that turn, and the gateway continues its whole conversation
  (``ChatCall.previous_turn``).
- ``tools``: function tools are served; other tool types (``web_search``, ``file_search``, ``local_shell``,
  ``custom``, MCP ...) are accepted and left out (the policy cannot call them; they are not recorded).
  ``tool_choice`` (``none``/``auto``/``required``/a function) is recorded like chat completions';
  ``parallel_tool_calls`` is echoed, not enforced.
- Accepted and ignored (they do not change what the policy generates here): ``store``, ``include``,
  ``prompt_cache_key``, ``prompt_cache_retention``, ``metadata``, ``user``, ``safety_identifier``,
  ``service_tier``, ``reasoning`` (effort, summary: the policy reasons as it does), ``text.verbosity``,
  ``stream_options``, ``truncation: "disabled"``, ``background: false``, ``top_logprobs: 0``, and unknown
  keys. Refused with 400 naming them, because they would change the output and are not served:
  ``text.format`` other than ``text`` (structured output), ``truncation: "auto"``, ``background: true``,
  ``conversation``, ``prompt`` (stored prompt templates), ``max_tool_calls``, ``top_logprobs`` > 0, and
  ``tool_choice`` naming a hosted tool or ``allowed_tools``.
"""

from __future__ import annotations

import base64
import json
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, Final

from pipeline.dialects.base import (
    ChatCall,
    ChatResult,
    ChoiceData,
    ParseMemo,
    RequestError,
    WireReply,
    bracket_path,
    invalid,
    parse_sampling,
    restore_arguments,
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

_ROLES: Final[Mapping[str, str]] = {
    "user": "user",
    "system": "system",
    "developer": "system",
    "assistant": "assistant",
}
_TEXT_PARTS: Final = ("input_text", "output_text", "text", "refusal")
_UNSERVED: Final[Mapping[str, str]] = {
    "conversation": "conversations are not served; send the input, or previous_response_id",
    "prompt": "stored prompt templates are not served; send instructions and input",
    "max_tool_calls": "is not served: the policy is not constrained in how many tools it calls",
}
ERROR_TYPES: Final[Mapping[int, str]] = {401: "invalid_request_error", 429: "rate_limit_error"}
ERROR_CODES: Final[Mapping[int, str]] = {401: "invalid_api_key", 404: "not_found", 429: "rate_limit_exceeded"}
RESPONSE_PREFIX: Final = "resp_"


class ResponsesRequestError(RequestError):
    """A request the Responses API would refuse."""


_invalid = partial(invalid, error=ResponsesRequestError)
_string = partial(string_field, error=ResponsesRequestError)
_sampling = partial(
    parse_sampling, max_tokens_key="max_output_tokens", stop_key=None, error=ResponsesRequestError,
    param_path=bracket_path,
)  # fmt: skip
_validated = partial(validated, error=ResponsesRequestError, param_path=bracket_path)


@dataclass(frozen=True)
class ResponsesCall(ChatCall):
    """A Responses request: the chat call, and the request fields its ``response`` object echoes."""

    echo: dict[str, Any] = field(default_factory=dict)


def response_id(turn_id: str) -> str:
    """The response id of a recorded turn (``resp_<turn id hex>``)."""
    return RESPONSE_PREFIX + uuid.UUID(turn_id).hex


def turn_of_response(value: object) -> uuid.UUID:
    """The turn a ``previous_response_id`` names, or 400."""
    if isinstance(value, str) and value.startswith(RESPONSE_PREFIX):
        try:
            return uuid.UUID(value.removeprefix(RESPONSE_PREFIX))
        except ValueError:
            pass
    raise ResponsesRequestError(
        f"Previous response with id {shown(value)} not found: the ids this gateway gives are "
        "'resp_' + a recorded turn's id",
        param="previous_response_id",
        code="previous_response_not_found",
    )


# ---- requests ----------------------------------------------------------------------------------------


def parse_responses_request(body: object, *, defaults: SamplingParams | None = None) -> ResponsesCall:
    """A Responses request body -> ``ResponsesCall``; raises ``ResponsesRequestError`` naming the field."""
    if not isinstance(body, dict):
        raise ResponsesRequestError(f"the request body must be a JSON object, got {shown(body)}")
    given = {key: value for key, value in body.items() if value is not None}
    _refuse_unserved(given)
    model = given.get("model", "")
    if not isinstance(model, str):
        raise _invalid("model", "must be a string", model)
    stream = given.get("stream", False)
    if not isinstance(stream, bool):
        raise _invalid("stream", "must be true or false", stream)
    instructions = given.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise _invalid("instructions", "must be a string", instructions)
    raw_tools = given.get("tools", [])
    tools, echoed_tools = _parse_tools(raw_tools)
    previous = given.get("previous_response_id")
    previous_turn = turn_of_response(previous) if previous is not None else None
    messages = [ChatMessage(role="system", content=instructions)] if instructions is not None else []
    messages += _parse_input(given.get("input"))
    parallel = given.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise _invalid("parallel_tool_calls", "must be true or false", parallel)
    sampling = _sampling(given, defaults or default_sampling())
    echo = {
        "instructions": instructions,
        "tools": echoed_tools,
        "tool_choice": given.get("tool_choice", "auto"),
        "parallel_tool_calls": parallel,
        "temperature": given.get("temperature"),
        "top_p": given.get("top_p"),
        "max_output_tokens": given.get("max_output_tokens"),
        "previous_response_id": previous,
        "metadata": given.get("metadata") if isinstance(given.get("metadata"), dict) else {},
        "store": given.get("store") if isinstance(given.get("store"), bool) else True,
    }
    return ResponsesCall(
        messages=messages,
        tools=tools,
        sampling=sampling,
        n=1,
        logprobs=False,
        top_logprobs=0,
        stream=stream,
        include_usage=True,
        model=model,
        tool_choice=_parse_tool_choice(given.get("tool_choice"), tools),
        previous_turn=previous_turn,
        echo=echo,
    )


def _refuse_unserved(given: Mapping[str, Any]) -> None:
    for key, why in _UNSERVED.items():
        if key in given:
            raise _invalid(key, why, given[key])
    if given.get("background", False) is not False:
        raise _invalid(
            "background", "background responses are not served; leave it false", given["background"]
        )
    if given.get("truncation", "disabled") != "disabled":
        raise _invalid(
            "truncation", "only 'disabled' is served (the conversation is never cut)", given["truncation"]
        )
    if given.get("top_logprobs", 0) != 0:
        raise _invalid(
            "top_logprobs",
            "logprobs are not served on this route (use chat completions)",
            given["top_logprobs"],
        )
    text = given.get("text", {})
    if not isinstance(text, dict):
        raise _invalid("text", "must be an object", text)
    text_format = text.get("format")
    if text_format is not None and (not isinstance(text_format, dict) or text_format.get("type") != "text"):
        raise _invalid(
            "text.format", "only {'type': 'text'} is served (structured output is not)", text_format
        )


def _parse_input(raw: object) -> list[ChatMessage]:
    if isinstance(raw, str):
        return [ChatMessage(role="user", content=raw)]
    if not isinstance(raw, list) or not raw:
        raise _invalid("input", "must be a string or a non-empty list of input items", raw)
    messages: list[ChatMessage] = []
    pending = _Assistant()
    for index, item in enumerate(raw):
        path = f"input[{index}]"
        if not isinstance(item, dict):
            raise _invalid(path, "must be an input item object", item)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if not isinstance(role, str) or role not in _ROLES:
                raise _invalid(f"{path}.role", f"must be one of {', '.join(_ROLES)}", role)
            text = _content_text(item.get("content"), f"{path}.content")
            if role == "assistant":
                if pending.text is not None or pending.calls:
                    messages.append(pending.message())
                pending.text = text
            else:
                messages += pending.flush()
                messages.append(ChatMessage(role=_ROLES[role], content=text))
        elif kind == "function_call":
            call_id = _string(item, "call_id", path)
            name = _string(item, "name", path)
            arguments = _string(item, "arguments", path)
            if not call_id or not name:
                raise _invalid(path, "a function_call item needs a non-empty call_id and name", item)
            pending.calls.append(ToolCall(id=call_id, function=FunctionCall(name=name, arguments=arguments)))
        elif kind == "function_call_output":
            messages += pending.flush()
            call_id = _string(item, "call_id", path)
            if not call_id:
                raise _invalid(f"{path}.call_id", "must be the call_id of a function_call", call_id)
            output = _content_text(item.get("output"), f"{path}.output")
            messages.append(ChatMessage(role="tool", tool_call_id=call_id, content=output))
        elif kind == "reasoning":
            if pending.text is not None or pending.calls:
                messages.append(pending.message())
                pending = _Assistant()
            pending.reasoning = _reasoning_text(item, path)
        else:
            raise _invalid(
                f"{path}.type",
                "input items must be 'message', 'function_call', 'function_call_output' or 'reasoning'",
                kind,
            )
    messages += pending.flush()
    return messages


@dataclass
class _Assistant:
    """The assistant message being gathered from consecutive reasoning, message and function_call items."""

    text: str | None = None
    reasoning: str | None = None
    calls: list[ToolCall] = field(default_factory=list)

    def message(self) -> ChatMessage:
        return ChatMessage(
            role="assistant",
            content=self.text or "",
            tool_calls=self.calls or None,
            reasoning_content=self.reasoning,
        )

    def flush(self) -> list[ChatMessage]:
        """The gathered message (none if nothing was gathered), and a fresh start."""
        if self.text is None and not self.calls and self.reasoning is None:
            return []
        message = self.message()
        self.text, self.reasoning, self.calls = None, None, []
        return [message]


def _content_text(content: object, path: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _invalid(path, "must be a string or a list of text parts", content)
    texts = []
    for index, part in enumerate(content):
        part_path = f"{path}[{index}]"
        if not isinstance(part, dict):
            raise _invalid(part_path, "must be a content part object", part)
        kind = part.get("type")
        if kind not in _TEXT_PARTS:
            raise _invalid(
                f"{part_path}.type", "only 'input_text', 'output_text' and 'refusal' parts are served", kind
            )
        texts.append(_string(part, "refusal" if kind == "refusal" else "text", part_path))
    return "\n".join(texts)


def _reasoning_text(item: Mapping[str, Any], path: str) -> str | None:
    """The reasoning a ``reasoning`` item carries: its ``reasoning_text`` content, else what
    ``encrypted_content`` holds (this gateway's: base64 text), else none (a summary is not the reasoning)."""
    content = item.get("content")
    if isinstance(content, list) and content:
        texts = []
        for index, part in enumerate(content):
            part_path = f"{path}.content[{index}]"
            if not isinstance(part, dict) or part.get("type") != "reasoning_text":
                kind = part.get("type") if isinstance(part, dict) else part
                raise _invalid(f"{part_path}.type", "reasoning content parts must be 'reasoning_text'", kind)
            texts.append(_string(part, "text", part_path))
        return "\n".join(texts)
    encrypted = item.get("encrypted_content")
    if isinstance(encrypted, str) and encrypted:
        try:
            return base64.b64decode(encrypted, validate=True).decode("utf-8")
        except ValueError:  # binascii.Error, UnicodeDecodeError, or text that is not ASCII at all
            return None  # another server's opaque reasoning: nothing here can read it
    return None


def _parse_tools(raw: object) -> tuple[list[ToolSpec], list[dict[str, Any]]]:
    """The function tools, and every tool as the response echoes it (other types are accepted, unused)."""
    if not isinstance(raw, list):
        raise _invalid("tools", "must be a list of tools", raw)
    tools: list[ToolSpec] = []
    for index, tool in enumerate(raw):
        path = f"tools[{index}]"
        if not isinstance(tool, dict):
            raise _invalid(path, "must be a tool object", tool)
        kind = tool.get("type")
        if not isinstance(kind, str):
            raise _invalid(f"{path}.type", "must be a string ('function', 'web_search', ...)", kind)
        if kind != "function":
            continue  # hosted and custom tools: accepted, not offered to the policy
        function = {
            "name": tool.get("name"),
            "description": tool.get("description") or "",
            "parameters": tool.get("parameters") or {"type": "object", "properties": {}},
        }
        tools.append(_validated(ToolSpec, {"type": "function", "function": function}, path))
    return tools, [tool for tool in raw if isinstance(tool, dict)]


def _parse_tool_choice(raw: object, tools: list[ToolSpec]) -> ToolChoice | None:
    if raw is None:
        return None
    if raw in ("none", "auto"):
        return ToolChoice(mode="none" if raw == "none" else "auto")
    if raw == "required":
        if not tools:
            raise _invalid("tool_choice", "'required' needs function tools", raw)
        return ToolChoice(mode="required")
    if isinstance(raw, dict) and raw.get("type") == "function":
        names = [tool.function.name for tool in tools]
        if raw.get("name") not in names:
            raise _invalid(
                "tool_choice.name", f"must name one of the function tools {names}", raw.get("name")
            )
        return ToolChoice(mode="function", name=raw["name"])
    raise _invalid(
        "tool_choice",
        "must be 'none', 'auto', 'required' or {'type': 'function', 'name': ...} (hosted tools are not "
        "served)",
        raw,
    )


# ---- responses ---------------------------------------------------------------------------------------


def output_items(choice: ChoiceData, turn_hex: str) -> list[dict[str, Any]]:
    """The reply's output items: reasoning, message, function calls (ids derived from the turn's)."""
    items: list[dict[str, Any]] = []
    if choice.reasoning is not None:
        items.append(
            {
                "type": "reasoning",
                "id": f"rs_{turn_hex}",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": choice.reasoning}],
                "encrypted_content": base64.b64encode(choice.reasoning.encode()).decode(),
                "status": "completed",
            }
        )
    if choice.text or not choice.tool_calls:
        items.append(
            {
                "type": "message",
                "id": f"msg_{turn_hex}",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": choice.text, "annotations": [], "logprobs": []}],
            }
        )
    for index, call in enumerate(choice.tool_calls):
        items.append(
            {
                "type": "function_call",
                "id": f"fc_{turn_hex}_{index}",
                "call_id": call.id,
                "name": call.function.name,
                "arguments": call.function.arguments,
                "status": "completed",
            }
        )
    return items


def response_body(
    call: ResponsesCall, result: ChatResult, *, model: str, created_at: int, status: str = "completed"
) -> dict[str, Any]:
    """A ``response`` object (``status`` in_progress: the opening of a stream, without output and usage)."""
    choice = result.choices[0]
    turn_id = _turn_id(result)
    done = status != "in_progress"
    cut = done and choice.finish_reason != "stop" and choice.finish_reason != "tool_calls"
    completion = len(choice.completion_token_ids)
    body: dict[str, Any] = {
        "id": response_id(turn_id),
        "object": "response",
        "created_at": created_at,
        "status": "incomplete" if cut else status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "model": model,
        "output": output_items(choice, uuid.UUID(turn_id).hex) if done else [],
        "usage": {
            "input_tokens": result.prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": result.prompt_tokens + completion,
        }
        if done
        else None,
        "text": {"format": {"type": "text"}},
        "reasoning": {"effort": None, "summary": None},
        "truncation": "disabled",
        **call.echo,
    }
    return {**body, **(result.extra or {})}


def response_events(
    call: ResponsesCall, result: ChatResult, *, model: str, created_at: int
) -> list[dict[str, Any]]:
    """The events of a streamed response, in the order OpenAI sends them: ``response.created``,
    ``response.in_progress``, per output item ``response.output_item.added``, its deltas (text:
    ``content_part.added``, ``output_text.delta``/``done``, ``content_part.done``; a function call:
    ``function_call_arguments.delta``/``done``) and ``response.output_item.done``; then
    ``response.completed`` (``response.incomplete`` when the reply was cut) with usage."""
    opening = response_body(call, result, model=model, created_at=created_at, status="in_progress")
    final = response_body(call, result, model=model, created_at=created_at)
    events: list[dict[str, Any]] = [
        {"type": "response.created", "response": opening},
        {"type": "response.in_progress", "response": opening},
    ]
    for index, item in enumerate(final["output"]):
        at = {"output_index": index, "item_id": item["id"]}
        if item["type"] == "message":
            part = item["content"][0]
            empty = {**part, "text": ""}
            text = part["text"]
            events += [
                {"type": "response.output_item.added", "output_index": index,
                 "item": {**item, "status": "in_progress", "content": []}},
                {"type": "response.content_part.added", **at, "content_index": 0, "part": empty},
                {"type": "response.output_text.delta", **at, "content_index": 0, "delta": text,
                 "logprobs": []},
                {"type": "response.output_text.done", **at, "content_index": 0, "text": text, "logprobs": []},
                {"type": "response.content_part.done", **at, "content_index": 0, "part": part},
            ]  # fmt: skip
        elif item["type"] == "function_call":
            arguments = item["arguments"]
            events += [
                {"type": "response.output_item.added", "output_index": index,
                 "item": {**item, "status": "in_progress", "arguments": ""}},
                {"type": "response.function_call_arguments.delta", **at, "delta": arguments},
                {"type": "response.function_call_arguments.done", **at, "arguments": arguments,
                 "name": item["name"]},
            ]  # fmt: skip
        else:
            events.append({"type": "response.output_item.added", "output_index": index, "item": item})
        events.append({"type": "response.output_item.done", "output_index": index, "item": item})
    closing = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
    events.append({"type": closing, "response": final})
    return [{**event, "sequence_number": number} for number, event in enumerate(events)]


def responses_sse(events: Iterable[Mapping[str, Any]]) -> bytes:
    """Server-sent events as the Responses API streams them: ``event: <type>`` and ``data: {json}``."""
    return b"".join(
        b"event: "
        + str(event["type"]).encode()
        + b"\ndata: "
        + json.dumps(event, separators=(",", ":")).encode()
        + b"\n\n"
        for event in events
    )


def _turn_id(result: ChatResult) -> str:
    turn_ids: Sequence[str] = (result.extra or {}).get("turnstile", {}).get("turn_ids") or [str(uuid.uuid4())]
    return turn_ids[0]


def error_body(error: RequestError) -> dict[str, Any]:
    """``{"error": {"message", "type", "param", "code"}}``, as the Responses API sends it."""
    kind = ERROR_TYPES.get(error.status, "server_error" if error.status >= 500 else "invalid_request_error")
    code = error.code or ERROR_CODES.get(error.status)
    return {"error": {"message": error.message, "type": kind, "param": error.param, "code": code}}


class OpenAIResponses:
    """The ``Dialect`` of ``POST /v1/responses``."""

    name: str = "responses"
    paths: tuple[str, ...] = ("/v1/responses",)

    def parse(
        self,
        body: object,
        *,
        defaults: SamplingParams,
        known_arguments: Mapping[str, str],
        memo: ParseMemo | None = None,
    ) -> ChatCall:
        # no memo: an input item's meaning depends on the items around it (function calls join the
        # assistant message before them); clients that continue with previous_response_id send only
        # what is new anyway
        call = parse_responses_request(body, defaults=defaults)
        return replace(call, messages=restore_arguments(call.messages, known_arguments))

    def render(self, call: ChatCall, result: ChatResult, *, model: str) -> WireReply:
        responses_call = call if isinstance(call, ResponsesCall) else ResponsesCall(**vars(call))
        created_at = int(time.time())
        if call.stream:
            events = response_events(responses_call, result, model=model, created_at=created_at)
            return WireReply(events=responses_sse(events))
        return WireReply(body=response_body(responses_call, result, model=model, created_at=created_at))

    def error_body(self, error: RequestError) -> dict[str, Any]:
        return error_body(error)
