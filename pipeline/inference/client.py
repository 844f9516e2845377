"""LLM clients: ``await llm(request) -> LLMResponse``.

Two implementations of one protocol:

- ``NatsLLMClient`` publishes the request on ``llm.<policy>.requests`` (queue group ``inference``) and waits
  on an inbox of its own. Inference consumers send heartbeats while they work, so a consumer that dies
  mid-request is noticed in ``heartbeat_timeout`` seconds, not at the end of the (long) overall timeout;
  the request is then sent again with the same request id. Once a consumer has served an episode, later
  turns of that episode go to that consumer's own subject (its prefix cache holds the conversation) and
  fall back to the queue group when it is gone.
- ``QueueLLMClient`` (the ARES pattern): the request and a future go on an asyncio queue; whoever drives
  the episode takes requests as observations and supplies the replies.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

import nats
from nats.aio.client import Client as NatsConnection
from nats.aio.msg import Msg
from pydantic import TypeAdapter, ValidationError

from pipeline.errors import TurnstileError, describe_validation_error
from pipeline.settings import nats_inbox_prefix, nats_servers
from schemas import LLMError, LLMRequest, LLMResponse, parse_wire

HEARTBEAT_HEADER: Final = "Turnstile-Heartbeat"
CONSUMER_HEADER: Final = "Turnstile-Consumer"
QUEUE_GROUP: Final = "inference"
_NO_RESPONDERS: Final = "503"
_REQUEST_JSON: Final = TypeAdapter(LLMRequest)
"""Serializes a request straight to the bytes NATS sends (``model_dump_json`` makes a str to encode)."""


def request_subject(policy: str, consumer_id: str | None = None) -> str:
    """``llm.<policy>.requests``, or the sticky ``llm.<policy>.requests.<consumer_id>``."""
    subject = f"llm.{policy}.requests"
    return f"{subject}.{consumer_id}" if consumer_id else subject


class LLMClient(Protocol):
    async def __call__(self, request: LLMRequest) -> LLMResponse: ...


class InferenceError(TurnstileError):
    """An LLM call failed."""


class NoInferenceConsumer(InferenceError):
    def __init__(self, policy: str, waited: float) -> None:
        self.policy = policy
        super().__init__(
            f"no inference consumer for policy {policy!r}: nothing listened on {request_subject(policy)} "
            f"for {waited:.0f} s; start one with `turnstile serve inference --policy {policy}`"
        )


class InferenceTimeout(InferenceError):
    def __init__(self, seconds: float, why: str = "") -> None:
        self.seconds = seconds
        super().__init__(f"LLM request timed out after {seconds:.0f} s{why}")


class RequestRejected(InferenceError):
    """The request itself is wrong; sending it again will not help."""

    def __init__(self, field: str | None, message: str) -> None:
        self.field = field
        self.reason = message  # what is wrong, without the prefix (what a consumer sends back)
        super().__init__(f"LLM request rejected because {field or 'request'}: {message}")


class PrefixUnknown(InferenceError):
    """The consumer does not hold the prefix the request named (``prefix.key``): send the request again
    with the prefix's tokens and the whole conversation."""


def raise_for_error(error: LLMError) -> None:
    if error.code in ("invalid_request", "payload_too_large"):
        raise RequestRejected(error.field, error.message)
    if error.code == "prefix_unknown":
        raise PrefixUnknown(error.message)
    raise InferenceError(
        f"inference consumer {error.consumer_id or '?'} failed: {error.code}: {error.message}"
    )


@dataclass(slots=True)
class _Reply:
    message: Msg


@dataclass(slots=True)
class _Silent:
    """No heartbeat and no reply within heartbeat_timeout: the consumer is presumed gone."""


@dataclass(slots=True)
class _NoResponders:
    pass


class _Inbox:
    """The messages for one request, in order of arrival: heartbeats, then the reply (or a status).

    A deque, a future to wake the waiter and a timer to give up on it, rather than an ``asyncio.Queue``
    awaited through ``asyncio.wait_for``: that made a task and a queue per request, and ``wait_for`` a
    second future and callbacks per message, a fair share of the client's CPU."""

    __slots__ = ("messages", "waiter")

    def __init__(self) -> None:
        self.messages: deque[Msg] = deque()
        self.waiter: asyncio.Future[None] | None = None

    def put(self, message: Msg) -> None:
        self.messages.append(message)
        _wake(self.waiter)

    async def get(self, within: float) -> Msg:
        """The next message; ``TimeoutError`` if none comes ``within`` seconds."""
        if not self.messages:
            loop = asyncio.get_running_loop()
            self.waiter = loop.create_future()
            timer = loop.call_later(within, _wake, self.waiter)
            try:
                await self.waiter
            finally:
                timer.cancel()
                self.waiter = None
            if not self.messages:
                raise TimeoutError
        return self.messages.popleft()


def _wake(waiter: asyncio.Future[None] | None) -> None:
    if waiter is not None and not waiter.done():
        waiter.set_result(None)


class NatsLLMClient:
    """LLM calls over NATS request/reply. ``await NatsLLMClient.connect(url)``; ``await client.close()``."""

    def __init__(
        self,
        connection: NatsConnection,
        *,
        timeout: float = 600.0,
        heartbeat_timeout: float = 15.0,
        retries: int = 3,
        backoff: float = 0.25,
        wait_for_consumer: float = 10.0,
        affinity_size: int = 100_000,
        owns_connection: bool = False,
    ) -> None:
        self.connection = connection
        self.timeout = timeout
        self.heartbeat_timeout = heartbeat_timeout
        self.retries = retries
        self.backoff = backoff
        self.wait_for_consumer = wait_for_consumer
        self._affinity: OrderedDict[str, str] = OrderedDict()
        self._affinity_size = affinity_size
        self._owns_connection = owns_connection
        self._inbox_prefix = connection.new_inbox()  # under the connection's prefix: the role's own inboxes
        self._waiting: dict[str, _Inbox] = {}
        self._tokens = itertools.count()  # unique within the inbox prefix, which is unique to this client
        self._subscription: Any = None
        self.heartbeats = 0  # heartbeats received from consumers at work
        self.silent_consumers = 0  # requests given up on a consumer that sent nothing for heartbeat_timeout

    @classmethod
    async def connect(cls, url: str, **options: Any) -> NatsLLMClient:
        connection = await nats.connect(
            nats_servers(url),
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.5,
            inbox_prefix=nats_inbox_prefix(url),
        )
        return cls(connection, owns_connection=True, **options)

    async def close(self) -> None:
        """Unsubscribe (and drain a connection we opened); while the server is away, just close."""
        subscription, self._subscription = self._subscription, None
        try:
            if subscription is not None:
                await subscription.unsubscribe()
            if self._owns_connection:
                await self.connection.drain()
        except (nats.errors.ConnectionReconnectingError, nats.errors.ConnectionClosedError):
            await self.connection.close()

    def consumer_for(self, episode_id: str) -> str | None:
        """The consumer this episode is sticky to, if any."""
        return self._affinity.get(episode_id)

    async def __call__(self, request: LLMRequest) -> LLMResponse:
        payload = _REQUEST_JSON.dump_json(request, exclude_none=True)  # every None is a default
        if len(payload) > self.connection.max_payload:
            raise RequestRejected(
                "request",
                f"it is {len(payload):,} bytes, over the NATS server's max_payload of "
                f"{self.connection.max_payload:,}; raise max_payload in the server config or shorten it",
            )
        if self._subscription is None:
            self._subscription = await self.connection.subscribe(f"{self._inbox_prefix}.*", cb=self._route)
        started = time.monotonic()
        deadline = started + self.timeout
        silent_attempts = 0
        no_responders_since: float | None = None
        while True:
            sticky = self._affinity.get(request.episode_id) if request.episode_id else None
            outcome = await self._exchange(request_subject(request.policy, sticky), payload, deadline)
            if isinstance(outcome, _Reply):
                return self._accept(request, outcome.message)
            if sticky is not None:  # that consumer is gone: any consumer will do
                self._forget(request.episode_id)
                continue
            if isinstance(outcome, _NoResponders):
                no_responders_since = no_responders_since or time.monotonic()
                if time.monotonic() - no_responders_since > self.wait_for_consumer:
                    raise NoInferenceConsumer(request.policy, self.wait_for_consumer)
                await asyncio.sleep(min(self.backoff, max(0.0, deadline - time.monotonic())))
                continue
            if time.monotonic() >= deadline:
                raise InferenceTimeout(self.timeout)
            silent_attempts += 1
            self.silent_consumers += 1
            if silent_attempts > self.retries:
                raise InferenceTimeout(
                    time.monotonic() - started,
                    f": {silent_attempts} consumers went silent (none sent a heartbeat for "
                    f"{self.heartbeat_timeout:.0f} s)",
                )
            await asyncio.sleep(self.backoff * 2 ** (silent_attempts - 1))

    async def _exchange(
        self, subject: str, payload: bytes, deadline: float
    ) -> _Reply | _Silent | _NoResponders:
        token = str(next(self._tokens))
        inbox = _Inbox()
        self._waiting[token] = inbox
        try:
            await self.connection.publish(subject, payload, reply=f"{self._inbox_prefix}.{token}")
            while True:
                wait = min(self.heartbeat_timeout, deadline - time.monotonic())
                if wait <= 0:
                    return _Silent()
                try:
                    message = await inbox.get(wait)
                except TimeoutError:
                    return _Silent()
                headers = message.headers or {}
                if headers.get("Status") == _NO_RESPONDERS:
                    return _NoResponders()
                if HEARTBEAT_HEADER not in headers:
                    return _Reply(message)
                self.heartbeats += 1
        finally:
            del self._waiting[token]

    async def _route(self, message: Msg) -> None:
        inbox = self._waiting.get(message.subject.rpartition(".")[2])
        if inbox is not None:
            inbox.put(message)

    def _accept(self, request: LLMRequest, message: Msg) -> LLMResponse:
        try:
            reply = parse_wire(message.data)
        except ValidationError as error:
            problem = describe_validation_error(error)
            raise InferenceError(f"unreadable reply from an inference consumer: {problem}") from None
        if isinstance(reply, LLMError):
            raise_for_error(reply)
        if not isinstance(reply, LLMResponse) or reply.request_id != request.request_id:
            raise InferenceError(
                f"inference consumer answered request {request.request_id} with {reply!r:.200}"
            )
        if request.episode_id:
            self._affinity[request.episode_id] = reply.consumer_id
            self._affinity.move_to_end(request.episode_id)
            if len(self._affinity) > self._affinity_size:
                self._affinity.popitem(last=False)
        return reply

    def _forget(self, episode_id: str | None) -> None:
        if episode_id is not None:
            self._affinity.pop(episode_id, None)


@dataclass(slots=True)
class PendingCall:
    """One LLM call waiting for whoever drives a ``QueueLLMClient``."""

    request: LLMRequest
    future: asyncio.Future[LLMResponse] = field(repr=False)

    def reply(self, response: LLMResponse) -> None:
        if not self.future.done():
            self.future.set_result(response)

    def fail(self, error: BaseException) -> None:
        if not self.future.done():
            self.future.set_exception(error)


class QueueLLMClient:
    """``await llm(request)`` parks the call on ``calls``; a driver answers it (see ``PendingCall``)."""

    def __init__(self) -> None:
        self.calls: asyncio.Queue[PendingCall] = asyncio.Queue()

    async def __call__(self, request: LLMRequest) -> LLMResponse:
        call = PendingCall(request, asyncio.get_running_loop().create_future())
        await self.calls.put(call)
        return await call.future

    async def next_call(self) -> PendingCall:
        return await self.calls.get()
