"""Migration 0017: batch payloads and unbatched sample arrays are stored without pglz (lz4 where the server
has it, uncompressed otherwise), in ``public`` and in every rebuild schema, old or new."""

from __future__ import annotations

import psycopg
from alembic import command

from pipeline.log.db import alembic_config
from pipeline.materialize.config import MaterializerConfig
from pipeline.materialize.writer import Materializer

COLUMNS = {("batch_outbox", "payload"), ("sample_rows", "arrays")}


def settings(database_url: str, schema: str) -> dict[tuple[str, str], tuple[str, str]]:
    """(table, column) -> (attstorage, attcompression) of the payload columns of ``schema``."""
    with psycopg.connect(database_url) as connection:
        rows = connection.execute(
            "SELECT c.relname, a.attname, a.attstorage, a.attcompression FROM pg_attribute a "
            "JOIN pg_class c ON c.oid = a.attrelid JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname = %s AND (c.relname, a.attname) IN (('batch_outbox', 'payload'), "
            "('sample_rows', 'arrays'))",
            (schema,),
        ).fetchall()
    return {(table, column): (storage, compression) for table, column, storage, compression in rows}


def has_lz4(database_url: str) -> bool:
    with psycopg.connect(database_url) as connection:
        row = connection.execute(
            "SELECT 'lz4' = ANY(enumvals) FROM pg_settings WHERE name = 'default_toast_compression'"
        ).fetchone()
    return bool(row and row[0])


async def make_rebuild(database_url: str, name: str) -> None:
    materializer = Materializer(database_url, MaterializerConfig(name=name))
    await materializer.open(create=True)
    await materializer.close()


async def test_payloads_skip_pglz_in_public_and_in_rebuild_schemas_old_and_new(database_url: str) -> None:
    cheap = ("x", "l") if has_lz4(database_url) else ("e", "")  # this server's choice: lz4, else uncompressed
    default = ("x", "")  # EXTENDED with the server's default compression: pglz here
    config = alembic_config(database_url)

    command.downgrade(config, "0016")
    assert settings(database_url, "public") == dict.fromkeys(COLUMNS, default)
    await make_rebuild(database_url, "before")
    assert settings(database_url, "rm_before") == dict.fromkeys(COLUMNS, default)

    command.upgrade(config, "head")
    assert settings(database_url, "public") == dict.fromkeys(COLUMNS, cheap)
    assert settings(database_url, "rm_before") == dict.fromkeys(COLUMNS, cheap)
    await make_rebuild(database_url, "after")  # copies it from public (LIKE ... INCLUDING ALL)
    assert settings(database_url, "rm_after") == dict.fromkeys(COLUMNS, cheap)

    command.downgrade(config, "0016")
    for schema in ("public", "rm_before", "rm_after"):
        assert settings(database_url, schema) == dict.fromkeys(COLUMNS, default), schema
    command.upgrade(config, "head")
