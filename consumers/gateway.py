"""Gateway service: the OpenAI- and Anthropic-compatible HTTP gateway (``turnstile serve gateway``).

Wiring only: the store, a NATS LLM client and a runner lease (each session's EpisodeStarted records the
lease's id, so if the gateway dies its open sessions are closed ``aborted`` by the next runner or gateway
that starts), the app from ``pipeline.gateway`` on uvicorn, and a clean stop on Ctrl-C / SIGTERM that ends
the open sessions as ``cancelled``. With ``--shared-sessions`` the sessions live in the log and the NATS KV
bucket GATEWAY_SESSIONS instead, for every replica to serve (``pipeline.gateway.replicas``): no lease is
recorded with them and a stop leaves them open.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI
from rich.console import Console

from consumers.runtime import (
    LATENCY_BUCKETS,
    METRICS_HOST,
    Connections,
    episode_services,
    policy_logs,
    running,
    serve_until_stopped,
)
from pipeline.errors import ConfigError
from pipeline.gateway import (
    MAX_BODY_BYTES,
    READ_TIMEOUT,
    HttpServer,
    RequestMetrics,
    SharedSessions,
    check_http_limits,
    create_gateway,
    gateway_of,
)
from pipeline.settings import jetstream
from pipeline.ui import KeyGuard, create_app


@dataclass(frozen=True)
class GatewayConfig:
    database_url: str
    nats_url: str
    admin_key: str
    policy_default: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    capacity: int | None = None
    max_staleness: int | None = None
    idle_timeout: float | None = 3600.0
    gone_after: float | None = 30.0
    public_url: str | None = None
    heartbeat_timeout: float = 15.0
    lease_timeout: float = 30.0
    shared_sessions: bool = False
    ui_reader_url: str | None = None  # set: the episode browser at /ui, behind the admin key
    metrics_port: int | None = None
    metrics_host: str = METRICS_HOST
    max_body_bytes: int = MAX_BODY_BYTES
    read_timeout: float = READ_TIMEOUT
    policy_database_urls: Mapping[str, str] = field(default_factory=dict)
    """Policies recorded in a database of their own (TURNSTILE_DATABASE_URLS); the others in database_url."""

    def __post_init__(self) -> None:
        if not self.admin_key:
            raise ConfigError("the gateway needs an admin key (it protects session creation)")
        if not 0 <= self.port < 65536:
            raise ConfigError(f"--port must be 0 to 65535, got {self.port}")
        if self.capacity is not None and self.capacity < 1:
            raise ConfigError(f"--max-open-sessions must be at least 1, got {self.capacity}")
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ConfigError(f"--max-staleness must be 0 or more, got {self.max_staleness}")
        if self.idle_timeout is not None and self.idle_timeout <= 0:
            raise ConfigError(f"--idle-timeout must be more than 0 seconds, got {self.idle_timeout:g}")
        if self.gone_after is not None and self.gone_after <= 0:
            raise ConfigError(f"--gone-after must be more than 0 seconds, got {self.gone_after:g}")
        check_http_limits(self.max_body_bytes, self.read_timeout)


def mount_browser(app: FastAPI, reader_url: str, admin_key: str) -> FastAPI:
    """The episode browser (read-only, as ``reader_url``) at ``/ui`` of the gateway, behind the admin key:
    the gateway's port is one that agents reach."""
    browser = create_app(reader_url)
    app.mount("/ui", KeyGuard(browser, admin_key))
    return browser


async def serve_gateway(
    config: GatewayConfig,
    *,
    stop: asyncio.Event | None = None,
    ready: Callable[[str], object] | None = None,
    console: Console | None = None,
) -> None:
    """Serve until Ctrl-C, SIGTERM or ``stop``; ``ready(url)`` once it listens."""
    console = console or Console(stderr=True)
    connections = Connections(
        config.database_url,
        config.nats_url,
        heartbeat_timeout=config.heartbeat_timeout,
        lease_timeout=config.lease_timeout,
    )
    async with (
        running(
            "gateway", stop=stop, metrics_port=config.metrics_port, metrics_host=config.metrics_host
        ) as runtime,
        episode_services(connections, runtime=runtime) as services,
        policy_logs(config.policy_database_urls, services, connections) as policy_stores,
    ):
        if services.recovered:
            console.print(
                f"closed {len(services.recovered)} episodes left open by stopped runners as aborted"
            )
        shared = await SharedSessions.open(jetstream(services.connection)) if config.shared_sessions else None
        app = create_gateway(
            services.store,
            services.llm,
            admin_key=config.admin_key,
            policy_default=config.policy_default,
            capacity=config.capacity,
            max_staleness=config.max_staleness,
            idle_timeout=config.idle_timeout,
            gone_after=config.gone_after,
            runner_id=services.lease.runner_id,
            public_url=config.public_url,
            shared=shared,
            policy_stores=policy_stores,
        )

        def metered(app: Any) -> RequestMetrics:
            return RequestMetrics(app, runtime.registry, buckets=LATENCY_BUCKETS)

        browser = None
        if config.ui_reader_url is not None:
            browser = mount_browser(app, config.ui_reader_url, config.admin_key)
        server = HttpServer(
            app,
            host=config.host,
            port=config.port,
            max_body_bytes=config.max_body_bytes,
            read_timeout=config.read_timeout,
            # counted only where they are served: a gateway without --metrics-port pays nothing for them
            outermost=None if config.metrics_port is None else metered,
        )
        url = await server.start()
        runtime.check("nats", lambda: services.connection.is_connected)
        gateway = gateway_of(app)
        runtime.gauge("turnstile_gateway_open_sessions", "sessions open now", lambda: len(gateway.registry))
        runtime.gauge(
            "turnstile_gateway_policy_version_served",
            "the policy version the inference consumers answered with last, by policy",
            lambda: {(policy,): float(v) for policy, v in gateway.served_versions.items()},
            ["policy"],
        )
        console.print(
            f"gateway [bold]{services.lease.runner_id}[/bold] on {url}: OpenAI and Anthropic clients use "
            f"base_url {config.public_url or url}/v1 with a session key from POST {url}/admin/sessions"
        )
        if ready is not None:
            ready(url)
        try:
            # the app's shutdown ends the open sessions as cancelled; raises if the server crashed
            await serve_until_stopped(server, runtime.stop)
        finally:
            if browser is not None:
                await browser.state.browser.close()
