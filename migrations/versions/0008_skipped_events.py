"""Events the materializer could not fold, and why: it skips them and goes on instead of stopping.

Every event is validated when it is appended, so nothing should land here; an event that does anyway (written
by an older release with looser checks, by a bug, or by hand as the owner) would otherwise stop the
materializer on every start. The materializer records each one it skips (its position, stream, type, the
episode it belongs to and the reason) in the same transaction as its checkpoint, so a rebuild (``turnstile
rematerialize``, schema ``rm_<name>``, made ``LIKE`` this table) reports the same skips. An episode with a
skipped event is recorded as finished with ``error`` saying so and yields no samples.

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-24
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.execute(
        """
        CREATE TABLE skipped_events (
            position   bigint PRIMARY KEY,
            stream     text   NOT NULL,
            type       text   NOT NULL,
            episode_id text,
            reason     text   NOT NULL
        )
        """
    )
    op.execute("GRANT INSERT, UPDATE ON skipped_events TO turnstile_materializer")
    op.execute("GRANT SELECT ON skipped_events TO turnstile_writer, turnstile_reader")


def downgrade() -> None:
    op.execute("DROP TABLE skipped_events")
