"""The OpenAI chat.completions dialect (``POST /v1/chat/completions``).

``parse_chat_request`` turns an OpenAI request body into a ``ChatCall``; ``completion_body`` and
``completion_chunks`` turn choices back into OpenAI response objects (whole, or as the chunks of a stream);
``OpenAIChat`` is the dialect the gateway serves, and ``pipeline.dialects.inprocess`` serves the same
translation to the OpenAI SDK in process (``llm.openai()``).

Choices made where the OpenAI API leaves room:

- ``developer`` messages are ``system`` messages; text content parts are joined with ``"\\n"`` (as vLLM does);
  any other part kind is refused.
- ``max_completion_tokens`` wins over ``max_tokens``; ``top_k`` (a vLLM extension) is read, -1 or 0 meaning
  off. ``null`` for any top-level field means "not given".
- Turnstile's ``abort`` and ``error`` finish reasons read as ``"length"``: the reply was cut short and is not
  what the model would have finished with. The exact reason stays in Turnstile's own record.
- Logprob entries carry each token's text and bytes and its ``top_logprobs`` alternatives, as the inference
  consumer's tokenizer gives them (``LLMRequest.top_logprobs``); without them (a client of its own that does
  not fill them) a token shows as ``<id>`` with ``bytes: null``.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from functools import partial
from typing import Any, Final

from pydantic import BaseModel, ConfigDict, Field

from pipeline.dialects.base import (
    ChatCall,
    ChatResult,
    ChoiceData,
    ParseMemo,
    RequestError,
    WireReply,
    bracket_path,
    check_tool_calls,
    invalid,
    parse_sampling,
    restore_arguments,
    shown,
    string_field,
    validated,
)
from schemas import (
    ChatMessage,
    FinishReason,
    SamplingParams,
    TokenLogprob,
    ToolChoice,
    ToolSpec,
    default_sampling,
)

OPENAI_FINISH_REASONS: Final[Mapping[FinishReason, str]] = {
    "stop": "stop",
    "length": "length",
    "tool_calls": "tool_calls",
    "abort": "length",
    "error": "length",
}
_ROLES: Final[Mapping[str, str]] = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
}
ERROR_TYPES: Final[Mapping[int, str]] = {401: "invalid_request_error", 429: "rate_limit_error"}
ERROR_CODES: Final[Mapping[int, str]] = {401: "invalid_api_key", 404: "not_found", 429: "rate_limit_exceeded"}


class OpenAIRequestError(RequestError):
    """A request the OpenAI API would refuse; ``body()`` is the error object an OpenAI server sends."""

    def body(self) -> dict[str, Any]:
        return error_body(self)


def error_body(error: RequestError) -> dict[str, Any]:
    """``{"error": {"message", "type", "param", "code"}}`` with the type and default code OpenAI uses for the
    status."""
    kind = ERROR_TYPES.get(error.status, "server_error" if error.status >= 500 else "invalid_request_error")
    code = error.code or ERROR_CODES.get(error.status)
    return {"error": {"message": error.message, "type": kind, "param": error.param, "code": code}}


_invalid = partial(invalid, error=OpenAIRequestError)
_string = partial(string_field, error=OpenAIRequestError)


def _sampling(given: Mapping[str, Any], defaults: SamplingParams) -> SamplingParams:
    max_tokens_key = "max_completion_tokens" if "max_completion_tokens" in given else "max_tokens"
    return parse_sampling(
        given, defaults, max_tokens_key=max_tokens_key, stop_key="stop", error=OpenAIRequestError,
        param_path=bracket_path,
    )  # fmt: skip


_validated = partial(validated, error=OpenAIRequestError, param_path=bracket_path)


# ---- requests ----------------------------------------------------------------------------------------


class _StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _CallOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str = ""
    n: int = Field(default=1, ge=1, le=128)  # OpenAI's own bound: each choice is a recorded turn
    logprobs: bool = False
    top_logprobs: int = Field(default=0, ge=0, le=20)
    stream: bool = False
    stream_options: _StreamOptions | None = None


def parse_chat_request(
    body: object, *, defaults: SamplingParams | None = None, memo: ParseMemo | None = None
) -> ChatCall:
    """An OpenAI chat.completions request body -> ``ChatCall``; unknown top-level keys are ignored.

    Raises ``OpenAIRequestError`` whose ``param`` is the path of the offending field
    (``messages[2].content[0].type``). ``defaults`` fill the sampling fields the request leaves out.
    """
    if not isinstance(body, dict):
        raise OpenAIRequestError(f"the request body must be a JSON object, got {shown(body)}")
    given = {key: value for key, value in body.items() if value is not None}
    options = _validated(_CallOptions, given, "")
    if options.top_logprobs and not options.logprobs:
        raise _invalid("top_logprobs", "needs logprobs set to true", options.top_logprobs)
    tools = _parse_tools(given.get("tools", []), memo.part("tools") if memo is not None else None)
    return ChatCall(
        messages=_parse_messages(given.get("messages"), memo.part("messages") if memo is not None else None),
        tools=tools,
        sampling=_sampling(given, defaults or default_sampling()),
        n=options.n,
        logprobs=options.logprobs,
        top_logprobs=options.top_logprobs,
        stream=options.stream,
        include_usage=options.stream_options is not None and options.stream_options.include_usage,
        model=options.model,
        tool_choice=_parse_tool_choice(given.get("tool_choice"), tools),
    )


def _parse_messages(raw: object, memo: ParseMemo | None = None) -> list[ChatMessage]:
    if not isinstance(raw, list) or not raw:
        raise _invalid("messages", "must be a non-empty list of message objects", raw)
    if memo is not None:
        return memo.parse(raw, lambda index, item: _parse_message(item, f"messages[{index}]"))
    return [_parse_message(item, f"messages[{index}]") for index, item in enumerate(raw)]


def _parse_message(raw: object, path: str) -> ChatMessage:
    if not isinstance(raw, dict):
        raise _invalid(path, "must be a message object", raw)
    role = raw.get("role")
    if not isinstance(role, str) or role not in _ROLES:
        raise _invalid(f"{path}.role", f"must be one of {', '.join(_ROLES)}", role)
    content = raw.get("content")
    if content is None and role != "assistant":
        raise _invalid(f"{path}.content", "is required: a string or a list of text parts", content)
    fields: dict[str, Any] = {"role": _ROLES[role], "content": _content_text(content, f"{path}.content")}
    if raw.get("name") is not None:
        fields["name"] = raw["name"]
    if role == "assistant":
        if raw.get("tool_calls"):
            fields["tool_calls"] = raw["tool_calls"]
        if raw.get("reasoning_content") is not None:
            fields["reasoning_content"] = raw["reasoning_content"]
    if role == "tool":
        tool_call_id = raw.get("tool_call_id")
        if not isinstance(tool_call_id, str) or not tool_call_id:
            raise _invalid(
                f"{path}.tool_call_id", "must be the id of the tool call this message answers", tool_call_id
            )
        fields["tool_call_id"] = tool_call_id
    message = _validated(ChatMessage, fields, path)
    if message.tool_calls:
        check_tool_calls(message.tool_calls, f"{path}.tool_calls", error=OpenAIRequestError)
    return message


def _content_text(content: object, path: str) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _invalid(path, "must be a string or a list of text parts", content)
    texts = []
    for index, part in enumerate(content):
        part_path = f"{path}[{index}]"
        if not isinstance(part, dict):
            raise _invalid(part_path, 'must be a content part object {"type": "text", "text": ...}', part)
        if part.get("type") != "text":
            raise _invalid(f"{part_path}.type", "only 'text' content parts are accepted", part.get("type"))
        if not isinstance(part.get("text"), str):
            raise _invalid(f"{part_path}.text", "must be a string", part.get("text"))
        texts.append(part["text"])
    return "\n".join(texts)


def _parse_tools(raw: object, memo: ParseMemo | None = None) -> list[ToolSpec]:
    if not isinstance(raw, list):
        raise _invalid("tools", "must be a list of function tools", raw)

    def parse_tool(index: int, tool: object) -> ToolSpec:
        return _validated(ToolSpec, tool, f"tools[{index}]")

    if memo is not None:  # agents send the same tools on every call: the same objects come back
        return memo.parse(raw, parse_tool)
    return [parse_tool(index, tool) for index, tool in enumerate(raw)]


def _parse_tool_choice(raw: object, tools: list[ToolSpec]) -> ToolChoice | None:
    accepted = "must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}"
    if raw is None:
        return None
    if raw in ("none", "auto"):
        return ToolChoice(mode="none" if raw == "none" else "auto")
    if raw == "required":
        if not tools:
            raise _invalid("tool_choice", "'required' needs tools", raw)
        return ToolChoice(mode="required")
    if not isinstance(raw, dict) or raw.get("type") != "function":
        raise _invalid("tool_choice", accepted, raw)
    function = raw.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    names = [tool.function.name for tool in tools]
    if name not in names:
        raise _invalid("tool_choice.function.name", f"must name one of the tools {names}", name)
    return ToolChoice(mode="function", name=name)


# ---- responses ---------------------------------------------------------------------------------------


def completion_body(
    *,
    completion_id: str,
    created: int,
    model: str,
    choices: Sequence[ChoiceData],
    prompt_tokens: int,
    logprobs: bool,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """An OpenAI ``chat.completion`` object; ``extra`` keys are added at the top level."""
    body: dict[str, Any] = {
        "id": completion_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": index,
                "message": _message(choice),
                "logprobs": {"content": _logprob_entries(choice), "refusal": None} if logprobs else None,
                "finish_reason": OPENAI_FINISH_REASONS[choice.finish_reason],
            }
            for index, choice in enumerate(choices)
        ],
        "usage": _usage(prompt_tokens, choices),
    }
    return _with_extra(body, extra)


def completion_chunks(
    *,
    completion_id: str,
    created: int,
    model: str,
    choices: Sequence[ChoiceData],
    prompt_tokens: int,
    logprobs: bool,
    include_usage: bool = False,
    extra: Mapping[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """The ``chat.completion.chunk`` objects of a streamed response, choice after choice.

    Per choice: the role, the content (one delta per token when the token texts spell the content,
    else one delta), one delta per tool call, the finish reason. Then the usage chunk when
    ``include_usage``. Logprob entries ride on the content deltas (on the finish chunk when there is no
    content), so joining them over the chunks gives the non-streamed list. ``extra`` goes on the last chunk.
    """

    header = {"id": completion_id, "object": "chat.completion.chunk", "created": created, "model": model}

    def chunk(
        index: int, delta: dict[str, Any], entries: list[dict[str, Any]] | None, finish: str | None
    ) -> dict[str, Any]:
        choice = {
            "index": index,
            "delta": delta,
            "logprobs": {"content": entries, "refusal": None} if logprobs and entries is not None else None,
            "finish_reason": finish,
        }
        return {**header, "choices": [choice], **({"usage": None} if include_usage else {})}

    chunks: list[dict[str, Any]] = []
    for index, choice in enumerate(choices):
        content = _content(choice)
        chunks.append(
            chunk(index, {"role": "assistant", "content": "" if content is not None else None}, None, None)
        )
        if choice.reasoning is not None:
            chunks.append(chunk(index, {"reasoning_content": choice.reasoning}, None, None))
        entries = _logprob_entries(choice)
        if choice.token_texts is not None and "".join(choice.token_texts) == choice.text != "":
            for text, entry in zip(choice.token_texts, entries, strict=True):
                chunks.append(chunk(index, {"content": text}, [entry], None))
            entries = []
        elif content:
            chunks.append(chunk(index, {"content": content}, entries, None))
            entries = []
        for call_index, call in enumerate(choice.tool_calls):
            tool_call = {"index": call_index, **call.model_dump(mode="json")}
            chunks.append(chunk(index, {"tool_calls": [tool_call]}, None, None))
        finish = OPENAI_FINISH_REASONS[choice.finish_reason]
        chunks.append(chunk(index, {}, entries or None, finish))
    if include_usage:
        chunks.append({**header, "choices": [], "usage": _usage(prompt_tokens, choices)})
    chunks[-1] = _with_extra(chunks[-1], extra)
    return chunks


def sse(chunks: Iterable[Mapping[str, Any]]) -> bytes:
    """Server-sent events as OpenAI streams them: ``data: {json}`` per chunk, then ``data: [DONE]``."""
    events = [b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n" for chunk in chunks]
    return b"".join([*events, b"data: [DONE]\n\n"])


def _content(choice: ChoiceData) -> str | None:
    return None if choice.tool_calls and not choice.text else choice.text


def _message(choice: ChoiceData) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": _content(choice), "refusal": None}
    if choice.reasoning is not None:
        message["reasoning_content"] = choice.reasoning  # as vLLM and DeepSeek name it
    if choice.tool_calls:
        message["tool_calls"] = [call.model_dump(mode="json") for call in choice.tool_calls]
    return message


def _logprob_entries(choice: ChoiceData) -> list[dict[str, Any]]:
    if choice.token_logprobs is not None:
        top = choice.top_logprobs or [[] for _ in choice.token_logprobs]
        return [
            {
                **_entry(token),
                "top_logprobs": [_entry(alternative) for alternative in alternatives],
            }
            for token, alternatives in zip(choice.token_logprobs, top, strict=True)
        ]
    texts = choice.token_texts or [f"<{token_id}>" for token_id in choice.completion_token_ids]
    return [
        {
            "token": text,
            "logprob": logprob,
            "bytes": list(text.encode()) if choice.token_texts is not None else None,
            "top_logprobs": [],
        }
        for text, logprob in zip(texts, choice.completion_logprobs, strict=True)
    ]


def _entry(token: TokenLogprob) -> dict[str, Any]:
    return {"token": token.text, "logprob": token.logprob, "bytes": token.bytes}


def _usage(prompt_tokens: int, choices: Sequence[ChoiceData]) -> dict[str, int]:
    completion_tokens = sum(len(choice.completion_token_ids) for choice in choices)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _with_extra(body: dict[str, Any], extra: Mapping[str, Any] | None) -> dict[str, Any]:
    if not extra:
        return body
    if clash := body.keys() & extra.keys():
        raise ValueError(f"extra keys {sorted(clash)} would replace OpenAI response fields")
    return {**body, **extra}


def model_object(name: str) -> dict[str, Any]:
    """A ``GET /v1/models`` entry: each policy is a model."""
    return {"id": name, "object": "model", "created": 0, "owned_by": "turnstile"}


class OpenAIChat:
    """The ``Dialect`` of ``POST /v1/chat/completions``."""

    name: str = "openai"
    paths: tuple[str, ...] = ("/v1/chat/completions",)

    def parse(
        self,
        body: object,
        *,
        defaults: SamplingParams,
        known_arguments: Mapping[str, str],
        memo: ParseMemo | None = None,
    ) -> ChatCall:
        call = parse_chat_request(body, defaults=defaults, memo=memo)
        # restore_arguments hands back the very message where nothing is restored (the memo's identity holds)
        return replace(call, messages=restore_arguments(call.messages, known_arguments))

    def render(self, call: ChatCall, result: ChatResult, *, model: str) -> WireReply:
        shape: dict[str, Any] = {
            "completion_id": f"chatcmpl-{uuid.uuid4().hex}",
            "created": int(time.time()),
            "model": model,
            "choices": result.choices,
            "prompt_tokens": result.prompt_tokens,
            "logprobs": call.logprobs,
            "extra": result.extra,
        }
        if call.stream:
            return WireReply(events=sse(completion_chunks(**shape, include_usage=call.include_usage)))
        return WireReply(body=completion_body(**shape))

    def error_body(self, error: RequestError) -> dict[str, Any]:
        return error_body(error)
