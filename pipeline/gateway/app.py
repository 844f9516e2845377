"""The HTTP gateway: OpenAI- and Anthropic-compatible endpoints whose every call is a recorded turn.

A session is an episode. An admin (``Authorization: Bearer <admin key>``) starts one with
``POST /admin/sessions`` and gets a per-session API key; an agent written for any framework points its
OpenAI or Anthropic client at the gateway with that key, and each ``POST /v1/chat/completions``,
``POST /v1/responses`` or ``POST /v1/messages`` goes through ``EpisodeSession.chat``: over NATS to the
inference consumers, appended to the log as a ``TurnCompleted`` before the reply is sent, token-exact when
the conversation extends an earlier turn. Rewards and the end of the session are posted by the admin
(``/admin/sessions/{id}/reward|end``) or by the session's own key (``/v1/session/reward|end``); once a
session has ended its key gets 401, like any unknown key, and nothing in a 401 says whether a session
exists.

The chat routes are made from the dialect registry (``pipeline.dialects.DIALECTS``): each dialect's paths,
parsed, recorded and answered in that API's shape, errors included. Keys and sessions are in
``sessions``, admission and the session lifecycle in ``service``, the HTTP server in ``server``.

A retry of a call already taken (``Idempotency-Key``, ``x-stainless-retry-count``, or the same body: see
``SessionEntry.prior``) is answered from that call; a turn recorded when every client that asked has gone
is marked never delivered (``Gateway.answer``).

Streaming (``stream: true``) sends the finished reply as the events of a stream: the consumers do not
generate incrementally, so the first byte comes when the turn is recorded. The recorded turn is the same
whether or not the call streamed.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import fnmatch
import hashlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any, Final, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match
from starlette.types import Receive, Scope, Send

from pipeline.dialects import (
    ANTHROPIC,
    DIALECTS,
    OPENAI,
    Dialect,
    RequestError,
    WireReply,
    dialect_for_path,
    model_object,
)
from pipeline.dialects.anthropic import count_tokens_estimate
from pipeline.errors import TurnstileError, describe_validation_error
from pipeline.gateway.http_error import GatewayError
from pipeline.gateway.openapi import (
    ANTHROPIC_COUNT_TOKENS,
    ANTHROPIC_MESSAGES,
    OPENAI_CHAT,
    OPENAI_RESPONSES,
    model_schema,
    openapi_body,
)
from pipeline.gateway.service import AFTER_END, EndSpec, Gateway, RewardSpec, SessionSpec, describe
from pipeline.gateway.sessions import RetryKeys, SessionEntry, SessionRegistry
from pipeline.inference import LLMClient
from pipeline.log import Store

log = logging.getLogger(__name__)

REQUEST_SCHEMAS: Final = {
    "openai": OPENAI_CHAT,
    "anthropic": ANTHROPIC_MESSAGES,
    "responses": OPENAI_RESPONSES,
}
"""The request body of each dialect's chat route in ``/openapi.json``, by ``Dialect.name``."""

PROMPT_IDS_HEADER: Final = "x-turnstile-prompt-ids"
"""``whole``: the reply's ``turnstile`` field also carries the whole prompt's ids (``chat_result``)."""

TRAIN_HEADER: Final = "x-turnstile-train"
"""``false`` (or ``0``, ``no``, ``off``): the call's turns are recorded as not for training (a side call)."""
_NO: Final = frozenset({"false", "0", "no", "off"})
_YES: Final = frozenset({"true", "1", "yes", "on"})

_Spec = TypeVar("_Spec", bound=BaseModel)


def create_gateway(
    store: Store | None,
    llm: LLMClient | None,
    *,
    admin_key: str | None,
    capacity: int | None = None,
    max_staleness: int | None = None,
    policy_default: str | None = None,
    registry: SessionRegistry | None = None,
    retry_after: float = 1.0,
    idle_timeout: float | None = None,
    runner_id: str | None = None,
    public_url: str | None = None,
) -> FastAPI:
    """The gateway app; its ``Gateway`` is ``app.state.gateway`` (also ``gateway_of(app)``).

    With no ``store``/``llm`` and no ``admin_key`` it serves only sessions registered in ``registry``
    (how ``pipeline.runners.proxy`` runs one inside a runner).
    """
    gateway = Gateway(
        store,
        llm,
        registry=registry,
        admin_key=admin_key,
        policy_default=policy_default,
        capacity=capacity,
        max_staleness=max_staleness,
        retry_after=retry_after,
        idle_timeout=idle_timeout,
        runner_id=runner_id,
        public_url=public_url,
    )

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        reaper = asyncio.create_task(_reap_forever(gateway)) if gateway.idle_timeout else None
        try:
            yield
        finally:
            if reaper is not None:
                reaper.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await reaper
            await gateway.close_all("cancelled")

    app = GatewayApp(title="Turnstile gateway", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.gateway = gateway

    @app.exception_handler(StarletteHTTPException)
    async def unknown_route(request: Request, error: StarletteHTTPException) -> Response:
        what = "Invalid URL" if error.status_code == 404 else str(error.detail)
        message = f"{what} ({request.method} {request.url.path})"
        return error_response(dialect_for_path(request.url.path), GatewayError(error.status_code, message))

    # -- the chat routes, one set per wire API --

    def chat_route(dialect: Dialect) -> Callable[[Request], Awaitable[Response]]:
        async def chat(request: Request) -> Response:
            async def answer() -> Response:
                entry = gateway.session_of(request)
                call = dialect.parse(
                    await json_body(request),
                    defaults=entry.session.started.sampling,
                    known_arguments=entry.tool_arguments,
                    memo=entry.memo(dialect.name),
                )
                call = dataclasses.replace(
                    call,
                    whole_prompt_ids=request.headers.get(PROMPT_IDS_HEADER, "").strip().lower() == "whole",
                    train=trained(request, entry, call.model),
                )

                async def listening() -> bool:
                    return not client_gone(request.receive)

                keys = retry_keys(request, await request.body())
                result = await gateway.answer(entry, call, keys, listening)
                return wire_response(dialect.render(call, result, model=entry.session.policy))

            return await respond(dialect, answer)

        return chat

    for dialect in DIALECTS:
        for index, path in enumerate(dialect.paths):
            app.add_api_route(
                path,
                chat_route(dialect),
                methods=["POST"],
                include_in_schema=index == 0,
                openapi_extra=openapi_body(REQUEST_SCHEMAS[dialect.name]),
            )

    # -- Anthropic's token count (an estimate: see count_tokens_estimate) --

    async def count_tokens(request: Request) -> Response:
        async def answer() -> Response:
            gateway.session_of(request)
            return JSONResponse({"input_tokens": count_tokens_estimate(await json_body(request))})

        return await respond(ANTHROPIC, answer)

    for index, path in enumerate(("/v1/messages/count_tokens", "/v1/v1/messages/count_tokens")):
        app.add_api_route(
            path,
            count_tokens,
            methods=["POST"],
            include_in_schema=index == 0,
            openapi_extra=openapi_body(ANTHROPIC_COUNT_TOKENS),
        )

    # -- models (OpenAI's listing: each policy is a model) --

    async def models(request: Request) -> Response:
        async def answer() -> Response:
            return JSONResponse(
                {"object": "list", "data": [model_object(m) for m in _models_of(gateway, request)]}
            )

        return await respond(OPENAI, answer)

    async def model(request: Request, name: str) -> Response:
        async def answer() -> Response:
            if name not in _models_of(gateway, request):
                raise GatewayError(
                    404, f"The model {name!r} does not exist", param="model", code="model_not_found"
                )
            return JSONResponse(model_object(name))

        return await respond(OPENAI, answer)

    app.add_api_route("/v1/models", models, methods=["GET"])
    app.add_api_route("/v1/models/{name}", model, methods=["GET"])

    # -- the session's own key --

    async def own_session(request: Request) -> Response:
        return await respond(OPENAI, lambda: _json(describe(gateway.session_of(request))))

    async def own_reward(request: Request) -> Response:
        async def answer() -> Response:
            entry = gateway.session_of(request)
            return _json(await gateway.reward(entry, parse_spec(RewardSpec, await json_body(request))))

        return await respond(OPENAI, answer)

    async def own_end(request: Request) -> Response:
        async def answer() -> Response:
            entry = gateway.session_of(request)
            return _json(await gateway.end(entry, parse_spec(EndSpec, await json_body(request, empty={}))))

        return await respond(OPENAI, answer)

    app.add_api_route("/v1/session", own_session, methods=["GET"])
    reward_body, end_body = (
        openapi_body(model_schema(RewardSpec)),
        openapi_body(model_schema(EndSpec), required=False),
    )
    app.add_api_route("/v1/session/reward", own_reward, methods=["POST"], openapi_extra=reward_body)
    app.add_api_route("/v1/session/end", own_end, methods=["POST"], openapi_extra=end_body)

    # -- admin --

    async def create_session(request: Request) -> Response:
        async def answer() -> Response:
            gateway.require_admin(request)
            spec = parse_spec(SessionSpec, await json_body(request, empty={}))
            session, api_key = await gateway.start_session(spec)
            base_url = gateway.public_url or str(request.base_url).rstrip("/")
            body = {
                "session_id": session.episode_id,
                "api_key": api_key,
                "base_url": f"{base_url}/v1",
                "policy": session.policy,
            }
            return JSONResponse(body, status_code=201)

        return await respond(OPENAI, answer)

    def admin_entry(request: Request, session_id: str) -> SessionEntry:
        gateway.require_admin(request)
        entry = gateway.registry.get(session_id)
        if entry is None:
            ended = gateway.registry.ended(session_id)
            if ended is not None:
                raise ended.conflict(AFTER_END)
            message = f"no session {session_id!r} was started here (GET /admin/sessions lists the open ones)"
            raise GatewayError(404, message)
        return entry

    async def admin_session(request: Request, session_id: str) -> Response:
        return await respond(OPENAI, lambda: _json(describe(admin_entry(request, session_id))))

    async def admin_reward(request: Request, session_id: str) -> Response:
        async def answer() -> Response:
            entry = admin_entry(request, session_id)
            return _json(await gateway.reward(entry, parse_spec(RewardSpec, await json_body(request))))

        return await respond(OPENAI, answer)

    async def admin_end(request: Request, session_id: str) -> Response:
        async def answer() -> Response:
            entry = admin_entry(request, session_id)
            return _json(await gateway.end(entry, parse_spec(EndSpec, await json_body(request, empty={}))))

        return await respond(OPENAI, answer)

    async def admin_sessions(request: Request) -> Response:
        async def answer() -> Response:
            gateway.require_admin(request)
            return JSONResponse({"data": [describe(entry) for entry in gateway.registry.entries()]})

        return await respond(OPENAI, answer)

    session_body = openapi_body(model_schema(SessionSpec), required=False)
    app.add_api_route("/admin/sessions", create_session, methods=["POST"], openapi_extra=session_body)
    app.add_api_route("/admin/sessions", admin_sessions, methods=["GET"])
    app.add_api_route("/admin/sessions/{session_id}", admin_session, methods=["GET"])
    app.add_api_route(
        "/admin/sessions/{session_id}/reward", admin_reward, methods=["POST"], openapi_extra=reward_body
    )
    app.add_api_route("/admin/sessions/{session_id}/end", admin_end, methods=["POST"], openapi_extra=end_body)

    async def health(_: Request) -> Response:
        return JSONResponse({"status": "ok"})

    app.add_api_route("/health", health, methods=["GET"])
    app.direct_routes = [route for route in app.routes if isinstance(route, APIRoute)]
    return app


class GatewayApp(FastAPI):
    """FastAPI, with the gateway's own routes called straight from ``__call__``.

    Every route of the gateway is ``async endpoint(request, **path_params) -> Response`` that parses its
    body and shapes its errors itself (``respond``): FastAPI's middleware, routing, dependency injection and
    validation added nothing to them but CPU (in bench/gateway.py's profile of the gateway, about as much
    as the endpoints' own parsing and rendering). The routes stay registered on FastAPI for
    ``/openapi.json`` and for what is left to it: a path that matches no route (404) or not with this method
    (405), in the dialect's error shape; what is mounted beside them (the episode browser at ``/ui``); and
    an app served under a ``root_path``."""

    direct_routes: Sequence[APIRoute] = ()
    """The routes ``__call__`` serves itself, in the router's order (set once they are all added)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not scope.get("root_path"):
            for route in self.direct_routes:
                match, child_scope = route.matches(scope)
                if match is Match.FULL:
                    scope.update(child_scope, app=self)
                    endpoint: Callable[..., Awaitable[Response]] = route.endpoint
                    response = await endpoint(Request(scope, receive), **child_scope["path_params"])
                    await response(scope, receive, send)
                    return
        await super().__call__(scope, receive, send)


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


def trained(request: Request, entry: SessionEntry, model: str) -> bool:
    """Whether the call's turns are for training: the ``x-turnstile-train`` header when sent, else the
    session's ``untrained_models`` rule (a request ``model`` matching one of its patterns is a side call)."""
    header = request.headers.get(TRAIN_HEADER)
    if header is not None:
        value = header.strip().lower()
        if value not in _NO | _YES:
            raise GatewayError(
                400, f"the {TRAIN_HEADER} header must be true or false, got {header!r}", param=TRAIN_HEADER
            )
        return value in _YES
    return not any(fnmatch.fnmatchcase(model, pattern) for pattern in entry.untrained_models)


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


def gateway_of(app: FastAPI) -> Gateway:
    gateway: Gateway = app.state.gateway
    return gateway


async def _reap_forever(gateway: Gateway) -> None:
    assert gateway.idle_timeout is not None
    while True:
        await asyncio.sleep(min(max(gateway.idle_timeout / 4, 0.05), 5.0))
        try:
            await gateway.reap_idle()
        except Exception:
            log.exception("ending idle sessions failed; trying again")


def _models_of(gateway: Gateway, request: Request) -> list[str]:
    if gateway.is_admin(request):
        policies = {entry.session.policy for entry in gateway.registry.entries()}
        return sorted(policies | ({gateway.policy_default} if gateway.policy_default else set()))
    return [gateway.session_of(request).session.policy]


def _json(body: Mapping[str, Any]) -> Response:
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


def wire_response(reply: WireReply) -> Response:
    if reply.events is not None:
        return Response(reply.events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    return JSONResponse(reply.body)


async def json_body(request: Request, *, empty: object = None) -> object:
    """The request's JSON body (``empty`` when there is none and that is allowed)."""
    raw = await request.body()
    if not raw.strip() and empty is not None:
        return empty
    try:
        body = json.loads(raw)
    except ValueError as error:
        raise GatewayError(400, f"the request body is not valid JSON: {error}") from None
    except RecursionError:
        raise GatewayError(400, "the request body nests JSON too deeply; flatten it") from None
    _check_storable(body, "body")
    return body


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
