"""The gateway's HTTP metrics: every request counted by route, method and status, timed, and every error
answer counted by kind, in Prometheus form (``RequestMetrics``, ASGI middleware around the whole server).

Why middleware of our own rather than prometheus-fastapi-instrumentator or starlette-exporter: the gateway
calls its routes past FastAPI's middleware stack (``GatewayApp``), and the body-size refusals (413, 408)
come from ``BoundedRequests`` before any route runs; only a wrapper around the server's outermost app sees
both. It labels by the route's template (``/admin/sessions/{session_id}``), never the raw path, so the
number of series stays fixed whatever clients send.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Final

from prometheus_client import CollectorRegistry, Counter, Histogram
from starlette.routing import Mount
from starlette.types import ASGIApp, Message, Receive, Scope, Send

NO_ROUTE: Final = "none"
"""The route label of a request that reached no route: an unknown path, or a body refused before routing."""
METHODS: Final = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
"""Methods named in the ``method`` label; any other is ``other`` (a client may send any token as a method,
and each would be a series of its own)."""
ERROR_BODY_BYTES: Final = 4096
"""Bytes of an error answer read for its kind: error bodies are a line of JSON."""


class RequestMetrics:
    """ASGI middleware that counts and times each HTTP request of ``app`` into ``registry``:

    - ``turnstile_gateway_requests_total{route, method, status}``
    - ``turnstile_gateway_request_seconds{route, method}``: from the request's arrival to its answer's last
      byte handed to the server (a streamed reply: its whole stream)
    - ``turnstile_gateway_errors_total{route, kind}``: answers of status 400 or more, by the kind their
      body names: OpenAI's ``error.code`` where it has one (``invalid_api_key``, ``rate_limit_exceeded``,
      ``not_found`` ...: more precise than its ``error.type``, which is ``invalid_request_error`` for most),
      else ``error.type`` (Anthropic's ``authentication_error``, ``request_too_large`` ...), else
      ``http_<status>``. Codes and types are the gateway's own words, a fixed set.
    """

    def __init__(self, app: ASGIApp, registry: CollectorRegistry, *, buckets: Sequence[float]) -> None:
        self.app = app
        self.requests = Counter(
            "turnstile_gateway_requests",
            "HTTP requests answered, by route (its template), method and status",
            ["route", "method", "status"],
            registry=registry,
        )
        self.seconds = Histogram(
            "turnstile_gateway_request_seconds",
            "seconds from a request's arrival to the end of its answer, by route and method",
            ["route", "method"],
            registry=registry,
            buckets=buckets,
        )
        self.errors = Counter(
            "turnstile_gateway_errors",
            "answers with status 400 or more, by route and kind (the body's error code or type, else "
            "http_<status>)",
            ["route", "kind"],
            registry=registry,
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        answer = _Answer(send)
        try:
            await self.app(scope, receive, answer.send)
        finally:
            route = route_label(scope)
            method = scope["method"] if scope["method"] in METHODS else "other"
            self.seconds.labels(route, method).observe(time.perf_counter() - started)
            if answer.status is not None:  # none: the client left before any answer began
                self.requests.labels(route, method, str(answer.status)).inc()
                if answer.status >= 400:
                    self.errors.labels(route, answer.error_kind()).inc()


class _Answer:
    """Passes the answer on, keeping its status and the start of an error body."""

    def __init__(self, send: Send) -> None:
        self._send = send
        self.status: int | None = None
        self.body = bytearray()

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.status = int(message["status"])
        elif message["type"] == "http.response.body" and self.status is not None and self.status >= 400:
            self.body += message.get("body", b"")[: ERROR_BODY_BYTES - len(self.body)]
        await self._send(message)

    def error_kind(self) -> str:
        try:
            error = json.loads(self.body)["error"]
            kind = error.get("code") or error.get("type")
        except (ValueError, KeyError, TypeError, AttributeError):
            kind = None
        return kind if isinstance(kind, str) and kind else f"http_{self.status}"


def route_label(scope: Scope) -> str:
    """The template of the route that answered (``/v1/chat/completions``, ``/admin/sessions/{session_id}``,
    ``/ui/episodes/{episode_id}`` in the mounted episode browser), a mounted app's prefix when it answered
    before its routes (``/ui``: the admin key's refusal), or ``NO_ROUTE``."""
    route = scope.get("route")
    path = getattr(route, "path", None)
    root = scope.get("root_path", "")
    if isinstance(route, Mount):
        return route.path or NO_ROUTE
    if isinstance(path, str):
        return f"{root}{path}"
    return root or NO_ROUTE
