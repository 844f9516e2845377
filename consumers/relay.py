"""Outbox relay service (``turnstile serve relay``): publishes the materializer's batches to JetStream
``BATCHES`` until Ctrl-C or SIGTERM. The work is ``pipeline.batches.OutboxRelay``'s."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

from rich.console import Console

from consumers.runtime import METRICS_HOST, connect_nats, running, watch_database
from pipeline.batches import OutboxRelay
from pipeline.log import create_engine


@dataclass(frozen=True)
class RelayConfig:
    database_url: str
    nats_url: str
    schema: str = "public"
    poll_interval: float = 1.0
    outbox_retention: float = 86_400.0
    metrics_port: int | None = None
    metrics_host: str = METRICS_HOST


async def serve_relay(
    config: RelayConfig, *, stop: asyncio.Event | None = None, console: Console | None = None
) -> OutboxRelay | None:
    """Run the relay until stopped (Ctrl-C, SIGTERM or ``stop``); the relay, or None if stopped before
    NATS could be reached (``ConfigError`` if it cannot be reached within ``runtime.CONNECT_FOR``)."""
    console = console or Console(stderr=True)
    async with running(
        "relay", stop=stop, metrics_port=config.metrics_port, metrics_host=config.metrics_host
    ) as runtime:
        engine = create_engine(config.database_url, pool_size=2)
        try:
            connection = await connect_nats(config.nats_url, stop=runtime.stop, runtime=runtime)
            if connection is None:
                return None
            watch_database(runtime, config.database_url)
            runtime.check("nats", lambda: connection.is_connected)
            relay = OutboxRelay(
                engine,
                connection,
                schema=config.schema,
                poll_interval=config.poll_interval,
                retention=config.outbox_retention,
            )
            runtime.counter(
                "turnstile_relay_published_total", "batches published to BATCHES", lambda: relay.published
            )

            async def depth() -> float:
                return float(await relay.outbox_depth())

            runtime.poll(
                "turnstile_relay_outbox_depth", "batches committed and not yet published", 5.0, depth
            )
            console.print(f"relay publishing batches from {config.schema}.batch_outbox to JetStream BATCHES")
            try:
                await relay.run(runtime.stop)
            finally:
                with contextlib.suppress(Exception):
                    await connection.drain()
            console.print(f"relay published {relay.published} batches")
            return relay
        finally:
            await engine.dispose()
