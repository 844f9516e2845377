"""What every gateway route does with HTTP: the JSON body, its checks, the answer or the error in the
dialect's shape, the training and retry headers, a disconnected client."""

from __future__ import annotations

import fnmatch
import hashlib
import json
import logging
import re
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Final, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.types import Receive, Scope, Send

from pipeline.dialects import (
    Dialect,
    RequestError,
    WireReply,
)
from pipeline.errors import TurnstileError, describe_validation_error
from pipeline.gateway.http_error import GatewayError
from pipeline.gateway.sessions import RetryKeys, SessionEntry

log = logging.getLogger(__name__)

PROMPT_IDS_HEADER: Final = "x-turnstile-prompt-ids"
"""``whole``: the reply's ``turnstile`` field also carries the whole prompt's ids (``chat_result``)."""

TRAIN_HEADER: Final = "x-turnstile-train"
"""``false`` (or ``0``, ``no``, ``off``): the call's turns are recorded as not for training (a side call)."""
_NO: Final = frozenset({"false", "0", "no", "off"})
_YES: Final = frozenset({"true", "1", "yes", "on"})

_Spec = TypeVar("_Spec", bound=BaseModel)


def client_gone(receive: Receive) -> bool:
    """Whether the client has disconnected, known without waiting: ``receive()`` is stepped once, and a
    message that is not there yet is not waited for (the step is closed), as Starlette's
    ``Request.is_disconnected`` does with an anyio cancel scope, which costs a task cancellation a call.
    Call it once the body has been read (a body message taken here is dropped)."""
    step = receive().__await__()
    try:
        step.send(None)
    except StopIteration as done:
        message: dict[str, Any] = done.value
        return message.get("type") == "http.disconnect"
    step.close()
    return False


def trained(request: Request, entry: SessionEntry, model: str) -> bool | None:
    """Whether the call's turns are for training: the ``x-turnstile-train`` header when sent, else False
    when the session's ``untrained_models`` rule matches the request's ``model``, else None: the
    materializer's lineage rule decides (side calls are not trained unless asked)."""
    header = request.headers.get(TRAIN_HEADER)
    if header is not None:
        value = header.strip().lower()
        if value not in _NO | _YES:
            raise GatewayError(
                400, f"the {TRAIN_HEADER} header must be true or false, got {header!r}", param=TRAIN_HEADER
            )
        return value in _YES
    return False if any(fnmatch.fnmatchcase(model, pattern) for pattern in entry.untrained_models) else None


def retry_keys(request: Request, body: bytes) -> RetryKeys:
    """What tells a retry from a new call: ``Idempotency-Key``, the route and body, and the SDKs'
    ``x-stainless-retry-count`` (a count that is not a number reads as not sent)."""
    count = request.headers.get("x-stainless-retry-count")
    path: str = request.scope["path"]  # request.url builds and parses the whole URL: not on every call
    digest = hashlib.sha256(path.encode() + b"\n" + body).digest()
    return RetryKeys(
        idempotency_key=request.headers.get("idempotency-key") or None,
        body=digest,
        retry_count=int(count) if count is not None and count.strip().isdigit() else None,
    )


def json_answer(body: Mapping[str, Any]) -> Response:
    return JSONResponse(dict(body))


async def respond(dialect: Dialect, answer: Callable[[], Awaitable[Response] | Response]) -> Response:
    """The answer, or the error it raised in ``dialect``'s error shape. Errors that are not Turnstile's are
    bugs: logged, and answered 500 (the gateway stays up)."""
    try:
        result = answer()
        return await result if not isinstance(result, Response) else result
    except RequestError as error:
        return error_response(dialect, error)
    except TurnstileError as error:
        return error_response(dialect, GatewayError(500, str(error)))
    except Exception:
        log.exception("the gateway failed to answer a request")
        return error_response(dialect, GatewayError(500, "internal error in the gateway (logged)"))


def error_response(dialect: Dialect, error: RequestError) -> Response:
    headers = error.headers if isinstance(error, GatewayError) else None
    return JSONResponse(dialect.error_body(error), status_code=error.status, headers=headers)


class Handover(Response):
    """A chat reply that says whether it reached a live client: ``settle(True)`` once it was handed to a
    connection that was still open (the whole body, a stream's last event included, is sent in one
    message), ``settle(False)`` when the client had gone before (nothing is sent). Delivery is judged after
    the turn was recorded, when the reply is handed over, not before the append."""

    def __init__(self, inner: Response, settle: Callable[[bool], None]) -> None:
        self.inner = inner
        self.settle = settle
        self.status_code = inner.status_code
        self.background = None
        self.raw_headers = inner.raw_headers
        self.body = inner.body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if client_gone(receive):
            self.settle(False)
            return
        try:
            await self.inner(scope, receive, send)
        except OSError:
            self.settle(False)  # the connection broke while the body went out
            raise
        self.settle(True)


def wire_response(reply: WireReply) -> Response:
    if reply.events is not None:
        return Response(reply.events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    return JSONResponse(reply.body)


async def json_body(request: Request, *, empty: object = None) -> object:
    """The request's JSON body (``empty`` when there is none and that is allowed)."""
    raw = await request.body()
    if not raw.strip() and empty is not None:
        return empty
    return parse_json(raw)


def parse_json(raw: bytes) -> object:
    """A JSON body parsed, or a ``GatewayError`` (400) naming why it cannot be taken: not JSON, too deep,
    or a string the log cannot store."""
    try:
        body = json.loads(raw)
    except ValueError as error:
        raise GatewayError(400, f"the request body is not valid JSON: {error}") from None
    except RecursionError:
        raise GatewayError(400, "the request body nests JSON too deeply; flatten it") from None
    if json.detect_encoding(raw) != "utf-8" or _MAYBE_UNSTORABLE.search(raw) is not None:
        _check_storable(body, "body")
    return body


_MAYBE_UNSTORABLE: Final = re.compile(rb"\\u(?:0000|[dD][89a-fA-F])|\xed[\xa0-\xbf]")
"""What a UTF-8 JSON body must hold for a string of it to hold a NUL or a lone surrogate: the escapes
``\\u0000`` and ``\\ud800``-``\\udfff``, or a surrogate encoded in UTF-8 bytes (which ``json.loads`` lets
through). A raw NUL byte in a string is refused by the parser itself. A body without any (nearly every
body: a surrogate pair is escaped only by ASCII-only encoders) is storable without a walk over its
strings; one with one is walked (``_check_storable``), a valid pair included."""


def _check_storable(value: object, where: str) -> None:
    """Refuse what the event log cannot hold before anything runs: a NUL character (PostgreSQL's jsonb has
    none) and a lone surrogate (not Unicode text). Iterative: the body may nest deeply. A quick pass first
    (no paths: this runs on every body, a long conversation's included); the path is found only for a body
    that fails."""
    if _storable(value):
        return
    stack: list[tuple[object, str]] = [(value, where)]
    while stack:
        item, path = stack.pop()
        if isinstance(item, dict):
            for key, child in item.items():
                stack.append((key, f"{path} (a key)"))
                stack.append((child, f"{path}.{key}"))
        elif isinstance(item, list):
            stack.extend((child, f"{path}[{index}]") for index, child in enumerate(item))
        elif isinstance(item, str):
            if "\x00" in item:
                raise GatewayError(
                    400, f"{path} holds a NUL character (\\u0000), which cannot be stored; remove it"
                )
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise GatewayError(
                    400,
                    f"{path} holds a lone surrogate (such as \\ud800), which is not Unicode text; remove it",
                ) from None


def _storable(value: object) -> bool:
    """Whether every string (keys too) in a parsed JSON value is free of NUL and of lone surrogates: the
    strings are gathered and checked as one (a check per string costs more than the copy)."""
    texts: list[str] = []
    stack = [value]
    while stack:
        item = stack.pop()
        if type(item) is str:
            texts.append(item)
        elif type(item) is dict:
            texts.extend(item)
            stack.extend(item.values())
        elif type(item) is list:
            stack.extend(item)
    text = "".join(texts)
    if "\x00" in text:
        return False
    if text.isascii():
        return True
    try:
        text.encode("utf-8")  # a lone surrogate stays one when joined: it cannot pair with its neighbour
    except UnicodeEncodeError:
        return False
    return True


def parse_spec(model: type[_Spec], body: object) -> _Spec:
    try:
        return model.model_validate(body)
    except ValidationError as error:
        raise GatewayError(400, f"invalid request body: {describe_validation_error(error)}") from None
