"""Materializer service: folds the log into read models and training batches as events arrive
(``turnstile serve materializer``), or rebuilds an independent set from position 0
(``turnstile rematerialize``)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time

from pipeline.materialize.materializer import Materializer, MaterializerConfig

log = logging.getLogger(__name__)


async def serve_materializer(
    database_url: str, config: MaterializerConfig, *, stop: asyncio.Event | None = None
) -> Materializer:
    """Fold until SIGINT/SIGTERM (or ``stop``); each step commits its outputs and checkpoint together."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    materializer = Materializer(database_url, config)
    await materializer.open()
    log.info("materializer %s starts after position %d", config.name, materializer.position)
    try:
        await materializer.run(stop)
    finally:
        await materializer.close()
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
    log.info("rebuilt %s: %d events in %.1f s", config.name, folded, time.monotonic() - started)
    return materializer


async def drop_rebuild(database_url: str, name: str) -> None:
    import psycopg
    from psycopg import sql

    from pipeline.errors import ConfigError
    from pipeline.settings import libpq_url

    if name == "main":
        raise ConfigError("the live materializer 'main' is not a rebuild; it cannot be replaced")
    connection = await psycopg.AsyncConnection.connect(libpq_url(database_url), autocommit=True)
    async with connection, connection.transaction():
        await connection.execute(
            sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(f"rm_{name}"))
        )
        await connection.execute("DELETE FROM materializers WHERE name = %s", (name,))
        await connection.execute("DELETE FROM checkpoints WHERE name = %s", (f"materializer:{name}",))
