"""The event log and consumer checkpoints.

Revision ID: 0001
Revises:
Create Date: 2026-11-23
"""

from collections.abc import Sequence

from alembic import op

from migrations.objects import replace

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # position is assigned by the appender while it holds the append lock (see pipeline/log/store.py),
    # so positions are gapless and increase in commit order; there is deliberately no sequence.
    op.execute(
        """
        CREATE TABLE events (
            position     bigint      PRIMARY KEY,
            stream       text        NOT NULL,
            category     text        GENERATED ALWAYS AS (split_part(stream, '-', 1)) STORED,
            version      integer     NOT NULL CHECK (version >= 1),
            event_id     uuid        NOT NULL UNIQUE,
            type         text        NOT NULL,
            data         jsonb       NOT NULL,
            tokens       bytea,
            metadata     jsonb       NOT NULL DEFAULT '{}'::jsonb,
            content_hash bytea       NOT NULL,
            recorded_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
            CONSTRAINT events_stream_version_key UNIQUE (stream, version)
        )
        """
    )
    # No further indexes: every index is paid on each append; readers that need one (by category or
    # type) add it in their own migration.
    op.execute(
        "COMMENT ON COLUMN events.tokens IS "
        "'token arrays of the event, packed by pipeline/tokens.py: prompt ids, completion ids (int32), "
        "completion logprobs (float32)'"
    )
    # Wakes tailers at commit (NOTIFY is delivered only when the inserting transaction commits, and
    # identical notifications in one transaction are folded into one).
    replace("events_notify", 1)
    op.execute(
        "CREATE TRIGGER events_notify AFTER INSERT ON events "
        "FOR EACH STATEMENT EXECUTE FUNCTION events_notify()"
    )
    op.execute(
        """
        CREATE TABLE checkpoints (
            name       text        PRIMARY KEY,
            position   bigint      NOT NULL CHECK (position >= 0),
            updated_at timestamptz NOT NULL DEFAULT now()
        )
        """
    )


def downgrade() -> None:
    op.execute("DROP TABLE checkpoints")
    op.execute("DROP TRIGGER events_notify ON events")
    op.execute("DROP FUNCTION events_notify()")
    op.execute("DROP TABLE events")
