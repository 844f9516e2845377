"""The HTTP gateway: OpenAI- and Anthropic-compatible endpoints whose every call is a recorded turn.

A session is an episode. An admin (``Authorization: Bearer <admin key>``) starts one with
``POST /admin/sessions`` and gets a per-session API key; an agent written for any framework points its
OpenAI or Anthropic client at the gateway with that key, and each ``POST /v1/chat/completions`` or
``POST /v1/messages`` goes through ``EpisodeSession.chat``: over NATS to the inference consumers, appended
to the log as a ``TurnCompleted`` before the reply is sent, token-exact when the conversation extends an
earlier turn. Rewards and the end of the session are posted by the admin
(``/admin/sessions/{id}/reward|end``) or by the session's own key (``/v1/session/reward|end``); once a
session has ended its key gets 401, like any unknown key, and nothing in a 401 says whether a session
exists.

``SessionRegistry`` maps keys to open sessions. Keys are ``secrets.token_urlsafe(32)``; only their SHA-256
digests are kept, and the admin key is compared in constant time. Sessions created elsewhere (a runner's
episode, see ``pipeline.runners.proxy``) can be registered too: the gateway then serves their calls and
rewards but leaves starting and ending them to their owner.

Admission (``POST /admin/sessions`` answers 429 with ``Retry-After``):

- ``capacity``: at most this many sessions started by the gateway are open at once.
- ``max_staleness``: the newest ``PolicyVersionPublished`` of the session's policy in the log, minus the
  newest policy version the inference consumers have answered this gateway's calls with, is at most
  this. Until a consumer has answered a call for the policy there is nothing to compare and sessions are
  admitted.

Streaming (``stream: true``) sends the finished reply as the events of a stream: the consumers do not
generate incrementally, so the first byte comes when the turn is recorded. The recorded turn is the same
whether or not the call streamed.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import secrets
import socket
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator, Mapping
from typing import Any, Final, Literal, TypeVar

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from pipeline.dialects.anthropic import (
    AnthropicRequestError,
    anthropic_sse,
    message_body,
    message_events,
    parse_messages_request,
)
from pipeline.dialects.anthropic import error_body as anthropic_error_body
from pipeline.dialects.openai import (
    ChatCall,
    ChatResult,
    OpenAIRequestError,
    completion_body,
    completion_chunks,
    parse_chat_request,
    sse,
)
from pipeline.episodes import ChatReply, EpisodeSession, InvalidLLMCall, MaxTurnsExceeded
from pipeline.episodes.openai_client import chat_result
from pipeline.errors import (
    InvalidEvent,
    StoreUnavailable,
    TurnstileError,
    WrongExpectedVersion,
    describe_validation_error,
)
from pipeline.inference.client import (
    InferenceError,
    InferenceTimeout,
    LLMClient,
    NoInferenceConsumer,
    RequestRejected,
)
from pipeline.log import Store
from schemas import PolicyVersionPublished, SamplingParams
from schemas.episode import Termination

log = logging.getLogger(__name__)

Api = Literal["openai", "anthropic"]
OPENAI_ERROR_TYPES: Final[Mapping[int, str]] = {
    401: "invalid_request_error",
    429: "rate_limit_error",
}
OPENAI_ERROR_CODES: Final[Mapping[int, str]] = {
    401: "invalid_api_key",
    404: "not_found",
    429: "rate_limit_exceeded",
}
BAD_KEY: Final = (
    "invalid API key: it names no open session of this gateway (a session's key stops working when it ends)"
)
STALENESS_CACHE_S: Final = 1.0

_T = TypeVar("_T")


class GatewayError(TurnstileError):
    """An HTTP error answer: its status, message, the request field it names, and extra headers."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = dict(headers or {})
        super().__init__(message)

    def openai_body(self) -> dict[str, Any]:
        kind = OPENAI_ERROR_TYPES.get(
            self.status, "server_error" if self.status >= 500 else "invalid_request_error"
        )
        code = self.code or OPENAI_ERROR_CODES.get(self.status)
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": code}}

    def anthropic_body(self) -> dict[str, Any]:
        return anthropic_error_body(self.status, self.message)


# ---- sessions ----------------------------------------------------------------------------------------


def key_digest(api_key: str) -> bytes:
    return hashlib.sha256(api_key.encode()).digest()


class SessionEntry:
    """An open session as the gateway holds it: whose it is, when it was last used, its calls in flight."""

    def __init__(self, session: EpisodeSession, digest: bytes, *, owned: bool) -> None:
        self.session = session
        self.digest = digest
        self.owned = owned
        self.last_used = time.monotonic()
        self.calls: set[asyncio.Task[Any]] = set()

    @property
    def session_id(self) -> str:
        return self.session.episode_id

    async def run(self, work: Coroutine[Any, Any, _T]) -> _T:
        """Run one call of this session as a task the session can wait for (or cancel) when it closes."""
        self.last_used = time.monotonic()
        task = asyncio.create_task(work)
        self.calls.add(task)
        task.add_done_callback(self.calls.discard)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if task.cancelled() and not (current is not None and current.cancelling()):
                raise GatewayError(409, "the session was closed while this call was in flight") from None
            raise
        finally:
            self.last_used = time.monotonic()


class SessionRegistry:
    """API keys -> open sessions. Keys are kept only as SHA-256 digests."""

    def __init__(self) -> None:
        self._by_digest: dict[bytes, SessionEntry] = {}
        self._by_id: dict[str, SessionEntry] = {}

    def register(self, session: EpisodeSession, *, owned: bool = False) -> str:
        """A fresh key for ``session`` (``owned``: the gateway started it and ends it)."""
        if session.episode_id in self._by_id:
            raise TurnstileError(f"session {session.episode_id} is already registered")
        api_key = "ts-" + secrets.token_urlsafe(32)
        entry = SessionEntry(session, key_digest(api_key), owned=owned)
        self._by_digest[entry.digest] = entry
        self._by_id[entry.session_id] = entry
        return api_key

    def lookup(self, api_key: str) -> SessionEntry | None:
        digest = key_digest(api_key)
        entry = self._by_digest.get(digest)
        return entry if entry is not None and hmac.compare_digest(entry.digest, digest) else None

    def get(self, session_id: str) -> SessionEntry | None:
        return self._by_id.get(session_id)

    def entries(self) -> list[SessionEntry]:
        return list(self._by_id.values())

    def owned_count(self) -> int:
        return sum(entry.owned for entry in self._by_id.values())

    def __len__(self) -> int:
        return len(self._by_id)

    async def close(self, session_id: str, *, cancel: bool = False) -> SessionEntry | None:
        """Forget the session (its key stops working at once), then wait for its calls in flight to be
        recorded, or cancel them (``cancel``)."""
        entry = self._by_id.pop(session_id, None)
        if entry is None:
            return None
        self._by_digest.pop(entry.digest, None)
        calls = list(entry.calls)
        if cancel:
            for call in calls:
                call.cancel()
        await asyncio.gather(*calls, return_exceptions=True)
        return entry


# ---- request bodies of the session endpoints ---------------------------------------------------------


class SessionSpec(BaseModel):
    """``POST /admin/sessions``: the episode to start."""

    model_config = ConfigDict(extra="forbid")
    task: dict[str, Any] = Field(default_factory=dict)
    task_id: str = ""
    policy: str | None = Field(default=None, min_length=1)
    group_id: str | None = None
    group_size: int = Field(default=1, ge=1)
    agent: str = "gateway"
    sampling: SamplingParams | None = None
    tags: dict[str, str] = Field(default_factory=dict)
    max_turns: int | None = Field(default=None, ge=1)
    episode_id: str | None = Field(default=None, min_length=1, max_length=200)


class RewardSpec(BaseModel):
    """``.../reward``: ``turn_id`` a turn's id, ``"last"`` for the latest turn, or none for the episode."""

    model_config = ConfigDict(extra="forbid")
    value: float
    turn_id: str | None = None
    source: str = "gateway"


class EndSpec(BaseModel):
    """``.../end``: how the episode ended (none: ``done``; ``max_turns`` when a call went over the session's
    ``max_turns``, ``truncated`` when its last reply was cut)."""

    model_config = ConfigDict(extra="forbid")
    termination: Termination | None = None
    error: str | None = None
    metrics: dict[str, float] = Field(default_factory=dict)


_Spec = TypeVar("_Spec", bound=BaseModel)


# ---- the gateway -------------------------------------------------------------------------------------


class Gateway:
    """What the HTTP app serves: the registry, and sessions started on the store and LLM client."""

    def __init__(
        self,
        store: Store | None,
        llm: LLMClient | None,
        *,
        registry: SessionRegistry | None = None,
        admin_key: str | None = None,
        policy_default: str | None = None,
        capacity: int | None = None,
        max_staleness: int | None = None,
        retry_after: float = 1.0,
        idle_timeout: float | None = None,
        runner_id: str | None = None,
        public_url: str | None = None,
    ) -> None:
        self.store = store
        self.llm = llm
        self.registry = registry if registry is not None else SessionRegistry()
        self.admin_digest = key_digest(admin_key) if admin_key else None
        self.policy_default = policy_default
        self.capacity = capacity
        self.max_staleness = max_staleness
        self.retry_after = retry_after
        self.idle_timeout = idle_timeout
        self.runner_id = runner_id
        self.public_url = public_url.rstrip("/") if public_url else None
        self.served_versions: dict[str, int] = {}
        self._published: dict[str, tuple[float, int | None]] = {}
        self._starting = 0

    # -- auth --

    def is_admin(self, request: Request) -> bool:
        if self.admin_digest is None:
            return False
        return any(hmac.compare_digest(key_digest(key), self.admin_digest) for key in request_keys(request))

    def require_admin(self, request: Request) -> None:
        if not self.is_admin(request):
            raise GatewayError(401, "invalid admin key: send Authorization: Bearer <admin key>")

    def session_of(self, request: Request) -> SessionEntry:
        for key in request_keys(request):
            entry = self.registry.lookup(key)
            if entry is not None:
                return entry
        raise GatewayError(401, BAD_KEY)

    # -- admission --

    def check_capacity(self) -> None:
        if self.capacity is not None and self.registry.owned_count() + self._starting >= self.capacity:
            raise GatewayError(
                429,
                f"the gateway holds its capacity of {self.capacity} open sessions; end one or retry later",
                headers=self._retry_after(),
            )

    async def check_staleness(self, policy: str) -> None:
        served = self.served_versions.get(policy)
        if self.max_staleness is None or served is None:
            return
        published = await self.published_version(policy)
        if published is not None and published - served > self.max_staleness:
            raise GatewayError(
                429,
                f"policy {policy!r} is at version {published} and the inference consumers still answer with "
                f"version {served}: more than --max-staleness {self.max_staleness} behind; retry once they "
                "have loaded a newer version",
                headers=self._retry_after(),
            )

    def _retry_after(self) -> dict[str, str]:
        return {"Retry-After": str(max(1, round(self.retry_after)))}

    async def published_version(self, policy: str) -> int | None:
        """The newest PolicyVersionPublished of ``policy`` in the log (looked up at most once a second)."""
        checked_at, version = self._published.get(policy, (float("-inf"), None))
        if self.store is None or time.monotonic() - checked_at < STALENESS_CACHE_S:
            return version
        events = await self.store.read_stream(f"policy-{policy}")
        versions = [r.event.version for r in events if isinstance(r.event, PolicyVersionPublished)]
        version = max(versions, default=None)
        self._published[policy] = (time.monotonic(), version)
        return version

    # -- sessions --

    async def start_session(self, spec: SessionSpec) -> tuple[EpisodeSession, str]:
        if self.store is None or self.llm is None:
            raise GatewayError(404, "this gateway serves registered sessions only; it starts none")
        policy = spec.policy or self.policy_default
        if policy is None:
            raise GatewayError(400, "no policy: give 'policy' (this gateway has no default)", param="policy")
        self.check_capacity()
        self._starting += 1  # a slot held while the session starts, so concurrent starts cannot overfill
        try:
            await self.check_staleness(policy)
            session = EpisodeSession(
                self.store,
                self.llm,
                policy=policy,
                task=spec.task,
                task_id=spec.task_id,
                agent=spec.agent,
                episode_id=spec.episode_id,
                group_id=spec.group_id,
                group_size=spec.group_size,
                sampling=spec.sampling,
                tags=spec.tags,
                max_turns=spec.max_turns,
                runner_id=self.runner_id,
            )
            try:
                await session.start()
            except WrongExpectedVersion:
                raise GatewayError(
                    409, f"episode {session.episode_id} already exists", param="episode_id"
                ) from None
            except InvalidEvent as error:
                raise GatewayError(400, f"the session cannot be recorded: {error}") from None
            return session, self.registry.register(session, owned=True)
        finally:
            self._starting -= 1

    async def reward(self, entry: SessionEntry, spec: RewardSpec) -> dict[str, Any]:
        session = entry.session
        if session.finished:
            raise GatewayError(409, f"session {entry.session_id} has already ended")
        turn_id: str | None = spec.turn_id
        if turn_id == "last":
            if not session.turns:
                raise GatewayError(400, "turn_id 'last': the session has no turn yet", param="turn_id")
            turn_id = str(session.turns[-1].turn_id)
        try:
            await session.reward(spec.value, turn_id, source=spec.source)
        except InvalidLLMCall as error:
            raise GatewayError(400, str(error), param="turn_id" if turn_id else "value") from None
        return {"session_id": entry.session_id, "turn_id": turn_id, "value": spec.value}

    async def end(self, entry: SessionEntry, spec: EndSpec) -> dict[str, Any]:
        if not entry.owned:
            raise GatewayError(
                409, "this session belongs to a runner's episode: it ends when the agent's run() returns"
            )
        if await self.registry.close(entry.session_id) is None:
            raise GatewayError(409, f"session {entry.session_id} has already ended")
        session = entry.session
        termination: Termination = spec.termination or "done"
        if spec.termination is None and session.max_turns_hit:
            termination = "max_turns"
        elif spec.termination is None and session.turns and session.turns[-1].finish_reason == "length":
            termination = "truncated"
        await session.finish(termination, error=spec.error, metrics=spec.metrics)
        return describe(entry) | {"termination": termination, "open": False}

    async def reap_idle(self) -> list[str]:
        """End the gateway's sessions unused for ``idle_timeout`` seconds as ``timeout``."""
        if self.idle_timeout is None:
            return []
        cutoff = time.monotonic() - self.idle_timeout
        reaped = []
        for entry in self.registry.entries():
            if entry.owned and not entry.calls and entry.last_used < cutoff:
                error = f"no call for {self.idle_timeout:g} s (the gateway's --idle-timeout)"
                await self.end(entry, EndSpec(termination="timeout", error=error))
                reaped.append(entry.session_id)
        return reaped

    async def close_all(self, termination: Termination = "cancelled") -> None:
        """End every open session the gateway started (when it stops)."""
        for entry in self.registry.entries():
            if entry.owned:
                with contextlib.suppress(Exception):
                    await self.registry.close(entry.session_id, cancel=True)
                    await entry.session.finish(termination, error="the gateway stopped")

    # -- turns --

    async def chat(self, entry: SessionEntry, call: ChatCall) -> ChatResult:
        """``call.n`` turns of the session (siblings when ``n`` > 1), each recorded before it returns."""
        session = entry.session

        async def turns() -> list[ChatReply]:
            return list(
                await asyncio.gather(
                    *(session.chat(call.messages, call.tools, call.sampling) for _ in range(call.n))
                )
            )

        try:
            replies = await entry.run(turns())
        except MaxTurnsExceeded as error:
            raise GatewayError(400, str(error), code="max_turns_exceeded") from None
        except (InvalidLLMCall, RequestRejected) as error:
            raise GatewayError(400, str(error), param=getattr(error, "field", None)) from None
        except NoInferenceConsumer as error:
            raise GatewayError(503, str(error), headers={"Retry-After": "5"}) from None
        except InferenceTimeout as error:
            raise GatewayError(504, str(error)) from None
        except InferenceError as error:
            raise GatewayError(502, str(error)) from None
        except StoreUnavailable as error:
            raise GatewayError(503, str(error)) from None
        for reply in replies:
            known = self.served_versions.get(session.policy, -1)
            self.served_versions[session.policy] = max(known, reply.policy_version)
        return chat_result(session.episode_id, replies)


def describe(entry: SessionEntry) -> dict[str, Any]:
    session = entry.session
    episode = session.episode()
    return {
        "session_id": entry.session_id,
        "policy": session.policy,
        "turns": len(episode.turns),
        "last_turn_id": str(episode.turns[-1].turn_id) if episode.turns else None,
        "reward": episode.total_reward if episode.rewards else None,
        "open": True,
    }


def request_keys(request: Request) -> Iterator[str]:
    """The keys a request carries: ``Authorization: Bearer <key>`` and ``x-api-key: <key>``."""
    authorization = request.headers.get("authorization", "")
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        yield token.strip()
    if api_key := request.headers.get("x-api-key", "").strip():
        yield api_key


# ---- the HTTP app ------------------------------------------------------------------------------------


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

    app = FastAPI(title="Turnstile gateway", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.gateway = gateway

    @app.exception_handler(StarletteHTTPException)
    async def unknown_route(request: Request, error: StarletteHTTPException) -> Response:
        what = "Invalid URL" if error.status_code == 404 else str(error.detail)
        message = f"{what} ({request.method} {request.url.path})"
        return error_response(_api_of(request.url.path), GatewayError(error.status_code, message))

    # -- OpenAI --

    async def chat_completions(request: Request) -> Response:
        async def answer() -> Response:
            entry = gateway.session_of(request)
            call = parse_chat_request(await json_body(request), defaults=entry.session.started.sampling)
            result = await gateway.chat(entry, call)
            return openai_response(call, result, model=entry.session.policy)

        return await respond("openai", answer)

    async def models(request: Request) -> Response:
        async def answer() -> Response:
            return JSONResponse(
                {"object": "list", "data": [model_object(m) for m in _models_of(gateway, request)]}
            )

        return await respond("openai", answer)

    async def model(request: Request, name: str) -> Response:
        async def answer() -> Response:
            if name not in _models_of(gateway, request):
                raise GatewayError(
                    404, f"The model {name!r} does not exist", param="model", code="model_not_found"
                )
            return JSONResponse(model_object(name))

        return await respond("openai", answer)

    app.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"])
    app.add_api_route("/v1/models", models, methods=["GET"])
    app.add_api_route("/v1/models/{name}", model, methods=["GET"])

    # -- Anthropic --

    async def messages(request: Request) -> Response:
        async def answer() -> Response:
            entry = gateway.session_of(request)
            known = {
                call.id: call.function.arguments for turn in entry.session.turns for call in turn.tool_calls
            }
            call = parse_messages_request(
                await json_body(request), defaults=entry.session.started.sampling, known_arguments=known
            )
            result = await gateway.chat(entry, call)
            return anthropic_response(call, result, model=entry.session.policy)

        return await respond("anthropic", answer)

    # The Anthropic SDK appends /v1/messages to its base URL: both the root and .../v1 work.
    app.add_api_route("/v1/messages", messages, methods=["POST"])
    app.add_api_route("/v1/v1/messages", messages, methods=["POST"], include_in_schema=False)

    # -- the session's own key --

    async def own_session(request: Request) -> Response:
        return await respond("openai", lambda: _json(describe(gateway.session_of(request))))

    async def own_reward(request: Request) -> Response:
        async def answer() -> Response:
            entry = gateway.session_of(request)
            return _json(await gateway.reward(entry, parse_spec(RewardSpec, await json_body(request))))

        return await respond("openai", answer)

    async def own_end(request: Request) -> Response:
        async def answer() -> Response:
            entry = gateway.session_of(request)
            return _json(await gateway.end(entry, parse_spec(EndSpec, await json_body(request, empty={}))))

        return await respond("openai", answer)

    app.add_api_route("/v1/session", own_session, methods=["GET"])
    app.add_api_route("/v1/session/reward", own_reward, methods=["POST"])
    app.add_api_route("/v1/session/end", own_end, methods=["POST"])

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

        return await respond("openai", answer)

    def admin_entry(request: Request, session_id: str) -> SessionEntry:
        gateway.require_admin(request)
        entry = gateway.registry.get(session_id)
        if entry is None:
            raise GatewayError(404, f"no open session {session_id!r} (it never started here, or it ended)")
        return entry

    async def admin_session(request: Request, session_id: str) -> Response:
        return await respond("openai", lambda: _json(describe(admin_entry(request, session_id))))

    async def admin_reward(request: Request, session_id: str) -> Response:
        async def answer() -> Response:
            entry = admin_entry(request, session_id)
            return _json(await gateway.reward(entry, parse_spec(RewardSpec, await json_body(request))))

        return await respond("openai", answer)

    async def admin_end(request: Request, session_id: str) -> Response:
        async def answer() -> Response:
            entry = admin_entry(request, session_id)
            return _json(await gateway.end(entry, parse_spec(EndSpec, await json_body(request, empty={}))))

        return await respond("openai", answer)

    async def admin_sessions(request: Request) -> Response:
        async def answer() -> Response:
            gateway.require_admin(request)
            return JSONResponse({"data": [describe(entry) for entry in gateway.registry.entries()]})

        return await respond("openai", answer)

    app.add_api_route("/admin/sessions", create_session, methods=["POST"])
    app.add_api_route("/admin/sessions", admin_sessions, methods=["GET"])
    app.add_api_route("/admin/sessions/{session_id}", admin_session, methods=["GET"])
    app.add_api_route("/admin/sessions/{session_id}/reward", admin_reward, methods=["POST"])
    app.add_api_route("/admin/sessions/{session_id}/end", admin_end, methods=["POST"])

    async def health() -> Response:
        return JSONResponse({"status": "ok"})

    app.add_api_route("/health", health, methods=["GET"])
    return app


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


def model_object(name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "turnstile"}


def _api_of(path: str) -> Api:
    return "anthropic" if path.rstrip("/").endswith("/messages") else "openai"


def _json(body: Mapping[str, Any]) -> Response:
    return JSONResponse(dict(body))


async def respond(api: Api, answer: Callable[[], Awaitable[Response] | Response]) -> Response:
    """The answer, or the error it raised in ``api``'s error shape. Errors that are not Turnstile's are
    bugs: logged, and answered 500 (the gateway stays up)."""
    try:
        result = answer()
        return await result if not isinstance(result, Response) else result
    except GatewayError as error:
        return error_response(api, error)
    except OpenAIRequestError as error:
        return error_response(
            api, GatewayError(error.status, error.message, param=error.param, code=error.code)
        )
    except AnthropicRequestError as error:
        return error_response(api, GatewayError(error.status, error.message, param=error.param))
    except TurnstileError as error:
        return error_response(api, GatewayError(500, str(error)))
    except Exception:
        log.exception("the gateway failed to answer a request")
        return error_response(api, GatewayError(500, "internal error in the gateway (logged)"))


def error_response(api: Api, error: GatewayError) -> Response:
    body = error.anthropic_body() if api == "anthropic" else error.openai_body()
    return JSONResponse(body, status_code=error.status, headers=error.headers)


async def json_body(request: Request, *, empty: object = None) -> object:
    """The request's JSON body (``empty`` when there is none and that is allowed)."""
    raw = await request.body()
    if not raw.strip() and empty is not None:
        return empty
    try:
        return json.loads(raw)
    except ValueError as error:
        raise GatewayError(400, f"the request body is not valid JSON: {error}") from None


def parse_spec(model: type[_Spec], body: object) -> _Spec:
    try:
        return model.model_validate(body)
    except ValidationError as error:
        raise GatewayError(400, f"invalid request body: {describe_validation_error(error)}") from None


def openai_response(call: ChatCall, result: ChatResult, *, model: str) -> Response:
    completion_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    shape: dict[str, Any] = {
        "completion_id": completion_id,
        "created": created,
        "model": model,
        "choices": result.choices,
        "prompt_tokens": result.prompt_tokens,
        "logprobs": call.logprobs,
        "extra": result.extra,
    }
    if call.stream:
        chunks = completion_chunks(**shape, include_usage=call.include_usage)
        return Response(sse(chunks), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    return JSONResponse(completion_body(**shape))


def anthropic_response(call: ChatCall, result: ChatResult, *, model: str) -> Response:
    shape: dict[str, Any] = {
        "message_id": f"msg_{uuid.uuid4().hex}",
        "model": model,
        "choice": result.choices[0],
        "prompt_tokens": result.prompt_tokens,
        "stop_sequences": call.sampling.stop,
        "extra": result.extra,
    }
    if call.stream:
        return Response(
            anthropic_sse(message_events(**shape)),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )
    return JSONResponse(message_body(**shape))


# ---- serving -----------------------------------------------------------------------------------------


class _Server(uvicorn.Server):
    """uvicorn that leaves signals to its host (``handle_signals=False``): a gateway inside a runner must
    not take Ctrl-C away from it."""

    def __init__(self, config: uvicorn.Config, *, handle_signals: bool) -> None:
        super().__init__(config)
        self.handle_signals = handle_signals

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if self.handle_signals:
            with super().capture_signals():
                yield
        else:
            yield


class HttpServer:
    """An ASGI app on uvicorn in the running event loop: ``await start()`` (port 0: a free one), ``url``,
    ``await stop()``."""

    def __init__(
        self,
        app: Any,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        handle_signals: bool = False,
        lifespan: Literal["on", "off"] = "on",
    ) -> None:
        self.app, self.host, self.port = app, host, port
        self.handle_signals = handle_signals
        self.lifespan = lifespan
        self._server: _Server | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    async def start(self) -> str:
        family, kind, _, _, address = socket.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)[0]
        # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on such sockets; without it a small reply can
        # wait ~40 ms for a delayed ACK (Nagle).
        sock = socket.socket(family, kind, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as error:
            sock.close()
            raise TurnstileError(f"cannot listen on {self.host}:{self.port}: {error.strerror}") from None
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(
            self.app, log_level="warning", access_log=False, lifespan=self.lifespan, backlog=4096
        )
        self._server = _Server(config, handle_signals=self.handle_signals)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]), name=f"http-{self.port}")
        while not self._server.started:
            if self._task.done():
                self._task.result()
                raise TurnstileError(f"the HTTP server on {self.url} stopped while starting")
            await asyncio.sleep(0.01)
        return self.url

    @property
    def stopped(self) -> bool:
        return self._task is None or self._task.done()

    async def wait(self) -> None:
        """Until the server stops (``stop()``, or a signal when it handles them)."""
        if self._task is not None:
            await asyncio.shield(self._task)

    async def stop(self) -> None:
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            await self._task


@contextlib.asynccontextmanager
async def serving_http(app: Any, *, host: str = "127.0.0.1", port: int = 0) -> AsyncIterator[str]:
    """Serve ``app`` for the block; yields its root URL."""
    server = HttpServer(app, host=host, port=port)
    url = await server.start()
    try:
        yield url
    finally:
        await server.stop()
