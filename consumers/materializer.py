"""Materializer service: folds the log into read models and training batches as events arrive
(``turnstile serve materializer``), or rebuilds an independent set from position 0
(``turnstile rematerialize``)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from consumers.runtime import METRICS_HOST, Runtime, running, serve_through_outages
from pipeline.materialize import Materializer, MaterializerConfig, MaterializerMetrics, drop_rebuild

log = logging.getLogger(__name__)


async def serve_materializer(
    database_url: str,
    config: MaterializerConfig,
    *,
    stop: asyncio.Event | None = None,
    metrics_port: int | None = None,
    metrics_host: str = METRICS_HOST,
) -> Materializer:
    """Fold until SIGINT/SIGTERM (or ``stop``); each step commits its outputs and checkpoint together, so
    when PostgreSQL restarts (or its disk fills) the service waits for it and goes on from the checkpoint
    with a materializer opened anew (``serve_through_outages``): nothing is lost or folded twice."""
    async with running(
        f"materializer {config.name}", stop=stop, metrics_port=metrics_port, metrics_host=metrics_host
    ) as runtime:
        current = [Materializer(database_url, config)]
        metrics = MaterializerMetrics(database_url)
        instrument(runtime, lambda: current[0], metrics)

        async def fold(connected: Callable[[], None]) -> None:
            materializer = current[0] = Materializer(database_url, config)
            try:
                await materializer.open()
                connected()
                log.info("materializer %s starts after position %d", config.name, materializer.position)
                await materializer.run(runtime.stop)
            finally:
                await close_quietly(materializer)

        try:
            await serve_through_outages(runtime, fold)
        finally:
            await metrics.close()
            if current[0].skipped:
                log.warning(
                    "materializer %s skipped %d events it could not fold: SELECT * FROM skipped_events",
                    config.name, current[0].skipped,
                )  # fmt: skip
    return current[0]


async def close_quietly(materializer: Materializer) -> None:
    """Close its connections; after an outage they are broken, and closing one may fail too."""
    try:
        await materializer.close()
    except Exception as error:
        log.debug("closing the materializer's connections: %s", error)


async def rematerialize(
    database_url: str, config: MaterializerConfig, *, replace: bool = False
) -> Materializer:
    """Build schema ``rm_<name>`` from position 0 up to the log's head now; the live one is untouched."""
    if replace:
        await drop_rebuild(database_url, config.name)
    materializer = Materializer(database_url, config)
    started = time.monotonic()
    await materializer.open(create=True)
    try:
        folded = await materializer.catch_up()
    finally:
        await materializer.close()
    log.info(
        "rebuilt %s: %d events in %.1f s, %d skipped", config.name, folded, time.monotonic() - started,
        materializer.skipped,
    )  # fmt: skip
    return materializer


def instrument(
    runtime: Runtime, materializer: Callable[[], Materializer], metrics: MaterializerMetrics
) -> None:
    """Position, events quarantined, lag behind the log's head, open episodes and batches made, of the
    materializer open now (``materializer()``: a new one after each database outage)."""

    async def lag() -> float:
        return await metrics.lag(materializer().position)

    runtime.gauge(
        "turnstile_materializer_position",
        "the log position folded (the checkpoint)",
        lambda: materializer().position,
    )
    runtime.counter(
        "turnstile_materializer_quarantined_total",
        "events that could not be folded and were skipped (SELECT * FROM skipped_events)",
        lambda: materializer().skipped,
    )
    runtime.poll(
        "turnstile_materializer_lag_events", "events in the log not folded yet (head - checkpoint)", 5.0, lag
    )
    runtime.poll(
        "turnstile_materializer_open_episodes",
        "episodes started and not finished",
        5.0,
        metrics.open_episodes,
    )
    runtime.poll(
        "turnstile_materializer_batches",
        "batches made so far",
        5.0,
        metrics.batches,
    )
