"""``turnstile rematerialize --name X --replace`` with the logins ``turnstile up`` prints.

Replacing a rebuild drops its schema ``rm_<X>`` and deletes its rows in ``materializers`` and
``checkpoints``; the services' login (turnstile_writer and turnstile_materializer) may insert and update
those rows but not delete them, so ``--replace`` failed with "permission denied for table materializers" (an
84-line traceback). Granting DELETE on both tables would let that login reset the live materializer's
checkpoint too; instead the one operation is a function owned by the tables' owner (SECURITY DEFINER):
``turnstile_drop_rebuild(name)`` refuses ``main`` and drops only ``rm_<name>`` and that name's rows. It is
granted to turnstile_materializer alone.

Revision ID: 0020
Revises: 0019
Create Date: 2026-11-27
"""

from collections.abc import Sequence

from alembic import op

from migrations.objects import replace

revision: str = "0020"
down_revision: str | None = "0019"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    replace("turnstile_drop_rebuild", 1)
    op.execute("REVOKE ALL ON FUNCTION turnstile_drop_rebuild(text) FROM PUBLIC")
    op.execute("GRANT EXECUTE ON FUNCTION turnstile_drop_rebuild(text) TO turnstile_materializer")


def downgrade() -> None:
    op.execute("DROP FUNCTION turnstile_drop_rebuild(text)")
