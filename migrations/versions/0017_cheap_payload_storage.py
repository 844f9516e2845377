"""Batch payloads and unbatched sample arrays are stored without pglz: with lz4 where the server has it,
uncompressed otherwise.

``batch_outbox.payload`` (each batch's safetensors payload, until the relay deletes it after publishing:
``turnstile serve relay --outbox-retention``, a day by default) and ``sample_rows.arrays`` (a sample's
packed arrays until its batch is made) had the default storage of ``bytea``, EXTENDED with pglz:
PostgreSQL compressed every payload as the materializer wrote it. pglz is slow, and it was the largest part
of a rebuild's server CPU: ``bench/materialize.py --quick`` wrote 827 payloads (153 MB) that pglz took to
52 MB, and PostgreSQL's CPU over the rebuild went from 4.1-5.6 s with it to 3.0-3.3 s without it. lz4
compresses the same bytes for a fraction of that, so a server built with lz4 (``default_toast_compression``
accepts it) keeps them compressed with lz4; one without (the embedded server of the tests and benchmarks
is one) stores them as they are (STORAGE EXTERNAL: out of line, uncompressed), three times the space while
they are kept.

The bytes read back are the same; rows written before keep their form, and readers cannot tell the two
apart. The rebuild schemas ``rm_<name>`` get the same setting: those made before now, here; new ones copy
it from ``public`` (``CREATE TABLE ... (LIKE public.x INCLUDING ALL)`` includes storage and compression).

Revision ID: 0017
Revises: 0016
Create Date: 2026-11-26
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0017"
down_revision: str | None = "0016"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

COLUMNS = (("batch_outbox", "payload"), ("sample_rows", "arrays"))

HAS_LZ4 = "SELECT 'lz4' = ANY(enumvals) FROM pg_settings WHERE name = 'default_toast_compression'"
"""The server was built with lz4: the setting offers it (PostgreSQL 14 and later)."""


def _schemas() -> list[str]:
    rows = (
        op.get_bind()
        .exec_driver_sql(
            "SELECT schema_name FROM materializers WHERE schema_name <> 'public' "
            "AND schema_name IN (SELECT nspname FROM pg_namespace)"
        )
        .all()
    )
    return ["public", *(row[0] for row in rows)]


def _set(setting: str) -> None:
    # A catalog change only: rows already stored keep their form (no rewrite).
    for schema in _schemas():
        for table, column in COLUMNS:
            op.execute(f'ALTER TABLE "{schema}".{table} ALTER COLUMN {column} {setting}')


def upgrade() -> None:
    lz4 = op.get_bind().exec_driver_sql(HAS_LZ4).scalar()
    _set("SET COMPRESSION lz4" if lz4 else "SET STORAGE EXTERNAL")


def downgrade() -> None:
    _set("SET STORAGE EXTENDED")
    _set("SET COMPRESSION DEFAULT")
