"""Which batches each trainer has trained (or skipped), and into which policy version.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-23
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # A trainer records a batch here only after the checkpoint holding its update is on disk, and acks
    # the JetStream message only after this commit: a batch redelivered after a crash is either in this
    # table (skip it) or not in any published checkpoint (train it again).
    op.execute(
        """
        CREATE TABLE trained_batches (
            trainer        text        NOT NULL,
            batch_id       text        NOT NULL,
            policy         text        NOT NULL,
            policy_version integer     NOT NULL,
            outcome        text        NOT NULL CHECK (outcome IN ('trained', 'stale', 'duplicate')),
            loss           double precision,
            trained_at     timestamptz NOT NULL DEFAULT now(),
            PRIMARY KEY (trainer, batch_id)
        )
        """
    )
    op.execute("CREATE INDEX trained_batches_batch ON trained_batches (batch_id)")


def downgrade() -> None:
    op.execute("DROP TABLE trained_batches")
