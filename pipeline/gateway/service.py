"""What the gateway does for a request, apart from HTTP: authentication, admission, the sessions it starts
and ends, and the turns it records.

Admission (``POST /admin/sessions`` answers 429 with ``Retry-After``):

- ``capacity``: at most this many sessions started by the gateway are open at once.
- ``max_staleness``: the newest ``PolicyVersionPublished`` of the session's policy in the log, minus the
  newest policy version the inference consumers have answered this gateway's calls with, is at most
  this. Until a consumer has answered a call for the policy there is nothing to compare and sessions are
  admitted.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Mapping
from typing import Any, Final

from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request

from pipeline.dialects import ChatCall, ChatResult
from pipeline.episodes import (
    ChatReply,
    EpisodeSession,
    InvalidLLMCall,
    MaxTurnsExceeded,
    chat_result,
    wanted_detail,
)
from pipeline.errors import (
    EpisodeExists,
    InvalidEvent,
    StoreUnavailable,
    TurnstileError,
    WrongExpectedVersion,
)
from pipeline.gateway.http_error import GatewayError
from pipeline.gateway.replicas import Replicas
from pipeline.gateway.sessions import Answer, Listener, RetryKeys, SessionEntry, SessionRegistry, key_digest
from pipeline.gateway.shared import SharedSessions
from pipeline.inference import (
    InferenceError,
    InferenceTimeout,
    LLMClient,
    NoInferenceConsumer,
    RequestRejected,
)
from pipeline.log import Store
from schemas import ChatMessage, PolicyVersionPublished, RewardAssigned, SamplingParams, Termination

BAD_KEY: Final = (
    "invalid API key: it names no open session of this gateway (a session's key stops working when it ends)"
)
AFTER_END: Final = (
    "a session takes calls and rewards only while it is open (its samples are made when it ends): post the "
    "reward first, then end it"
)
STALENESS_CACHE_S: Final = 1.0
GONE_AFTER: Final = 30.0
"""Seconds without a call or a request in flight, after a reply found its client gone, before a session the
gateway started ends ``aborted`` (``--gone-after``): a killed CLI's episode ends soon, not at the idle
timeout; a client that retries or goes on within this time keeps it."""


# ---- request bodies of the session endpoints ---------------------------------------------------------


class SessionSpec(BaseModel):
    """``POST /admin/sessions``: the episode to start."""

    model_config = ConfigDict(extra="forbid")
    task: dict[str, Any] = Field(default_factory=dict)
    task_id: str = ""
    # a token of NATS subjects (llm.<policy>.requests): no spaces, dots or wildcards
    policy: str | None = Field(default=None, min_length=1, max_length=200, pattern=r"^[A-Za-z0-9_-]+$")
    group_id: str | None = None
    group_size: int = Field(default=1, ge=1, lt=2**31)
    agent: str = "gateway"
    sampling: SamplingParams | None = None
    tags: dict[str, str] = Field(default_factory=dict)
    max_turns: int | None = Field(default=None, ge=1)
    episode_id: str | None = Field(default=None, min_length=1, max_length=200)
    untrained_models: list[str] = Field(
        default_factory=list,
        max_length=100,
        description="fnmatch patterns (case-sensitive) of request model names whose calls are recorded as "
        "not for training, e.g. ['claude-haiku-*'] for Claude Code's small-model side calls; the "
        "x-turnstile-train header of a call overrides it",
    )


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
        gone_after: float | None = GONE_AFTER,
        runner_id: str | None = None,
        public_url: str | None = None,
        shared: SharedSessions | None = None,
        policy_stores: Mapping[str, Store] | None = None,
    ) -> None:
        self.store = store
        self.policy_stores = dict(policy_stores or {})
        """The logs of policies recorded apart from the others (docs/scale.md), by policy."""
        self.llm = llm
        self.registry = registry if registry is not None else SessionRegistry()
        self.admin_digest = key_digest(admin_key) if admin_key else None
        self.policy_default = policy_default
        self.capacity = capacity
        self.max_staleness = max_staleness
        self.retry_after = retry_after
        self.idle_timeout = idle_timeout
        self.gone_after = gone_after
        self.runner_id = runner_id
        self.public_url = public_url.rstrip("/") if public_url else None
        self.served_versions: dict[str, int] = {}
        self._published: dict[str, tuple[float, int | None]] = {}
        self._starting = 0
        self.replicas: Replicas | None = None
        """Set: sessions are shared with other gateway replicas (``pipeline.gateway.replicas``)."""
        if shared is not None:
            if store is None or llm is None:
                raise TurnstileError("a gateway that shares its sessions needs a store and an LLM client")
            timeouts = (idle_timeout, gone_after)
            self.replicas = Replicas(
                shared, store, llm, self.registry, timeouts=timeouts, policy_stores=self.policy_stores
            )

    # -- auth --

    def is_admin(self, request: Request) -> bool:
        if self.admin_digest is None:
            return False
        return any(hmac.compare_digest(key_digest(key), self.admin_digest) for key in request_keys(request))

    def require_admin(self, request: Request) -> None:
        if not self.is_admin(request):
            raise GatewayError(401, "invalid admin key: send Authorization: Bearer <admin key>")

    async def session_of(self, request: Request) -> SessionEntry:
        """The open session the request's key names (shared by replicas: caught up with the log first, or
        taken up from the log when another replica started it)."""
        keys = list(request_keys(request))
        for key in keys:
            entry = self.registry.lookup(key)
            if entry is not None:
                if self.replicas is not None:
                    await self.replicas.current(entry)
                return entry
        for key in keys:
            ended = self.registry.ended_by_key(key)
            if ended is not None:
                raise ended.conflict(AFTER_END)
        if self.replicas is not None:
            for key in keys:
                entry = await self.replicas.adopt(key_digest(key).hex())
                if entry is not None:
                    return entry
        raise GatewayError(401, BAD_KEY)

    async def session_by_id(self, session_id: str) -> SessionEntry:
        """The open session ``session_id`` (the admin's routes), as ``session_of``."""
        entry = self.registry.get(session_id)
        if entry is not None:
            if self.replicas is not None:
                await self.replicas.current(entry)
            return entry
        ended = self.registry.ended(session_id)
        if ended is not None:
            raise ended.conflict(AFTER_END)
        if self.replicas is not None and (entry := await self.replicas.adopt_by_id(session_id)) is not None:
            return entry
        message = f"no session {session_id!r} was started here (GET /admin/sessions lists the open ones)"
        raise GatewayError(404, message)

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

    def store_for(self, policy: str) -> Store | None:
        """The log ``policy`` is recorded in: its own, or the one of every other policy."""
        return self.policy_stores.get(policy, self.store)

    async def published_version(self, policy: str) -> int | None:
        """The newest PolicyVersionPublished of ``policy`` in its log (looked up at most once a second)."""
        checked_at, version = self._published.get(policy, (float("-inf"), None))
        store = self.store_for(policy)
        if store is None or time.monotonic() - checked_at < STALENESS_CACHE_S:
            return version
        events = await store.read_stream(f"policy-{policy}")
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
        store = self.store_for(policy)
        assert store is not None  # self.store is not None, checked above
        self.check_capacity()
        self._starting += 1  # a slot held while the session starts, so concurrent starts cannot overfill
        try:
            await self.check_staleness(policy)
            session = EpisodeSession(
                store,
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
                # shared by replicas: no replica's lease, so that one that dies leaves them to the others
                runner_id=self.runner_id if self.replicas is None else None,
            )
            try:
                await session.start()
            except EpisodeExists as error:
                raise GatewayError(409, str(error), param="episode_id") from None
            except InvalidEvent as error:
                raise GatewayError(400, f"the session cannot be recorded: {error}") from None
            api_key = self.registry.register(session, owned=True)
            entry = self.registry.get(session.episode_id)
            assert entry is not None
            entry.untrained_models = tuple(spec.untrained_models)
            if self.replicas is not None:
                await self.replicas.share(entry)
            return session, api_key
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
        except WrongExpectedVersion:
            if self.replicas is None:
                raise
            raise await self.replicas.lost_race(entry, "the reward was not recorded") from None
        return {"session_id": entry.session_id, "turn_id": turn_id, "value": spec.value}

    async def end(self, entry: SessionEntry, spec: EndSpec) -> dict[str, Any]:
        if not entry.owned:
            raise GatewayError(
                409, "this session belongs to a runner's episode: it ends when the agent's run() returns"
            )
        if await self.registry.close(entry.session_id) is None:
            ended = self.registry.ended(entry.session_id)
            if ended is not None:
                raise ended.conflict(AFTER_END)
            raise GatewayError(409, f"session {entry.session_id} has already ended")
        session = entry.session
        termination: Termination = spec.termination or "done"
        if spec.termination is None and session.max_turns_hit:
            termination = "max_turns"
        elif spec.termination is None and session.turns and session.turns[-1].finish_reason == "length":
            termination = "truncated"
        self.registry.mark_ended(entry.session_id, termination)
        try:
            await session.finish(termination, error=spec.error, metrics=spec.metrics)
        except WrongExpectedVersion:
            if self.replicas is None:
                raise
            self.registry.add(entry)  # still open: another replica recorded something first
            raise await self.replicas.lost_race(entry, "the session was not ended") from None
        if self.replicas is not None:
            await self.replicas.ended(entry, termination)
        return describe(entry) | {"termination": termination, "open": False}

    async def reap_idle(self) -> list[str]:
        """End the gateway's sessions unused for ``idle_timeout`` seconds as ``timeout`` (shared by replicas:
        every replica's sessions, see ``Replicas.idle_sessions``)."""
        if self.idle_timeout is None:
            return []
        if self.replicas is not None:
            reaped = []
            for entry in await self.replicas.idle_sessions(self.idle_timeout):
                error = f"no call for {self.idle_timeout:g} s (the gateways' --idle-timeout)"
                with contextlib.suppress(GatewayError):  # ended or used meanwhile, on another replica
                    await self.end(entry, EndSpec(termination="timeout", error=error))
                    reaped.append(entry.session_id)
            return reaped
        cutoff = time.monotonic() - self.idle_timeout
        reaped = []
        for entry in self.registry.entries():
            if entry.owned and not entry.calls and entry.last_used < cutoff:
                error = f"no call for {self.idle_timeout:g} s (the gateway's --idle-timeout)"
                await self.end(entry, EndSpec(termination="timeout", error=error))
                reaped.append(entry.session_id)
        return reaped

    async def reap_gone(self) -> list[str]:
        """End as ``aborted`` the gateway's sessions whose client is gone: a reply found no live connection,
        and since then no call came and none is in flight for ``gone_after`` seconds."""
        if self.gone_after is None:
            return []
        cutoff = time.monotonic() - self.gone_after
        reaped = []
        for entry in self.registry.entries():
            gone = entry.disconnected_at
            if entry.owned and not entry.calls and gone is not None and max(gone, entry.last_used) < cutoff:
                if self.replicas is not None and await self.replicas.called_elsewhere(entry, cutoff):
                    entry.disconnected_at = None  # the client went on on another replica
                    continue
                error = (
                    f"the client went away (a reply found its connection closed) and made no call for "
                    f"{self.gone_after:g} s (the gateway's --gone-after)"
                )
                await self.end(entry, EndSpec(termination="aborted", error=error))
                reaped.append(entry.session_id)
        return reaped

    def delivered(self, entry: SessionEntry, result: ChatResult, *, handed: bool) -> None:
        """A reply's fate once the response was sent or refused: ``handed`` to a live connection marks its
        turns delivered (recorded with the session's next event); not handed, the client is gone."""
        if not handed:
            entry.disconnected_at = time.monotonic()
            return
        entry.disconnected_at = None
        turn_ids = ((result.extra or {}).get("turnstile") or {}).get("turn_ids") or []
        entry.session.mark_delivered([uuid.UUID(turn_id) for turn_id in turn_ids])
        if self.replicas is not None:
            entry.start(self.replicas.record_delivered(entry))
        for answer in entry.answers.values():
            done = answer.task.done() and not answer.task.cancelled() and answer.task.exception() is None
            if done and answer.task.result() is result:
                answer.delivered = True

    async def close_all(self, termination: Termination = "cancelled") -> None:
        """End every open session the gateway started (when it stops); sessions shared by replicas stay
        open, for the others to serve."""
        if self.replicas is not None:
            return
        for entry in self.registry.entries():
            if entry.owned:
                with contextlib.suppress(Exception):
                    await self.registry.close(entry.session_id, cancel=True)
                    self.registry.mark_ended(entry.session_id, termination)
                    await entry.session.finish(termination, error="the gateway stopped")

    # -- turns --

    async def answer(
        self, entry: SessionEntry, call: ChatCall, keys: RetryKeys, listener: Listener
    ) -> ChatResult:
        """The call's result: the recorded one when the call retries an earlier call of the session
        (``SessionEntry.prior``: joined while it runs, else answered from its recorded turn, never generated
        and recorded again), else ``chat``. Its turns are recorded as not delivered until ``delivered`` says
        the reply was handed to a live client (the call's, or a retry's)."""
        prior = entry.prior(keys)
        if prior is None and self.replicas is not None and keys.retry_count != 0:
            recorded = self.replicas.recorded_answer(entry, call)
            if recorded is not None:
                return recorded
        if prior is not None:
            prior.listeners.append(listener)
            try:
                result: ChatResult = await prior.result()
                return result
            finally:
                prior.listeners.remove(listener)
        answer = Answer(entry.start(self.chat(entry, call, confirm_delivery=True)), [listener])
        entry.disconnected_at = None  # a client is there: a new call

        def forget_failed(task: asyncio.Task[Any]) -> None:
            if task.cancelled() or task.exception() is not None:
                entry.forget(answer)

        answer.task.add_done_callback(forget_failed)
        entry.remember(keys, answer)
        try:
            result = await answer.result()
            return result
        finally:
            answer.listeners.remove(listener)

    async def chat(
        self,
        entry: SessionEntry,
        call: ChatCall,
        listening: Callable[[], Awaitable[bool]] | None = None,
        *,
        confirm_delivery: bool = False,
    ) -> ChatResult:
        """``call.n`` turns of the session (siblings when ``n`` > 1), each recorded before it returns;
        ``call.previous_turn`` (a recorded turn of the session) is the conversation the call continues.
        Run as one of the session's calls (``SessionEntry.start``), as ``answer`` does. ``confirm_delivery``:
        the turns stay undelivered until ``delivered`` (``EpisodeSession.chat``)."""
        session = entry.session
        if call.previous_turn is not None:
            call = continued(call, session.conversation_of(call.previous_turn))

        def turn() -> Coroutine[Any, Any, ChatReply]:
            detail = wanted_detail(call)
            return session.chat(
                call.messages,
                call.tools,
                call.sampling,
                call.tool_choice,
                detail,
                listening,
                call.train,
                model=call.model or None,
                confirm_delivery=confirm_delivery,
            )

        try:
            if call.n == 1:
                replies = [await turn()]  # no gather: a task less per call
            else:
                replies = list(await asyncio.gather(*(turn() for _ in range(call.n))))
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
        except WrongExpectedVersion:
            if self.replicas is None:
                raise
            raise await self.replicas.lost_race(entry, "this call was not recorded") from None
        for reply in replies:
            known = self.served_versions.get(session.policy, -1)
            self.served_versions[session.policy] = max(known, reply.policy_version)
            entry.tool_arguments.update((call.id, call.function.arguments) for call in reply.tool_calls)
        return chat_result(session.episode_id, replies, whole_prompt=call.whole_prompt_ids)


def continued(call: ChatCall, history: list[ChatMessage] | None) -> ChatCall:
    """``call`` with the conversation it continues before its messages. Its ``instructions`` (a leading
    system message of the call) equal to the conversation's leading system message are that message; other
    instructions come after the conversation, where they were given (system messages keep their place: the
    conversation goes on from its tokens instead of starting again with a new beginning)."""
    if history is None:
        raise GatewayError(
            400,
            f"Previous response with id 'resp_{call.previous_turn.hex if call.previous_turn else ''}' not "
            "found: it names no turn of this session",
            param="previous_response_id",
            code="previous_response_not_found",
        )
    messages = call.messages
    leading = messages and messages[0].role == "system" and history and history[0].role == "system"
    if leading and (messages[0].content or "") == (history[0].content or ""):
        messages = messages[1:]
    return dataclasses.replace(call, messages=[*history, *messages], previous_turn=None)


def describe(entry: SessionEntry) -> dict[str, Any]:
    """The session's state, from what it holds (no fold of its events: that rebuilds every turn's prompt)."""
    session = entry.session
    rewards = [event.value for event in session.events if isinstance(event, RewardAssigned)]
    return {
        "session_id": entry.session_id,
        "policy": session.policy,
        "turns": len(session.turns),
        # what the harness's summary counts; a turn's whole prompt is its parent's ids plus the ones it adds
        "prompt_tokens": sum(turn.prefix_tokens + len(turn.added_prompt_ids) for turn in session.turns),
        "completion_tokens": sum(len(turn.completion_token_ids) for turn in session.turns),
        "last_turn_id": str(session.turns[-1].turn_id) if session.turns else None,
        "reward": sum(rewards) if rewards else None,
        "open": True,
        "calls_in_flight": len(entry.calls),
    }


def request_keys(request: Request) -> Iterator[str]:
    """The keys a request carries: ``Authorization: Bearer <key>`` and ``x-api-key: <key>``."""
    authorization = request.headers.get("authorization", "")
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        yield token.strip()
    if api_key := request.headers.get("x-api-key", "").strip():
        yield api_key
