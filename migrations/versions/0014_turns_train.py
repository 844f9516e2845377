"""The view ``turns`` shows each turn's ``train`` mark (``TurnCompleted.train``) from the event's data: NULL
where the turn is trained (the default, older turns too), false where it was marked not for training (a side
call: no sample, no share of the episode's reward; ``pipeline.materialize.lineages``), true where the writer
said so explicitly. No stored column: like the view's other event fields it is read from ``events.data``.

The view function of 0013 (``turnstile_read_model_views``) is replaced by one whose ``turns`` has the new
last column, and called again for every schema (``public`` and each rebuild's ``rm_<name>``): ``CREATE OR
REPLACE VIEW`` appends the column, so the views that read ``turns`` stay as they are.

Revision ID: 0014
Revises: 0013
Create Date: 2026-11-25
"""

from collections.abc import Sequence

from alembic import op

from migrations.objects import replace

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Version 2 of turnstile_read_model_views (migrations/sql/turnstile_read_model_views/v2.sql): version 1 with
# ``train`` as the last column of ``turns``, anything but a JSON boolean read as NULL (trained), as the
# materializer reads it (only false excludes).

# The views of 0004 and 0009 that read turns or samples (dropped with them on downgrade, made again after).
DEPENDENT_VIEWS = """
    SELECT DISTINCT v.oid::regclass::text, pg_get_viewdef(v.oid), obj_description(v.oid, 'pg_class')
    FROM pg_depend d
    JOIN pg_rewrite r ON r.oid = d.objid
    JOIN pg_class v ON v.oid = r.ev_class
    WHERE d.refobjid IN ('public.turns'::regclass, 'public.samples'::regclass)
      AND v.oid NOT IN ('public.turns'::regclass, 'public.samples'::regclass)
"""
READERS = ("turnstile_writer", "turnstile_materializer", "turnstile_reader")


def _schemas() -> list[str]:
    rows = (
        op.get_bind()
        .exec_driver_sql(
            "SELECT schema_name FROM materializers WHERE schema_name <> 'public' "
            "AND schema_name IN (SELECT nspname FROM pg_namespace)"
        )
        .all()
    )
    return ["public", *(row[0] for row in rows)]


def _views(version: int) -> None:
    replace("turnstile_read_model_views", version)
    for schema in _schemas():
        op.execute(f"SELECT turnstile_read_model_views('{schema}')")


def upgrade() -> None:
    _views(2)  # CREATE OR REPLACE VIEW appends the column: the views that read turns stay as they are


def downgrade() -> None:
    # Version 1 creates both views (CREATE VIEW), so both go first, with the views that read them.
    dependent = op.get_bind().exec_driver_sql(DEPENDENT_VIEWS).all()
    for name, _, _ in dependent:
        op.execute(f"DROP VIEW {name}")
    for schema in _schemas():
        op.execute(f'DROP VIEW "{schema}".turns, "{schema}".samples')
    _views(1)
    for name, definition, comment in dependent:
        op.execute(f"CREATE VIEW {name} AS {definition}")
        if comment is not None:
            quoted = comment.replace("'", "''")
            op.execute(f"COMMENT ON VIEW {name} IS '{quoted}'")
        op.execute(f"GRANT SELECT ON {name} TO {', '.join(READERS)}")
    op.execute(f"GRANT SELECT ON turns, samples TO {', '.join(READERS)}")
