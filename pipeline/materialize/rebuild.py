"""A rebuild's schema ``rm_<name>``: the read models it holds, made with their keys first and their other
indexes once the rebuild has caught up, and dropping it."""

from __future__ import annotations

import asyncio
import re
from typing import Any, Final

import psycopg
from psycopg import sql

from pipeline.errors import ConfigError
from pipeline.log import READER_ROLE
from pipeline.settings import libpq_url

READ_MODEL_TABLES: Final = (
    "episodes", "turn_rows", "sample_rows", "batches", "batch_outbox", "skipped_events",
)  # fmt: skip
"""The tables the materializer writes (``turns`` and ``samples`` are views over ``turn_rows`` and
``sample_rows``: migration 0013)."""
_ON_TABLE: Final = re.compile(r" ON (?:public\.)?(?P<table>[a-z_]+) USING ")


async def drop_rebuild(database_url: str, name: str) -> None:
    """Drop the rebuild ``name``: its schema, its recorded configuration and its checkpoint."""
    if name == "main":
        raise ConfigError("the live materializer 'main' is not a rebuild; it cannot be replaced")
    # A function owned by the tables' owner (migration 0020): the services' login may not delete those rows
    # itself, and through it can drop a rebuild only, never reset the live materializer.
    connection = await psycopg.AsyncConnection.connect(libpq_url(database_url), autocommit=True)
    async with connection:
        await connection.execute("SELECT turnstile_drop_rebuild(%s)", (name,))


async def create_rebuild_schema(connection: psycopg.AsyncConnection[Any], schema: str) -> None:
    """Make ``schema`` (``rm_<name>``) with the read models' tables, views and unique indexes."""
    await connection.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
    for table in READ_MODEL_TABLES:
        await connection.execute(
            sql.SQL("CREATE TABLE {}.{} (LIKE public.{} INCLUDING ALL EXCLUDING INDEXES)").format(
                sql.Identifier(schema), sql.Identifier(table), sql.Identifier(table)
            )
        )
    # Only the unique indexes now (the keys that updates and the views join on); the others are built once
    # the rebuild has caught up (build_deferred_indexes): one sort each instead of an insert per row.
    for _, unique, definition in await index_definitions(connection, schema):
        if unique:
            await connection.execute(definition)
    await connection.execute("SELECT turnstile_read_model_views(%s)", (schema,))
    # The readers of the log read a rebuild as they read the live read models (`turnstile sql --schema
    # NAME`, plot): the login that made the schema owns it, so it grants them what 0006 grants on public.
    for grant in ("GRANT USAGE ON SCHEMA {} TO {}", "GRANT SELECT ON ALL TABLES IN SCHEMA {} TO {}"):
        await connection.execute(sql.SQL(grant).format(sql.Identifier(schema), sql.Identifier(READER_ROLE)))


async def index_definitions(
    connection: psycopg.AsyncConnection[Any], schema: str
) -> list[tuple[str, bool, str]]:
    """The indexes of the live read models (schema public) as statements for the rebuild's ``schema``:
    (name, unique, CREATE INDEX ...)."""
    rows = await (
        await connection.execute(
            "SELECT i.relname, x.indisunique, pg_get_indexdef(x.indexrelid) FROM pg_index x "
            "JOIN pg_class i ON i.oid = x.indexrelid JOIN pg_class t ON t.oid = x.indrelid "
            "JOIN pg_namespace n ON n.oid = t.relnamespace "
            "WHERE n.nspname = 'public' AND t.relname = ANY(%s) ORDER BY i.relname",
            (list(READ_MODEL_TABLES),),
        )
    ).fetchall()
    # schema is rm_<name>: letters, digits and _ (MaterializerConfig checks the name)
    return [
        (name, unique, _ON_TABLE.sub(rf" ON {schema}.\g<table> USING ", definition, count=1))
        for name, unique, definition in rows
    ]


async def build_deferred_indexes(
    connection: psycopg.AsyncConnection[Any], database_url: str, schema: str
) -> int:
    """The live read models' non-unique indexes, built in the rebuild's ``schema`` unless it has some
    already (a rebuild made before indexes were deferred). The indexes built."""
    existing = await (
        await connection.execute(
            "SELECT count(*) FROM pg_index x JOIN pg_class t ON t.oid = x.indrelid "
            "JOIN pg_namespace n ON n.oid = t.relnamespace "
            "WHERE n.nspname = %s AND t.relname = ANY(%s) AND NOT x.indisunique",
            (schema, list(READ_MODEL_TABLES)),
        )
    ).fetchone()
    if existing is None or existing[0] != 0:
        return 0
    definitions = [d for _, unique, d in await index_definitions(connection, schema) if not unique]
    # Two at a time, on this connection and one more: each build is one sort on one core (and two builds on
    # one table take SHARE locks, which do not conflict).
    other = await psycopg.AsyncConnection.connect(database_url, autocommit=True)
    async with other:

        async def build(on: psycopg.AsyncConnection[Any], statements: list[str]) -> None:
            for statement in statements:
                await on.execute(statement)

        failed = await asyncio.gather(
            build(connection, definitions[0::2]), build(other, definitions[1::2]), return_exceptions=True
        )
    for error in failed:
        if isinstance(error, BaseException):
            raise error
    return len(definitions)
