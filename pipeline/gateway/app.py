"""The gateway app: ``create_gateway`` assembles the routers of ``routes`` on a FastAPI app whose own routes
are called straight from ``__call__`` (``GatewayApp``: FastAPI's routing cost as much CPU as the endpoints).
What the gateway does, and why, is in docs/gateway.md and in ``service`` and ``sessions``."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match
from starlette.types import Receive, Scope, Send

from pipeline.dialects import (
    dialect_for_path,
)
from pipeline.gateway.http import error_response
from pipeline.gateway.http_error import GatewayError
from pipeline.gateway.routes import admin_router, chat_router, health_router, models_router, session_router
from pipeline.gateway.service import GONE_AFTER, Gateway
from pipeline.gateway.sessions import SessionRegistry
from pipeline.gateway.shared import SharedSessions
from pipeline.inference import LLMClient
from pipeline.log import Store

log = logging.getLogger(__name__)


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
    gone_after: float | None = GONE_AFTER,
    runner_id: str | None = None,
    public_url: str | None = None,
    shared: SharedSessions | None = None,
    policy_stores: Mapping[str, Store] | None = None,
) -> FastAPI:
    """The gateway app; its ``Gateway`` is ``app.state.gateway`` (also ``gateway_of(app)``).

    With no ``store``/``llm`` and no ``admin_key`` it serves only sessions registered in ``registry``
    (how ``pipeline.runners.proxy`` runs one inside a runner). With ``shared``, its sessions are served by
    any replica that shares the bucket (``pipeline.gateway.replicas``). ``policy_stores``: the logs of the
    policies that have one of their own (docs/scale.md); every other policy is recorded in ``store``.
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
        gone_after=gone_after,
        runner_id=runner_id,
        public_url=public_url,
        shared=shared,
        policy_stores=policy_stores,
    )

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        reaping = gateway.idle_timeout or gateway.gone_after
        reaper = asyncio.create_task(_reap_forever(gateway)) if reaping else None
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

    routers = [
        chat_router(gateway),
        models_router(gateway),
        session_router(gateway),
        admin_router(gateway),
        health_router(),
    ]
    for router in routers:
        app.include_router(router)
    # from the routers themselves: FastAPI keeps an included router as one entry of app.routes
    app.serve_directly(
        [route for router in routers for route in router.routes if isinstance(route, APIRoute)]
    )
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
    static_routes: Mapping[tuple[str, str], APIRoute] = {}
    """Of those, the ones whose path has no parameter, by (path, method): a chat call finds its route in
    one look-up instead of matching each route's pattern in turn."""

    def serve_directly(self, routes: Sequence[APIRoute]) -> None:
        """Serve ``routes`` from ``__call__`` (``direct_routes``), the static ones by look-up. A static path
        is looked up only where no route before it could match that path too, so the order still decides."""
        self.direct_routes = routes
        static: dict[tuple[str, str], APIRoute] = {}
        for index, route in enumerate(routes):
            if route.param_convertors:
                continue
            if any(earlier.path_regex.match(route.path) for earlier in routes[:index]):
                continue
            for method in route.methods or ():
                static.setdefault((route.path, method), route)
        self.static_routes = static

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not scope.get("root_path"):
            route = self.static_routes.get((scope["path"], scope["method"]))
            if route is not None:
                scope.update(app=self, endpoint=route.endpoint, route=route, path_params={})
                await self._serve(route, {}, scope, receive, send)
                return
            for route in self.direct_routes:
                match, child_scope = route.matches(scope)
                if match is Match.FULL:
                    scope.update(child_scope, app=self)
                    await self._serve(route, child_scope["path_params"], scope, receive, send)
                    return
        await super().__call__(scope, receive, send)

    @staticmethod
    async def _serve(
        route: APIRoute, path_params: Mapping[str, Any], scope: Scope, receive: Receive, send: Send
    ) -> None:
        endpoint: Callable[..., Awaitable[Response]] = route.endpoint
        response = await endpoint(Request(scope, receive), **path_params)
        await response(scope, receive, send)


def gateway_of(app: FastAPI) -> Gateway:
    gateway: Gateway = app.state.gateway
    return gateway


async def _reap_forever(gateway: Gateway) -> None:
    """End idle sessions (``reap_idle``) and those whose client is gone (``reap_gone``), checking at a
    quarter of the shorter of the two times (5 s at most)."""
    times = [t for t in (gateway.idle_timeout, gateway.gone_after) if t]
    while True:
        await asyncio.sleep(min(max(min(times) / 4, 0.05), 5.0))
        try:
            await gateway.reap_idle()
            await gateway.reap_gone()
        except Exception:
            log.exception("ending idle sessions failed; trying again")
