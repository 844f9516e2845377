"""Runner leases, and indexes to find episodes left open by a runner that died.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-23
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # A runner holds a lease while it runs: it inserts its row before it starts any episode and renews
    # heartbeat_at every few seconds. An open episode whose runner's lease has lapsed is abandoned.
    op.execute(
        """
        CREATE TABLE runners (
            runner_id    text        PRIMARY KEY,
            host         text        NOT NULL,
            pid          integer     NOT NULL,
            started_at   timestamptz NOT NULL DEFAULT now(),
            heartbeat_at timestamptz NOT NULL DEFAULT now(),
            stopped_at   timestamptz
        )
        """
    )
    # Partial indexes: only the two episode boundary events are indexed, so appends of turns pay nothing.
    op.execute("CREATE INDEX events_episode_started ON events (position) WHERE type = 'EpisodeStarted'")
    op.execute("CREATE INDEX events_episode_finished ON events (stream) WHERE type = 'EpisodeFinished'")


def downgrade() -> None:
    op.execute("DROP INDEX events_episode_finished")
    op.execute("DROP INDEX events_episode_started")
    op.execute("DROP TABLE runners")
