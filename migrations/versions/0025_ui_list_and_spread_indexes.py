"""Two partial indexes for the episode browser's pages that still read more rows the longer a run went on.

- ``group_rollups.spread_ready``, a stored generated column: the group has finished and has more than one
  episode (``finished = episodes AND episodes > 1``), and ``group_rollups_finished`` on ``(policy,
  last_finished_at DESC NULLS LAST)`` over those groups only, in place of 0022's ``group_rollups_recent``
  over every group. The run page's group spread reads the last 2,000 such groups. PostgreSQL estimates
  ``finished = episodes`` (two columns compared) at a fraction of a percent of the rows whatever they hold,
  so it read every finished group of the policy and sorted them (fewer than 2,000 expected) rather than
  walk the index and stop at 2,000: a read that grew with the run. A column has statistics of its own (as
  the tables' autovacuum gathers them), and the partial index holds only the rows the query wants.
- ``episodes_errors`` on ``episodes (started_at DESC NULLS LAST, episode_id DESC)`` where the episode
  failed (``termination = 'error' OR error IS NOT NULL``, the list's "errors" filter, written with the same
  literal): the filter's count read every episode.

Revision ID: 0025
Revises: 0024
Create Date: 2026-11-27
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0025"
down_revision: str | None = "0024"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

RECENT = "group_rollups (policy, last_finished_at DESC NULLS LAST)"
INDEXES: dict[str, str] = {
    "group_rollups_finished": f"{RECENT} WHERE spread_ready",
    "episodes_errors": "episodes (started_at DESC NULLS LAST, episode_id DESC) "
    "WHERE termination = 'error' OR error IS NOT NULL",
}


def upgrade() -> None:
    op.execute(
        "ALTER TABLE group_rollups ADD COLUMN spread_ready boolean NOT NULL "
        "GENERATED ALWAYS AS (finished = episodes AND episodes > 1) STORED"
    )
    for name, definition in INDEXES.items():
        op.execute(f"CREATE INDEX {name} ON {definition}")
    op.execute("DROP INDEX group_rollups_recent")


def downgrade() -> None:
    op.execute(f"CREATE INDEX group_rollups_recent ON {RECENT}")
    for name in reversed(INDEXES):
        op.execute(f"DROP INDEX {name}")
    op.execute("ALTER TABLE group_rollups DROP COLUMN spread_ready")
