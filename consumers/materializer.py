"""Materializer service: folds the log into read models and training batches as events arrive
(``turnstile serve materializer``), or rebuilds an independent set from position 0
(``turnstile rematerialize``)."""

from __future__ import annotations

import asyncio
import logging
import time

from consumers.runtime import Runtime, running
from pipeline.materialize import Materializer, MaterializerConfig, MaterializerMetrics, drop_rebuild

log = logging.getLogger(__name__)


async def serve_materializer(
    database_url: str,
    config: MaterializerConfig,
    *,
    stop: asyncio.Event | None = None,
    metrics_port: int | None = None,
) -> Materializer:
    """Fold until SIGINT/SIGTERM (or ``stop``); each step commits its outputs and checkpoint together."""
    async with running(f"materializer {config.name}", stop=stop, metrics_port=metrics_port) as runtime:
        materializer = Materializer(database_url, config)
        await materializer.open()
        metrics = MaterializerMetrics(database_url)
        instrument(runtime, materializer, metrics)
        log.info("materializer %s starts after position %d", config.name, materializer.position)
        try:
            await materializer.run(runtime.stop)
        finally:
            await materializer.close()
            await metrics.close()
            if materializer.skipped:
                log.warning(
                    "materializer %s skipped %d events it could not fold: SELECT * FROM skipped_events",
                    config.name, materializer.skipped,
                )  # fmt: skip
    return materializer


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


def instrument(runtime: Runtime, materializer: Materializer, metrics: MaterializerMetrics) -> None:
    """Position, events quarantined, lag behind the log's head, open episodes and batches made."""

    async def lag() -> float:
        return await metrics.lag(materializer.position)

    runtime.gauge(
        "turnstile_materializer_position",
        "the log position folded (the checkpoint)",
        lambda: materializer.position,
    )
    runtime.counter(
        "turnstile_materializer_quarantined_total",
        "events that could not be folded and were skipped (SELECT * FROM skipped_events)",
        lambda: materializer.skipped,
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
