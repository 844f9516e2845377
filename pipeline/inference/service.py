"""The inference service: what a consumer does with one request, independent of how it is wired to NATS.

It validates the request (an LLMError names the refused field; the service stays up), sends heartbeats
to the requester's inbox while the backend works, answers a request it has seen again (a client's retry:
the same request id and the same bytes) with the same reply instead of generating twice, refuses a request
id reused with other content (so nobody receives a reply meant for another request), parses hermes tool
calls, and refuses to send a reply larger than the server's max_payload.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any, Final

from pydantic import ValidationError

from pipeline.errors import StoreUnavailable, describe_validation_error, field_path
from pipeline.inference.backends import Backend, Generation
from pipeline.inference.chain import Chain, as_list
from pipeline.inference.chat import REASONING_MARKERS, split_reasoning, split_tool_calls
from pipeline.inference.client import CONSUMER_HEADER, HEARTBEAT_HEADER, RequestRejected
from pipeline.inference.held import DEFAULT_BUDGET_BYTES, HeldPrefixes, HeldTurn
from pipeline.inference.replies import RetryReplies
from pipeline.versions import VersionLog
from schemas import (
    IGNORE,
    TOLERANT,
    ChatMessage,
    LLMError,
    LLMRequest,
    LLMResponse,
    PolicyVersionPublished,
    Timings,
    TokenLogprob,
    ToolCall,
)

log = logging.getLogger(__name__)

Publish = Callable[[str, bytes, dict[str, str]], Awaitable[None]]
VERSION_REFUSALS: Final = (
    "not_in_log",
    "checkpoint_mismatch",
    "log_unreachable",
    "no_log",
    "other_policy",
    "unreadable",
)
"""Why a policy version message was not loaded (each counted from 0: a rate sees the first one)."""


def printable(text: str) -> str:
    """The text with NUL characters as U+FFFD. A model can emit the byte 0 (the token ids keep it exactly);
    PostgreSQL's jsonb cannot hold it, and the text is only a rendering of those tokens."""
    return text.replace("\x00", "\ufffd") if "\x00" in text else text


class InferenceService:
    def __init__(
        self,
        backend: Backend,
        *,
        policy: str,
        consumer_id: str,
        publish: Publish,
        max_payload: int = 8 * 1024 * 1024,
        heartbeat_interval: float = 5.0,
        reasoning_markers: tuple[str, str] | None = REASONING_MARKERS,
        held_bytes: int = DEFAULT_BUDGET_BYTES,
        retry_replies: RetryReplies | None = None,
        on_reply: Callable[[LLMResponse], None] | None = None,
        on_error: Callable[[str], None] | None = None,
        versions: VersionLog | None = None,
    ) -> None:
        self.backend = backend
        self.versions = versions
        """Where versions are checked before loading (None: none is loaded, each refused as ``no_log``)."""
        self.versions_refused: Counter[str] = Counter(dict.fromkeys(VERSION_REFUSALS, 0))
        self.held = HeldPrefixes(held_bytes)
        """Recent turns' tokens, messages and tools, by the key each reply names (``tokens_key``)."""
        self.on_reply = on_reply  # metrics: each reply sent (timings, tokens), each error by its code
        self.on_error = on_error
        self.reasoning_markers = reasoning_markers
        """Where the model's reasoning begins and ends in its text (None: it has none to split off)."""
        self.policy = policy
        self.consumer_id = consumer_id
        self.publish = publish
        self.max_payload = max_payload
        self.heartbeat_interval = heartbeat_interval
        self.requests_served = 0
        # by request id: (digest of the request's bytes, the future of its reply / the reply it got)
        self._in_flight: dict[uuid.UUID, tuple[bytes, asyncio.Future[bytes]]] = {}
        self.retry_replies = RetryReplies() if retry_replies is None else retry_replies
        """The newest replies, for answering a request sent again (by count and by bytes)."""
        self._reload = asyncio.Lock()

    @property
    def in_flight(self) -> int:
        """Requests being generated now (a request sent again while it runs is counted once)."""
        return len(self._in_flight)

    async def handle(self, data: bytes, reply_to: str | None) -> bytes:
        """The reply body (an LLMResponse or LLMError as JSON) for one request message."""
        received = time.monotonic()
        try:
            request = LLMRequest.model_validate_json(data, context=TOLERANT, extra=IGNORE)
        except ValidationError as error:
            return self._error(None, "invalid_request", describe_validation_error(error), _first_field(error))
        if request.policy != self.policy:
            message = f"this consumer serves policy {self.policy!r}, not {request.policy!r}"
            return self._error(request.request_id, "invalid_request", message, "policy")
        digest = hashlib.blake2b(data, digest_size=16).digest()
        recent, running = self.retry_replies.get(request.request_id), self._in_flight.get(request.request_id)
        known = recent[0] if recent is not None else running[0] if running is not None else None
        if known is not None and known != digest:
            message = (
                f"request_id {request.request_id} was already used for a request with other content; "
                "give every request an id of its own (a retry resends the same request unchanged)"
            )
            return self._error(request.request_id, "invalid_request", message, "request_id")
        if recent is not None:
            return recent[1]
        heartbeat = _Heartbeats(self, reply_to) if reply_to else None
        try:
            if running is not None:  # sent again while it runs: the same reply, generated once
                return await asyncio.shield(running[1])
            return await self._answer_once(request, received, digest)
        finally:
            if heartbeat is not None:
                await heartbeat.stop()

    async def _answer_once(self, request: LLMRequest, received: float, digest: bytes) -> bytes:
        """Answer in the caller's task, with a future for the same request sent again meanwhile.

        No task of its own: a task per request (made, shielded, awaited) was a measurable part of the
        consumer's CPU per turn on a fast backend. If this request's task is cancelled (the consumer stops)
        the generation stops with it, and a copy waiting on it is cancelled too: its requester sends again.
        """
        answered: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self._in_flight[request.request_id] = (digest, answered)
        try:
            body = await self._answer(request, received, digest)
        except BaseException:
            answered.cancel()
            raise
        finally:
            del self._in_flight[request.request_id]
        answered.set_result(body)
        return body

    async def on_version(self, data: bytes) -> None:
        """A message on ``policy.<policy>.versions``: load the version it names if the log holds it.

        The message alone is never enough (anyone who can make one appear there would choose the weights):
        the version must be in the log with the same checkpoint, where only the trainer's role can write one
        (``VersionLog``). Never backwards: a version at or below the one served is left alone. A message
        that fails the check is refused, logged and counted (``versions_refused``, by reason).
        """
        try:
            published = PolicyVersionPublished.model_validate_json(data, context=TOLERANT, extra=IGNORE)
        except ValidationError as error:
            self._refuse(
                "unreadable", "an unreadable policy version message: %s", describe_validation_error(error)
            )
            return
        if published.policy != self.policy:
            self._refuse(
                "other_policy", "a version of policy %r on policy %r's subject", published.policy, self.policy
            )
            return
        async with self._reload:
            if published.version <= self.backend.policy_version:
                return  # heard again (the stream at start, a reconnect) or older: nothing to do
            if self.versions is None:
                self._refuse(
                    "no_log", "version %d: this consumer has no database login to check versions against the "
                    "log (set TURNSTILE_DATABASE_URL to the inference login)", published.version,
                )  # fmt: skip
                return
            try:
                recorded = await self.versions.checkpoint(self.policy, published.version)
            except StoreUnavailable as error:
                self._refuse("log_unreachable", "version %d not loaded: %s", published.version, error)
                return
            if recorded is None:
                self._refuse(
                    "not_in_log", "version %d (checkpoint %s) is not in the log: forged or misrouted",
                    published.version, published.checkpoint,
                )  # fmt: skip
                return
            if recorded != published.checkpoint:
                self._refuse(
                    "checkpoint_mismatch", "version %d names checkpoint %s, the log records %s",
                    published.version, published.checkpoint, recorded,
                )  # fmt: skip
                return
            await self._load(published.version, recorded)

    async def catch_up(self) -> None:
        """Load the newest version the log holds, if newer than the one served (at start, after a reconnect:
        versions published meanwhile were not heard)."""
        if self.versions is None:
            return
        try:
            newest = await self.versions.newest(self.policy)
        except StoreUnavailable as error:
            log.warning("could not read the newest policy version from the log: %s", error)
            return
        if newest is None:
            return
        async with self._reload:
            if newest[0] > self.backend.policy_version:
                await self._load(*newest)

    async def _load(self, version: int, checkpoint: str) -> None:
        try:
            await self.backend.load_version(version, checkpoint)
        except Exception:
            log.exception(
                "could not load policy version %d from %s; keeping version %d",
                version,
                checkpoint,
                self.backend.policy_version,
            )

    def _refuse(self, reason: str, message: str, *args: object) -> None:
        self.versions_refused[reason] += 1
        log.warning("refused a policy version message: " + message + "; keeping version %d", *args,
                    self.backend.policy_version)  # fmt: skip

    async def _answer(self, request: LLMRequest, received: float, digest: bytes) -> bytes:
        held: HeldTurn | None = None
        if request.prefix is not None and request.prefix.held:
            prefix = request.prefix
            held = self.held.take(prefix.key or "", prefix.token_count or 0, prefix.message_count)
            if held is None:
                message = (
                    f"this consumer does not hold prefix {prefix.key!r} ({prefix.token_count} tokens, "
                    f"{prefix.message_count} messages): send the request again with prefix.token_ids, the "
                    "whole conversation and the tools"
                )
                return self._error(request.request_id, "prefix_unknown", message, "prefix.key")
            # The backend reads the held ids as the chain they are kept in (a Sequence: no copy of them here).
            request = request.model_copy(
                update={
                    "messages": [*held.messages.tolist(), *request.messages],
                    "tools": held.tools,
                    "prefix": prefix.model_copy(update={"token_ids": held.token_ids}),
                }
            )
        try:
            generation = await self.backend.generate(request)
        except RequestRejected as error:
            return self._error(request.request_id, "invalid_request", error.reason, error.field)
        except Exception as error:
            log.exception("backend failed on request %s", request.request_id)
            return self._error(request.request_id, "engine_error", f"{type(error).__name__}: {error}")
        response = self._response(request, generation, received, held)
        body = response.model_dump_json(exclude_none=True).encode()
        if len(body) > self.max_payload:
            message = (
                f"the reply is {len(body):,} bytes, over the NATS server's max_payload of "
                f"{self.max_payload:,}; lower max_tokens or raise max_payload"
            )
            return self._error(request.request_id, "payload_too_large", message, "sampling.max_tokens")
        self.requests_served += 1
        if self.on_reply is not None:
            self.on_reply(response)
        self.retry_replies.keep(request.request_id, digest, body)
        return body

    def _response(
        self, request: LLMRequest, generation: Generation, received: float, held: HeldTurn | None = None
    ) -> LLMResponse:
        reasoning, text = generation.reasoning, printable(generation.text)
        if self.reasoning_markers is not None and generation.tool_calls is None:
            reasoning, text = split_reasoning(text, self.reasoning_markers)
        if request.tool_choice is not None and request.tool_choice.mode == "none":
            content, tool_calls = text, list[ToolCall]()  # the blocks stay text
        elif generation.tool_calls is None:
            content, tool_calls = split_tool_calls(text)
        else:
            content, tool_calls = generation.text, generation.tool_calls
        finish_reason = (
            "tool_calls" if tool_calls and generation.finish_reason == "stop" else generation.finish_reason
        )
        # The reply leaves out the prompt's prefix (the requester sent it or named it): no echo of history.
        prompt, known = generation.prompt_token_ids, 0
        prefix_ids = request.prefix.ids if request.prefix is not None else None
        if (
            prefix_ids
            and not generation.prefix_break
            and (generation.extends_prefix or prompt[: len(prefix_ids)] == prefix_ids)
        ):
            known = len(prefix_ids)
        added = as_list(prompt[known:] if known else prompt)  # the new ids: a slice, or the prompt itself
        reply = ChatMessage(
            role="assistant", content=content, tool_calls=tool_calls or None, reasoning_content=reasoning
        )
        # Kept as what this turn adds to the prefix's chain (the held one's, shared): O(new ids), not a copy
        # of the whole turn.
        completion = generation.completion_token_ids
        if prefix_ids is not None and known:
            kept = Chain.of(prefix_ids).then([*added, *completion])
        else:
            kept = Chain.of(prompt).then(completion)
        if held is None:
            messages = Chain.of(request.messages).then([reply])
        else:
            messages = held.messages.then([*request.messages[len(held.messages) :], reply])
        key = self.held.keep(kept, messages, request.tools)
        now = time.monotonic()
        return LLMResponse(
            request_id=request.request_id,
            text=content,
            tool_calls=tool_calls,
            finish_reason=finish_reason,
            reasoning=reasoning,
            prompt_token_ids=added,
            prompt_prefix_tokens=known,
            completion_token_ids=generation.completion_token_ids,
            completion_logprobs=generation.completion_logprobs,
            policy_version=generation.policy_version,
            consumer_id=self.consumer_id,
            tokens_key=key,
            timings=Timings(  # to the microsecond: what the clocks can tell apart
                queued_ms=round(max(0.0, generation.started_at - received) * 1000, 3),
                first_token_ms=round(max(0.0, generation.first_token_at - received) * 1000, 3),
                total_ms=round((now - received) * 1000, 3),
                restarted_ms=round(generation.restarted_seconds * 1000, 3),
            ),
            prefix_break=generation.prefix_break,
            render_drift=generation.render_drift,
            chat_template=generation.chat_template,
            **self._token_detail(request, generation),
        )

    def _token_detail(self, request: LLMRequest, generation: Generation) -> dict[str, Any]:
        """Each completion token's text, bytes and top alternatives, when the request asked for them."""
        if request.top_logprobs is None:
            return {}
        detail = functools.lru_cache(maxsize=None)(self._token)
        chosen = [
            detail(token_id, logprob)
            for token_id, logprob in zip(
                generation.completion_token_ids, generation.completion_logprobs, strict=True
            )
        ]
        top = generation.top_logprobs or [[] for _ in chosen]
        return {
            "token_logprobs": chosen,
            "top_logprobs": [[detail(t, lp) for t, lp in position] for position in top],
        }

    def _token(self, token_id: int, logprob: float) -> TokenLogprob:
        spell = getattr(self.backend, "token_bytes", None)
        raw = spell(token_id) if spell is not None else f"<{token_id}>".encode()
        return TokenLogprob(
            token_id=token_id,
            text=raw.decode("utf-8", errors="replace"),
            bytes=list(raw),
            logprob=max(logprob, -9999.0),  # OpenAI's stand-in for a token the model rules out
        )

    async def _heartbeat(self, reply_to: str) -> None:
        """A heartbeat now, then one every ``heartbeat_interval`` seconds until cancelled."""
        headers = {HEARTBEAT_HEADER: "1", CONSUMER_HEADER: self.consumer_id}
        while True:
            try:
                await self.publish(reply_to, b"", headers)
            except Exception:
                log.warning("heartbeat to %s failed", reply_to, exc_info=True)
            await asyncio.sleep(self.heartbeat_interval)

    def _error(
        self, request_id: uuid.UUID | None, code: str, message: str, field: str | None = None
    ) -> bytes:
        if self.on_error is not None:
            self.on_error(code)
        error = LLMError.model_validate(
            {
                "request_id": request_id,
                "code": code,
                "message": message,
                "field": field,
                "consumer_id": self.consumer_id,
            }
        )
        return error.model_dump_json().encode()


def _first_field(error: ValidationError) -> str | None:
    return next((path for item in error.errors() if (path := field_path(item["loc"]))), None)


class _Heartbeats:
    """Heartbeats to a requester while its request runs: a timer first, and a task only once the first
    heartbeat is due. Most replies come long before that, and a task per request (made, cancelled and
    awaited) was a measurable part of the consumer's CPU per turn on a fast backend."""

    __slots__ = ("_reply_to", "_service", "_task", "_timer")

    def __init__(self, service: InferenceService, reply_to: str) -> None:
        self._service, self._reply_to = service, reply_to
        self._task: asyncio.Task[None] | None = None
        self._timer = asyncio.get_running_loop().call_later(service.heartbeat_interval, self._due)

    def _due(self) -> None:
        self._task = asyncio.create_task(self._service._heartbeat(self._reply_to))

    async def stop(self) -> None:
        self._timer.cancel()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
