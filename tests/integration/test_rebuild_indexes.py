"""A rebuild's schema gets every index of the live read models: the unique ones at once, the others built
(two at a time) once it has caught up."""

from __future__ import annotations

import psycopg

from pipeline.materialize.config import MaterializerConfig
from pipeline.materialize.rebuild import READ_MODEL_TABLES
from pipeline.materialize.writer import Materializer
from tests.integration.test_rebuild_equivalence import varied_log, write_log


def indexes(database_url: str, schema: str) -> set[tuple[str, str]]:
    """(index name, definition with the schema taken out) of the read models in ``schema``."""
    with psycopg.connect(database_url) as connection:
        rows = connection.execute(
            "SELECT i.relname, pg_get_indexdef(x.indexrelid) FROM pg_index x "
            "JOIN pg_class i ON i.oid = x.indexrelid JOIN pg_class t ON t.oid = x.indrelid "
            "JOIN pg_namespace n ON n.oid = t.relnamespace WHERE n.nspname = %s AND t.relname = ANY(%s)",
            (schema, list(READ_MODEL_TABLES)),
        ).fetchall()
    return {(name, definition.replace(f" {schema}.", " ")) for name, definition in rows}


async def test_a_caught_up_rebuild_has_every_index_of_the_live_read_models(database_url: str) -> None:
    write_log(database_url, varied_log(episodes=20))
    materializer = Materializer(database_url, MaterializerConfig(name="indexed"))
    await materializer.open(create=True)
    try:
        with psycopg.connect(database_url) as connection:
            unique_only = connection.execute(
                "SELECT bool_and(x.indisunique), count(*) FROM pg_index x "
                "JOIN pg_class t ON t.oid = x.indrelid JOIN pg_namespace n ON n.oid = t.relnamespace "
                "WHERE n.nspname = 'rm_indexed'"
            ).fetchone()
        assert unique_only is not None
        assert unique_only[0] is True
        await materializer.catch_up()
        assert await materializer.build_deferred_indexes() == 0  # once
    finally:
        await materializer.close()
    live = indexes(database_url, "public")
    assert len(live) > unique_only[1] + 2
    assert indexes(database_url, "rm_indexed") == live
