"""Cheaper appends: token arrays stored without a compression attempt, and the database checks each stream's
versions, so that a group commit need not look them up.

- ``events.tokens`` (int32 ids and float32 logprobs, packed) had the default storage of ``bytea``,
  EXTENDED: every row over ~2 KB had PostgreSQL run pglz over its token arrays before moving them out of
  line. pglz keeps a result only when it saves 25%, which packed token ids and logprobs (near-random 4-byte
  values) do not: ``bench/ingest.py``'s turns (1,200 ids, 200 logprobs) were stored uncompressed every time,
  and the attempt was about 40 µs of the server's CPU per appended turn, a third of what an append cost it.
  EXTERNAL moves them out of line as they are. The bytes read back are the same; a row written before keeps
  its form, and readers cannot tell the two apart. ``events.data`` stays EXTENDED: chat text does compress.
- ``events_append_guard`` (migration 0007) also refuses rows that leave a gap in a stream's versions: each
  stream's new rows must take the versions right after its last one (SQLSTATE 23514, check_violation).
  With the unique index on (stream, version), which refuses a version taken already, a stream's versions
  are 1, 2, 3, ... whoever writes. The event store relies on it: it writes an append that names its expected
  version without looking the stream up, and the database refuses the batch if the stream is elsewhere
  (``pipeline/log/store.py``, ``write_appends``).

Revision ID: 0015
Revises: 0014
Create Date: 2026-11-25
"""

from collections.abc import Sequence

from alembic import op

from migrations.objects import replace

revision: str = "0015"
down_revision: str | None = "0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# The guard: migrations/sql/events_append_guard/v*.sql. They write pipeline/log/store.py's APPEND_LOCK
# (0x7475726E73746C) in decimal: migrations do not import the library.


def upgrade() -> None:
    # Only new rows are affected: no rewrite, a catalog change.
    op.execute("ALTER TABLE events ALTER COLUMN tokens SET STORAGE EXTERNAL")
    replace("events_append_guard", 2)


def downgrade() -> None:
    replace("events_append_guard", 1)
    op.execute("ALTER TABLE events ALTER COLUMN tokens SET STORAGE EXTENDED")
