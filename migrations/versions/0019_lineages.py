"""One conversation, one lineage: the ``turns`` read model says, per turn, whether its reply was delivered,
whether it is trained, its lineage and why that lineage started, and the model and edit its event records.

``turn_rows`` gets four columns the materializer derives (``pipeline.materialize.lineages``, rule 2):

- ``delivered``: the reply reached a live client (``TurnCompleted.delivered`` not false, or a later
  ``TurnDelivered`` names it, or a later turn continues it);
- ``trained``: the turn makes a sample (not marked, not a side call, delivered);
- ``lineage``: the root of its conversation in the whole turn tree;
- ``root_reason``: on a root, why it started: ``first call``, ``side call``, ``edit``, ``template break`` or
  ``new conversation`` (NULL on other turns).

Rows folded before this migration have NULL there until a rebuild (``turnstile rematerialize``). Version 3 of
``turnstile_read_model_views`` appends those four and ``model`` and ``edit`` (from ``events.data``) as the
last columns of ``turns``; ``CREATE OR REPLACE VIEW`` appends them, so the views that read ``turns`` stay.

Revision ID: 0019
Revises: 0018
Create Date: 2026-11-27
"""

from collections.abc import Sequence
from importlib import import_module

from alembic import op

from migrations.objects import replace

revision: str = "0019"
down_revision: str | None = "0018"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

COLUMNS = (("delivered", "boolean"), ("trained", "boolean"), ("lineage", "uuid"), ("root_reason", "text"))

_turns_train = import_module("migrations.versions.0014_turns_train")


def upgrade() -> None:
    for schema in _turns_train._schemas():
        added = ", ".join(f"ADD COLUMN {name} {kind}" for name, kind in COLUMNS)
        op.execute(f'ALTER TABLE "{schema}".turn_rows {added}')
    replace("turnstile_read_model_views", 3)
    for schema in _turns_train._schemas():
        op.execute(f"SELECT turnstile_read_model_views('{schema}')")


def downgrade() -> None:
    # Version 2 of the views has fewer columns: they are dropped (with the views that read them) and made
    # again as 0014 does on its own downgrade, then the columns go.
    dependent = op.get_bind().exec_driver_sql(_turns_train.DEPENDENT_VIEWS).all()
    for name, _, _ in dependent:
        op.execute(f"DROP VIEW {name}")
    for schema in _turns_train._schemas():
        op.execute(f'DROP VIEW "{schema}".turns, "{schema}".samples')
    replace("turnstile_read_model_views", 2)
    for schema in _turns_train._schemas():
        op.execute(f"SELECT turnstile_read_model_views('{schema}')")
    for name, definition, comment in dependent:
        op.execute(f"CREATE VIEW {name} AS {definition}")
        if comment is not None:
            quoted = comment.replace("'", "''")
            op.execute(f"COMMENT ON VIEW {name} IS '{quoted}'")
        op.execute(f"GRANT SELECT ON {name} TO {', '.join(_turns_train.READERS)}")
    op.execute(f"GRANT SELECT ON turns, samples TO {', '.join(_turns_train.READERS)}")
    for schema in _turns_train._schemas():
        dropped = ", ".join(f"DROP COLUMN {name}" for name, _ in COLUMNS)
        op.execute(f'ALTER TABLE "{schema}".turn_rows {dropped}')
