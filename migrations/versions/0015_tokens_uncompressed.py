"""Token arrays are stored without trying to compress them.

``events.tokens`` (int32 ids and float32 logprobs, packed) had the default storage of ``bytea``, EXTENDED:
every row over ~2 KB had PostgreSQL run pglz over its token arrays before moving them out of line. pglz
keeps a result only when it saves 25%, which packed token ids and logprobs (near-random 4-byte values) do
not: ``bench/ingest.py``'s turns (1,200 ids, 200 logprobs) were stored uncompressed every time, and the
attempt was about 40 µs of the server's CPU per appended turn, some 40% of what an append cost it.
EXTERNAL moves them out of line as they are. The bytes read back are the same; a row written before keeps
its form, and readers cannot tell the two apart. ``events.data`` stays EXTENDED: chat text does compress.

Revision ID: 0015
Revises: 0013
Create Date: 2026-11-25
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0015"
down_revision: str | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Only new rows are affected: no rewrite, a catalog change.
    op.execute("ALTER TABLE events ALTER COLUMN tokens SET STORAGE EXTERNAL")


def downgrade() -> None:
    op.execute("ALTER TABLE events ALTER COLUMN tokens SET STORAGE EXTENDED")
