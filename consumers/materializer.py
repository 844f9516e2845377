"""Materializer service: folds the log into read models and training batches as events arrive
(``turnstile serve materializer``), or rebuilds an independent set from position 0
(``turnstile rematerialize``)."""

from __future__ import annotations

import asyncio
import logging
import time

from consumers.runtime import running
from pipeline.materialize import Materializer, MaterializerConfig, drop_rebuild

log = logging.getLogger(__name__)


async def serve_materializer(
    database_url: str, config: MaterializerConfig, *, stop: asyncio.Event | None = None
) -> Materializer:
    """Fold until SIGINT/SIGTERM (or ``stop``); each step commits its outputs and checkpoint together."""
    async with running(f"materializer {config.name}", stop=stop) as runtime:
        materializer = Materializer(database_url, config)
        await materializer.open()
        log.info("materializer %s starts after position %d", config.name, materializer.position)
        try:
            await materializer.run(runtime.stop)
        finally:
            await materializer.close()
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
