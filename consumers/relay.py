"""Outbox relay service (``turnstile serve relay``): publishes the materializer's batches to JetStream
``BATCHES`` until Ctrl-C or SIGTERM. The work is ``pipeline.batches.relay.OutboxRelay``'s."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Callable
from dataclasses import dataclass

import nats
from nats.aio.client import Client as NatsConnection
from rich.console import Console

from pipeline.batches.relay import OutboxRelay
from pipeline.log.db import create_engine

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RelayConfig:
    database_url: str
    nats_url: str
    schema: str = "public"
    poll_interval: float = 1.0


def _on_interrupt(callback: Callable[[], object]) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, callback)


async def _connect_nats(url: str, stop: asyncio.Event) -> NatsConnection | None:
    """A connection that reconnects forever; the first connect is retried too (None: stopped first)."""
    delay = 0.5
    while not stop.is_set():
        try:
            return await nats.connect(url, max_reconnect_attempts=-1, reconnect_time_wait=0.5)
        except Exception as error:
            log.warning("relay: cannot reach NATS at %s (%s); retrying in %.1f s", url, error, delay)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), delay)
            delay = min(delay * 2, 5.0)
    return None


async def serve_relay(
    config: RelayConfig, *, stop: asyncio.Event | None = None, console: Console | None = None
) -> OutboxRelay | None:
    """Run the relay until stopped (Ctrl-C, SIGTERM or ``stop``); the relay, or None if stopped before
    NATS could be reached."""
    console = console or Console(stderr=True)
    stop = stop or asyncio.Event()
    _on_interrupt(stop.set)
    engine = create_engine(config.database_url, pool_size=2)
    try:
        connection = await _connect_nats(config.nats_url, stop)
        if connection is None:
            return None
        relay = OutboxRelay(engine, connection, schema=config.schema, poll_interval=config.poll_interval)
        console.print(f"relay publishing batches from {config.schema}.batch_outbox to JetStream BATCHES")
        try:
            await relay.run(stop)
        finally:
            with contextlib.suppress(Exception):
                await connection.drain()
        console.print(f"relay published {relay.published} batches")
        return relay
    finally:
        await engine.dispose()
