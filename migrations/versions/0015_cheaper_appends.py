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
Revises: 0013
Create Date: 2026-11-25
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0015"
down_revision: str | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

APPEND_LOCK = 0x7475726E73746C  # pipeline/log/store.py APPEND_LOCK (migrations do not import the library)

# One index probe per stream of the statement: the stream's last version below its new ones. The unique index
# has refused a version taken already, so distinct new versions that start right after that one and leave no
# hole between them leave no hole at all.
STREAM_VERSIONS = """
            SELECT stream, last_before, first_new_version INTO bad_stream, bad_last, bad_first
            FROM (
                SELECT n.*, coalesce((SELECT max(e.version) FROM events e
                                      WHERE e.stream = n.stream AND e.version < n.first_new_version), 0)
                            AS last_before
                FROM (SELECT a.stream, min(a.version) AS first_new_version,
                             max(a.version) AS last_new_version, count(*) AS new_versions
                      FROM appended a GROUP BY a.stream) AS n
            ) AS checked
            WHERE first_new_version <> last_before + 1
               OR last_new_version - first_new_version + 1 <> new_versions
            LIMIT 1;
            IF FOUND THEN
                RAISE EXCEPTION 'events of a stream must take the versions right after its last one, without '
                                'gaps: % is at version %, got version %', bad_stream, bad_last, bad_first
                    USING ERRCODE = 'check_violation';
            END IF;
"""


def append_guard(stream_versions: str) -> str:
    """``events_append_guard`` with migration 0007's checks (the append lock, gapless positions), then
    ``stream_versions``."""
    return f"""
        CREATE OR REPLACE FUNCTION events_append_guard() RETURNS trigger LANGUAGE plpgsql AS $$
        DECLARE
            first_new        bigint;
            last_new         bigint;
            added            bigint;
            previous         bigint;
            bad_stream       text;
            bad_last         integer;
            bad_first        integer;
        BEGIN
            IF NOT EXISTS (
                SELECT FROM pg_locks
                WHERE locktype = 'advisory' AND pid = pg_backend_pid() AND granted AND objsubid = 1
                  AND classid = ({APPEND_LOCK} >> 32)::oid AND objid = ({APPEND_LOCK} & 4294967295)::oid
            ) THEN
                RAISE EXCEPTION 'events are appended only while holding the append lock'
                    USING ERRCODE = 'insufficient_privilege',
                          HINT = 'append through the event store (pipeline.log.EventStore), which takes '
                                 || 'pg_advisory_xact_lock({APPEND_LOCK}) first';
            END IF;
            SELECT min(position), max(position), count(*) INTO first_new, last_new, added FROM appended;
            IF added = 0 THEN
                RETURN NULL;
            END IF;
            SELECT coalesce(max(position), 0) INTO previous FROM events WHERE position < first_new;
            IF first_new <> previous + 1 OR last_new - first_new + 1 <> added
               OR EXISTS (SELECT FROM events WHERE position > last_new) THEN
                RAISE EXCEPTION 'events must take the positions right after the head (%), without gaps; '
                                'got % rows at % .. %', previous, added, first_new, last_new
                    USING ERRCODE = 'insufficient_privilege';
            END IF;
            {stream_versions}
            RETURN NULL;
        END
        $$
    """


def upgrade() -> None:
    # Only new rows are affected: no rewrite, a catalog change.
    op.execute("ALTER TABLE events ALTER COLUMN tokens SET STORAGE EXTERNAL")
    op.execute(append_guard(STREAM_VERSIONS))


def downgrade() -> None:
    op.execute(append_guard(""))
    op.execute("ALTER TABLE events ALTER COLUMN tokens SET STORAGE EXTENDED")
