"""Render drift per turn, and which chat template made each prompt.

``turns.render_drift``: whether the tokens the policy saw differ from a full re-render of the same messages
(a reasoning template differs by design: it strips earlier reasoning; a template that trims whitespace may
too), NULL where the consumer did not check. ``turns.chat_template``: sha256 of the template, 12 hex digits.
The view ``render_drift_by_agent`` answers "where would re-tokenizing have changed what my model saw?" per
agent and template, beside the ``prefix_break`` rate. Rebuild schemas (``rm_<name>``) get the columns too.

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-24
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

VIEW = """
    SELECT e.agent,
           t.chat_template,
           count(DISTINCT t.episode_id)                                  AS episodes,
           count(*)                                                      AS turns,
           count(*) FILTER (WHERE t.parent_turn_id IS NOT NULL)          AS continued_turns,
           count(*) FILTER (WHERE t.prefix_break)                        AS prefix_breaks,
           count(*) FILTER (WHERE t.render_drift)                        AS drifted_turns,
           count(*) FILTER (WHERE t.render_drift IS NOT NULL)            AS checked_turns,
           (count(*) FILTER (WHERE t.render_drift))::double precision
               / nullif(count(*) FILTER (WHERE t.render_drift IS NOT NULL), 0) AS render_drift_rate,
           (count(*) FILTER (WHERE t.prefix_break))::double precision / count(*) AS prefix_break_rate
    FROM turns t
    JOIN episodes e USING (episode_id)
    GROUP BY e.agent, t.chat_template
"""


def _schemas() -> list[str]:
    connection = op.get_bind()
    rows = connection.exec_driver_sql(
        "SELECT schema_name FROM materializers WHERE schema_name <> 'public' "
        "AND schema_name IN (SELECT nspname FROM pg_namespace)"
    ).all()
    return ["public", *(row[0] for row in rows)]


def upgrade() -> None:
    for schema in _schemas():
        op.execute(
            f'ALTER TABLE "{schema}".turns ADD COLUMN render_drift boolean, ADD COLUMN chat_template text'
        )
    op.execute(f"CREATE VIEW render_drift_by_agent AS {VIEW}")
    op.execute(
        "COMMENT ON VIEW render_drift_by_agent IS 'per agent and chat template: continued turns whose tokens "
        "differ from a full re-render of their messages (render_drift), beside prefix_break'"
    )


def downgrade() -> None:
    op.execute("DROP VIEW render_drift_by_agent")
    for schema in _schemas():
        op.execute(f'ALTER TABLE "{schema}".turns DROP COLUMN render_drift, DROP COLUMN chat_template')
