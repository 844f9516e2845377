"""Bounded requests for the HTTP servers (the gateway and the episode browser): a body larger than
``max_body_bytes`` is refused with 413 while it is read (never read whole first), a body that stops arriving
for ``read_timeout`` seconds is refused with 408, and a client that opens a connection and sends its request
line and headers too slowly (slowloris) is disconnected after ``read_timeout``.

Why here and not in FastAPI: the gateway calls its routes straight from ``GatewayApp.__call__`` and each
route reads its own body, so the bound sits under every route as plain ASGI (``BoundedRequests``), and the
header timer sits in uvicorn's HTTP protocol (``HeaderTimeoutProtocol``), which is the only place that sees
a request before its headers are complete (uvicorn has a keep-alive timer but none for a first request).

The default body limit, 32 MiB, holds a 200,000-token conversation with room to spare: such a conversation
is about 0.8 MB of text, and a client that sends back the engine's token ids with every message (the
gateway's token-exact continuation) adds up to ~12 bytes per token in JSON, about 2.4 MB; images or very
long tool outputs are what the rest is for. A deployment that needs more raises it
(``--max-body-mib``); every byte over it would otherwise be held in the gateway's memory.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, Final

from pipeline.errors import ConfigError

MAX_BODY_BYTES: Final = 32 * 1024 * 1024
READ_TIMEOUT: Final = 30.0
"""Seconds a client may take to send its headers, and between two parts of its body."""

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


DRAIN_FACTOR: Final = 8
"""After a 413, up to this many times the limit of the rest of the body is read and dropped (memory stays
flat), so that a client still sending reads its answer instead of a reset connection (as nginx's lingering
close does); past that the connection is closed."""


def _refusal(status: int, kind: str, message: str, *, close: bool) -> tuple[list[tuple[bytes, bytes]], bytes]:
    """A JSON error both SDK families read (OpenAI's ``error.message``, Anthropic's ``type: error`` with
    ``error.type``); ``close``: the rest of the body is not read, the connection ends with the answer."""
    body = json.dumps(
        {"type": "error", "error": {"type": kind, "code": kind, "message": message, "param": None}}
    ).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if close:
        headers.append((b"connection", b"close"))
    return headers, body


class BodyAbandoned(Exception):
    """Raised to uvicorn after a refusal whose body went on past what is drained: it closes the connection."""


class BoundedRequests:
    """ASGI middleware: the request body at most ``max_body_bytes``, each part of it within ``read_timeout``
    seconds of the one before (None: no limit)."""

    def __init__(
        self, app: ASGIApp, *, max_body_bytes: int = MAX_BODY_BYTES, read_timeout: float | None = READ_TIMEOUT
    ) -> None:
        if max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be at least 1, got {max_body_bytes}")
        self.app, self.max_body_bytes, self.read_timeout = app, max_body_bytes, read_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.max_body_bytes
        declared = _content_length(scope)
        if declared is not None and declared > limit:
            drains = declared <= DRAIN_FACTOR * limit
            await self._refuse(send, 413, "request_too_large", self._too_large(declared), close=not drains)
            if drains:
                await self._drain(receive, 0)
            return
        # The body is read here, bounded, before the app runs: an app that reads its own body (every gateway
        # route does) would answer a cut-off body as its own error; here the refusal is the server's.
        parts: list[bytes] = []
        received = 0
        while True:
            try:
                async with asyncio.timeout(self.read_timeout):  # no task per read, unlike wait_for
                    message = await receive()
            except TimeoutError:
                stalled = (
                    f"the request body stopped arriving for {self.read_timeout:g} s; send it whole, or "
                    "raise the server's --read-timeout"
                )
                await self._refuse(send, 408, "request_timeout", stalled, close=True)
                return
            if message["type"] != "http.request":
                return  # the client went away before its body ended: nobody to answer
            chunk = message.get("body", b"")
            received += len(chunk)
            if received > limit:
                await self._refuse(send, 413, "request_too_large", self._too_large(received), close=False)
                await self._drain(receive, received)
                return
            parts.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(parts) if len(parts) != 1 else parts[0]
        delivered = False

        async def replay() -> Message:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # past the body: a disconnect, whenever it comes

        await self.app(scope, replay, send)

    async def _drain(self, receive: Receive, received: int) -> None:
        """Read and drop the rest of a refused body, up to ``DRAIN_FACTOR`` times the limit in all (each part
        within the read timeout); past that, or on a stall, ``BodyAbandoned`` ends the connection."""
        cap = DRAIN_FACTOR * self.max_body_bytes
        while True:
            try:
                async with asyncio.timeout(self.read_timeout):
                    message = await receive()
            except TimeoutError:
                raise BodyAbandoned("the refused body stalled") from None
            if message["type"] != "http.request":
                return  # the client went away
            received += len(message.get("body", b""))
            if not message.get("more_body", False):
                return
            if received > cap:
                raise BodyAbandoned(f"the refused body went on past {cap:,} bytes")

    def _too_large(self, size: int) -> str:
        return (
            f"the request body is over {self.max_body_bytes:,} bytes (at least {size:,} sent); shorten the "
            "conversation, or raise the server's --max-body-mib"
        )

    @staticmethod
    async def _refuse(send: Send, status: int, kind: str, message: str, *, close: bool) -> None:
        headers, body = _refusal(status, kind, message, close=close)
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def check_http_limits(max_body_bytes: int, read_timeout: float) -> None:
    """``ConfigError`` naming the option when a limit cannot work."""
    if max_body_bytes < 1024:
        raise ConfigError(f"--max-body-mib must allow at least 1 KiB, got {max_body_bytes:,} bytes")
    if not read_timeout > 0:
        raise ConfigError(f"--read-timeout must be more than 0 seconds, got {read_timeout:g}")


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def header_timeout_protocol(read_timeout: float) -> type[Any] | None:
    """uvicorn's httptools protocol with a timer from the connection's start (and each later request's
    first byte) to its headers' end: past ``read_timeout`` the connection is closed. None where httptools
    is not installed (uvicorn then picks its own protocol, without the timer)."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:
        return None

    class HeaderTimeoutProtocol(HttpToolsProtocol):
        _header_timer: asyncio.TimerHandle | None = None

        def _arm(self) -> None:
            self._disarm()
            self._header_timer = self.loop.call_later(read_timeout, self._too_slow)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _too_slow(self) -> None:
            self._header_timer = None
            if self.transport is not None and not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._arm()

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    return HeaderTimeoutProtocol
