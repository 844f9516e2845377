"""A rebuild's schema ``rm_<name>``: the read models it holds, and dropping it."""

from __future__ import annotations

from typing import Final

import psycopg
from psycopg import sql

from pipeline.errors import ConfigError
from pipeline.materialize.config import rebuild_schema
from pipeline.settings import libpq_url

READ_MODEL_TABLES: Final = (
    "episodes", "turn_rows", "sample_rows", "batches", "batch_outbox", "skipped_events",
)  # fmt: skip
"""The tables the materializer writes (``turns`` and ``samples`` are views over ``turn_rows`` and
``sample_rows``: migration 0013)."""


async def drop_rebuild(database_url: str, name: str) -> None:
    """Drop the rebuild ``name``: its schema, its recorded configuration and its checkpoint."""
    if name == "main":
        raise ConfigError("the live materializer 'main' is not a rebuild; it cannot be replaced")
    connection = await psycopg.AsyncConnection.connect(libpq_url(database_url), autocommit=True)
    async with connection, connection.transaction():
        await connection.execute(
            sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(rebuild_schema(name)))
        )
        await connection.execute("DELETE FROM materializers WHERE name = %s", (name,))
        await connection.execute("DELETE FROM checkpoints WHERE name = %s", (f"materializer:{name}",))
