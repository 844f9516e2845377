"""What every wire API dialect shares: the parsed call and its result, the request error, the one validation
helper, and the ``Dialect`` interface the gateway serves its routes from.

A dialect knows one wire API (OpenAI chat completions, Anthropic messages, ...): it parses a request body
into a ``ChatCall`` (Turnstile's messages, tools and sampling, plus the options that shape the reply),
renders a ``ChatResult`` as that API's JSON body or server-sent events, and shapes errors the way that
API's servers do. It does no I/O and knows nothing of sessions: the gateway and ``llm.openai()`` do that.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Protocol, TypeVar
from uuid import UUID

from pydantic import BaseModel, ValidationError

from pipeline.errors import TurnstileError
from schemas import (
    IGNORE,
    TOLERANT,
    ChatMessage,
    FinishReason,
    SamplingParams,
    TokenLogprob,
    ToolCall,
    ToolChoice,
    ToolSpec,
)

_Model = TypeVar("_Model", bound=BaseModel)


@dataclass(frozen=True)
class ChatCall:
    """A request in Turnstile's terms: what the session sends, and how the reply should be shaped."""

    messages: list[ChatMessage]
    tools: list[ToolSpec]
    sampling: SamplingParams
    n: int
    logprobs: bool
    top_logprobs: int
    stream: bool
    include_usage: bool
    model: str
    tool_choice: ToolChoice | None
    previous_turn: UUID | None = None
    """A recorded turn of the session whose conversation and reply come before ``messages`` (the Responses
    API's ``previous_response_id``); the gateway resolves it."""
    whole_prompt_ids: bool = False
    """The reply's ``turnstile`` field carries the whole prompt's ids (opt-in: see ``chat_result``)."""
    train: bool | None = None
    """False: the turns are recorded as not for training (a side call: ``TurnCompleted.train``); True: asked
    for training; None: the materializer's lineage rule decides."""


@dataclass(frozen=True)
class ChoiceData:
    """One recorded reply, as a dialect renders it."""

    text: str
    tool_calls: list[ToolCall]
    finish_reason: FinishReason
    completion_token_ids: list[int]
    completion_logprobs: list[float]
    token_texts: list[str] | None = None
    token_logprobs: list[TokenLogprob] | None = None
    """Each completion token's text, bytes and logprob, from the engine's tokenizer (when asked)."""
    top_logprobs: list[list[TokenLogprob]] | None = None
    reasoning: str | None = None
    """The model's reasoning, apart from ``text`` (``reasoning_content``; Anthropic ``thinking`` blocks)."""

    def __post_init__(self) -> None:
        tokens = len(self.completion_token_ids)
        if len(self.completion_logprobs) != tokens:
            raise ValueError(f"{len(self.completion_logprobs)} logprobs for {tokens} completion tokens")
        if self.token_texts is not None and len(self.token_texts) != tokens:
            raise ValueError(f"{len(self.token_texts)} token texts for {tokens} completion tokens")


@dataclass(frozen=True)
class ChatResult:
    """The replies to a call (``n`` of them), the prompt's token count, and top-level extras (Turnstile's
    own ``turnstile`` field: turn ids and token ids)."""

    choices: list[ChoiceData]
    prompt_tokens: int
    extra: dict[str, Any] | None = None


ChatHandler = Callable[[ChatCall], Awaitable[ChatResult]]


@dataclass(frozen=True)
class WireReply:
    """A reply in a wire API's shape: a JSON body, or the bytes of a server-sent event stream."""

    body: dict[str, Any] | None = None
    events: bytes | None = None


class RequestError(TurnstileError):
    """A request the wire API refuses: the HTTP status, the message, the field it names (``param``, in the
    dialect's path notation) and a machine-readable ``code``. Each dialect renders it in its own shape."""

    def __init__(
        self, message: str, *, param: str | None = None, status: int = 400, code: str | None = None
    ) -> None:
        self.message, self.param, self.status, self.code = message, param, status, code
        super().__init__(message)


_Parsed = TypeVar("_Parsed")
MEMO_HISTORIES = 4
"""Histories a ``ParseMemo`` keeps: the conversations of a session that interleave (its loop, a subagent,
a title call) each find their own."""


class ParseMemo:
    """What a session's recent calls sent and what each item of it parsed to, so that a call parses only
    what it adds.

    Agents send the whole history on every call. The leading items that are equal to those of a recent
    call (``==`` on the parsed JSON: a comparison in C, no validation) are not parsed and validated again:
    they come back as the very objects that call got, which the session then compares by identity when it
    looks for the turn the call continues. A call's cost grows with what it adds, not with its history.
    Parsing an item must depend on nothing but the item (an error names it by its index)."""

    def __init__(self) -> None:
        self._histories: list[tuple[list[object], list[Any]]] = []
        self._parts: dict[str, ParseMemo] = {}

    def part(self, name: str) -> ParseMemo:
        """The memo of one list of the request (``messages``, ``tools``): each is compared with its own."""
        return self._parts.setdefault(name, ParseMemo())

    def parse(self, raw: list[object], parse_item: Callable[[int, object], _Parsed]) -> list[_Parsed]:
        best, reused = -1, 0
        for index, (items, _) in enumerate(self._histories):
            shared, limit = 0, min(len(raw), len(items))
            while shared < limit and raw[shared] == items[shared]:
                shared += 1
            if shared > reused:
                best, reused = index, shared
        items, kept = self._histories.pop(best) if best >= 0 else ([], [])
        parsed = kept[:reused] + [parse_item(index, raw[index]) for index in range(reused, len(raw))]
        # the items already held stay (their strings are the parsed messages' own): memory of one history
        self._histories = [*self._histories[-(MEMO_HISTORIES - 1) :], (items[:reused] + raw[reused:], parsed)]
        return parsed


class Dialect(Protocol):
    """One wire API. The gateway adds a POST route for each of ``paths``; the registry is in
    ``pipeline.dialects``. Adding an API is one module with one of these and one line in the registry."""

    name: str
    paths: tuple[str, ...]
    """The chat routes, e.g. ``/v1/chat/completions``."""

    def parse(
        self,
        body: object,
        *,
        defaults: SamplingParams,
        known_arguments: Mapping[str, str],
        memo: ParseMemo | None = None,
    ) -> ChatCall:
        """A request body -> ``ChatCall``, or ``RequestError`` naming the field. ``known_arguments``: the
        recorded argument text of the session's tool calls by id (for APIs that send arguments parsed).
        ``memo``: the session's (``ParseMemo``), for dialects that reuse what earlier calls parsed."""
        ...

    def render(self, call: ChatCall, result: ChatResult, *, model: str) -> WireReply:
        """The reply as this API sends it: whole, or as the events of a stream when ``call.stream``."""
        ...

    def error_body(self, error: RequestError) -> dict[str, Any]:
        """The error object this API's servers send for ``error``."""
        ...


# ---- the one validation helper -----------------------------------------------------------------------

ParamPath = Callable[[str, Sequence[int | str]], str]
"""Joins a parent path and a pydantic error location into the name of a request field."""


def bracket_path(path: str, location: Iterable[int | str]) -> str:
    """``messages[2].content[0].type`` (OpenAI's notation); pydantic's union tags are skipped."""
    for part in location:
        if isinstance(part, int):
            path += f"[{part}]"
        elif not part.startswith("function-"):
            path = f"{path}.{part}" if path else part
    return path


def dotted_path(path: str, location: Iterable[int | str]) -> str:
    """``stop_sequences.0`` (Anthropic's notation); a tool's ``function`` wrapper is not named, and an error
    of the whole body names ``request``."""
    parts = [str(part) for part in location if not str(part).startswith("function-")]
    return ".".join([path, *parts] if path else parts).replace(".function.", ".") or "request"


def shown(value: object, limit: int = 80) -> str:
    """``repr(value)``, cut to ``limit`` characters, for error messages."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def validated(
    model: type[_Model],
    data: object,
    path: str,
    *,
    error: type[RequestError],
    param_path: ParamPath = bracket_path,
    renames: Mapping[str, str] | None = None,
) -> _Model:
    """``model`` validated from ``data`` (unknown keys ignored), or ``error`` naming the first bad field
    (``renames`` maps model field names to the API's) with the problem, the count of the others, and what
    was sent."""
    try:
        return model.model_validate(data, context=TOLERANT, extra=IGNORE)
    except ValidationError as failure:
        first = failure.errors()[0]
        location = [(renames or {}).get(str(part), part) for part in first["loc"]]
        more = failure.error_count() - 1
        problem = first["msg"] + (f" ({more} more problems in this request)" if more else "")
        raise invalid(param_path(path, location), problem, first["input"], error=error) from None


def invalid(param: str, problem: str, got: object, *, error: type[RequestError]) -> RequestError:
    """``error`` saying ``invalid <param>: <problem>, got <what was sent>``."""
    return error(f"invalid {param}: {problem}, got {shown(got)}", param=param)


def check_tool_calls(
    calls: Sequence[ToolCall], path: str, *, error: type[RequestError], json_arguments: bool = True
) -> None:
    """Refuses a message whose tool calls share an id (a ``tool`` message could not say which it answers, and
    the lineage keys on ids) or, with ``json_arguments``, whose arguments do not parse as a JSON object (what
    every tool schema describes; anything else reaches the template and the tool as garbage)."""
    seen: set[str] = set()
    for index, call in enumerate(calls):
        if call.id in seen:
            raise invalid(
                f"{path}[{index}].id",
                "repeats an earlier tool call's id in this message",
                call.id,
                error=error,
            )
        seen.add(call.id)
        if json_arguments and not _is_json_object(call.function.arguments):
            raise invalid(
                f"{path}[{index}].function.arguments",
                "must be the JSON text of an object",
                call.function.arguments,
                error=error,
            )


def _is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except (
        ValueError
    ):  # json.JSONDecodeError and RecursionError's cousin, a too-deep document, both land here
        return False


TOP_K_OFF: Final = (-1, 0)  # what clients send for "no top-k"


def string_field(item: Mapping[str, Any], key: str, path: str, *, error: type[RequestError]) -> str:
    """``item[key]`` if it is a string, else ``error`` naming ``path.key``."""
    value = item.get(key)
    if not isinstance(value, str):
        raise invalid(f"{path}.{key}", "must be a string", value, error=error)
    return value


def parse_sampling(
    given: Mapping[str, Any],
    defaults: SamplingParams,
    *,
    max_tokens_key: str,
    stop_key: str | None,
    error: type[RequestError],
    param_path: ParamPath,
) -> SamplingParams:
    """The request's sampling over ``defaults``: temperature, top_p, seed and top_k under their own names
    (top_k -1 or 0 is none), the token limit under ``max_tokens_key``, the stop sequences under ``stop_key``
    (where the API has them); each error names the API's own key. A lone string under ``stop`` is one stop
    sequence (OpenAI's wire form)."""
    fields = defaults.model_dump()
    for key in ("temperature", "top_p", "seed"):
        if key in given:
            fields[key] = given[key]
    if "top_k" in given:
        fields["top_k"] = None if given["top_k"] in TOP_K_OFF else given["top_k"]
    if max_tokens_key in given:
        fields["max_tokens"] = given[max_tokens_key]
    renames = {"max_tokens": max_tokens_key}
    if stop_key is not None and stop_key in given:
        stop = given[stop_key]
        fields["stop"] = [stop] if stop_key == "stop" and isinstance(stop, str) else stop
        renames["stop"] = stop_key
    return validated(SamplingParams, fields, "", error=error, param_path=param_path, renames=renames)


# ---- tool-call arguments sent back re-serialized ------------------------------------------------------


def restore_arguments(messages: list[ChatMessage], known: Mapping[str, str]) -> list[ChatMessage]:
    """``messages`` with each assistant tool call's arguments put back to the text the model wrote, where a
    client sent back the same JSON re-serialized (``known``: recorded arguments text by tool call id).

    The Vercel AI SDK (opencode) parses a call's arguments and sends them back through ``JSON.stringify``:
    ``{"cmd":"ls"}`` for the model's ``{"cmd": "ls"}``. Unrestored, the history no longer matches the
    recorded reply and every call after a tool call would start a new lineage instead of continuing."""
    if not known:
        return messages
    return [_restored(message, known) if message.tool_calls else message for message in messages]


def _restored(message: ChatMessage, known: Mapping[str, str]) -> ChatMessage:
    calls = message.tool_calls or []
    restored = [_restored_call(call, known.get(call.id)) for call in calls]
    if all(new is old for new, old in zip(restored, calls, strict=True)):
        return message
    return message.model_copy(update={"tool_calls": restored})


def _restored_call(call: ToolCall, recorded: str | None) -> ToolCall:
    sent = call.function.arguments
    if recorded is None or sent == recorded or not same_json_text(sent, recorded):
        return call
    return call.model_copy(update={"function": call.function.model_copy(update={"arguments": recorded})})


def same_json_text(first: str, second: str) -> bool:
    """Whether two texts hold the same JSON value as a JavaScript client sees it: key order and spacing
    aside, ``1`` and ``1.0`` alike (one number type), ``true`` and ``1`` not (Python's ``True == 1``)."""
    try:
        return same_json(json.loads(first), json.loads(second))
    except ValueError:
        return False


def same_json(first: object, second: object) -> bool:
    """``same_json_text`` for values already parsed (the Messages API sends a call's input as an object)."""
    if isinstance(first, bool) or isinstance(second, bool):
        return type(first) is type(second) and first == second
    if isinstance(first, dict) and isinstance(second, dict):
        return first.keys() == second.keys() and all(same_json(first[k], second[k]) for k in first)
    if isinstance(first, list) and isinstance(second, list):
        return len(first) == len(second) and all(map(same_json, first, second))
    if isinstance(first, dict | list) or isinstance(second, dict | list):
        return False
    return first == second
