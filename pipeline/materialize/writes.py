"""A step's ``Writes`` into the read models: new rows by binary COPY, changed ones by one set-based UPDATE a
table (the caller holds the transaction)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from typing import Any

import psycopg
from psycopg import sql

from pipeline.log import JsonText, JsonTextBinaryDumper
from pipeline.materialize.columns import (
    BATCH_COPY,
    EPISODE_COPY,
    FINISHED_COLUMNS,
    OUTBOX_COPY,
    SAMPLE_COPY,
    SKIPPED_COPY,
    TURN_COPY,
    CopyColumns,
)
from pipeline.materialize.records import Writes


def qualified(schema: str, table: str) -> sql.Composed:
    """``schema.table``, quoted."""
    return sql.SQL("{}.{}").format(sql.Identifier(schema), sql.Identifier(table))


def copy_rows(
    connection: psycopg.Connection[Any],
    schema: str,
    table: str,
    columns: CopyColumns,
    rows: Iterable[Sequence[Any]],
) -> None:
    """Binary COPY: PostgreSQL takes the values as they are stored, without parsing text."""
    statement = sql.SQL("COPY {} ({}) FROM STDIN (FORMAT BINARY)").format(
        qualified(schema, table), sql.SQL(", ").join(map(sql.Identifier, columns.names))
    )
    with connection.cursor() as cursor:
        cursor.adapters.register_dumper(JsonText, JsonTextBinaryDumper)
        with cursor.copy(statement) as out:
            out.set_types(list(columns.types))
            for row in rows:
                out.write_row(row)


def write(connection: psycopg.Connection[Any], schema: str, writes: Writes) -> None:
    """A step's writes into the read models of ``schema``, on ``connection`` (in its transaction)."""
    if writes.episodes:
        copy_rows(connection, schema, "episodes", EPISODE_COPY, writes.episodes.values())
    if writes.searched:
        # Before turn_rows: its trigger then finds this step's finished turns indexed and passes them over.
        connection.execute("SELECT turnstile_index_turns(%s::bigint[])", (writes.searched,))
    if writes.turns:
        copy_rows(connection, schema, "turn_rows", TURN_COPY, writes.turns)
    if writes.samples:
        copy_rows(connection, schema, "sample_rows", SAMPLE_COPY, writes.samples.values())
    if writes.finished:
        update_rows(connection, schema, "episodes", "episode_id", FINISHED_COLUMNS, writes.finished)
    if writes.ready or writes.batched:
        # one table for both kinds: a sample made ready and batched in this step has both changes
        merged: dict[str, list[Any]] = {}
        for advantage, ready_position, key in writes.ready:
            merged.setdefault(key, [None, None, None, None])[0:2] = [advantage, ready_position]
        for stale, batch_id, key in writes.batched:
            merged.setdefault(key, [None, None, None, None])[2:4] = [stale, batch_id]
        # A batched sample's arrays live in its batch's payload (and in the log): the row keeps the rest,
        # in the same UPDATE. (Samples batched in the step that made them were written without them.)
        update_rows(
            connection,
            schema,
            "sample_rows",
            "turn_id",
            ("advantage", "ready_position", "stale", "batch_id"),
            [(*values, key) for key, values in merged.items()],
            also=sql.SQL("arrays = CASE WHEN c.batch_id IS NULL THEN t.arrays END"),
        )
    if writes.batches:
        hashed = [
            (*row[:-1], hashlib.sha256(row[-1]).digest() if row[-1] else None) for row in writes.batches
        ]
        copy_rows(connection, schema, "batches", BATCH_COPY, hashed)
    if writes.outbox:
        copy_rows(connection, schema, "batch_outbox", OUTBOX_COPY, writes.outbox)
    if writes.skipped:
        copy_rows(connection, schema, "skipped_events", SKIPPED_COPY, writes.skipped)


def update_rows(
    connection: psycopg.Connection[Any],
    schema: str,
    table: str,
    key: str,
    columns: Sequence[str],
    rows: list[tuple[Any, ...]],
    also: sql.Composable | None = None,
) -> None:
    """Rows inserted by earlier steps change through one set-based UPDATE per table: the changes are
    COPYed into a temporary table (dropped at commit) and joined, instead of one UPDATE per row. A NULL
    in a change means "unchanged" (coalesce): no change ever sets a column back to NULL."""
    changes = sql.Identifier(f"changed_{table}")
    connection.execute(
        sql.SQL("CREATE TEMP TABLE {} ON COMMIT DROP AS SELECT {} FROM {} LIMIT 0").format(
            changes, sql.SQL(", ").join(map(sql.Identifier, [*columns, key])), qualified(schema, table)
        )
    )
    with connection.cursor() as cursor, cursor.copy(sql.SQL("COPY {} FROM STDIN").format(changes)) as out:
        for row in rows:
            out.write_row(row)
    assignments = sql.SQL(", ").join(
        [
            *(
                sql.SQL("{} = coalesce(c.{}, t.{})").format(
                    sql.Identifier(c), sql.Identifier(c), sql.Identifier(c)
                )
                for c in columns
            ),
            *([also] if also is not None else []),
        ]
    )
    connection.execute(
        sql.SQL("UPDATE {} t SET {} FROM {} c WHERE t.{} = c.{}").format(
            qualified(schema, table), assignments, changes, sql.Identifier(key), sql.Identifier(key)
        )
    )
