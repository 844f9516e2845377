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

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TRAIN = (
    "CASE WHEN jsonb_typeof(ev.data -> 'train') = 'boolean' THEN (ev.data ->> 'train')::boolean END AS train"
)
"""Anything but a JSON boolean reads as NULL (trained), as the materializer reads it (only false excludes)."""

VIEWS_FUNCTION = r"""
CREATE OR REPLACE FUNCTION turnstile_read_model_views(target text) RETURNS void LANGUAGE plpgsql AS $fn$
BEGIN
    EXECUTE format($view$
        CREATE OR REPLACE VIEW %1$I.turns AS
        SELECT t.turn_id,
               e.episode_id,
               t.turn_index,
               t.parent_turn_id,
               (ev.data ->> 'parent_turn_id')::uuid                                     AS recorded_parent,
               t.prompt_tokens,
               t.completion_tokens,
               ev.data -> 'reply' ->> 'finish_reason'                                  AS finish_reason,
               t.policy_version,
               ev.data ->> 'engine_id'                                                 AS engine_id,
               coalesce((ev.data -> 'timings' ->> 'queued_ms')::double precision, 0)      AS queued_ms,
               coalesce((ev.data -> 'timings' ->> 'first_token_ms')::double precision, 0) AS first_token_ms,
               coalesce((ev.data -> 'timings' ->> 'total_ms')::double precision, 0)       AS latency_ms,
               t.mean_logprob,
               t.reward,
               t.discounted_return,
               t.prefix_break,
               CASE WHEN jsonb_typeof(ev.data -> 'reply' -> 'tool_calls') = 'array'
                    THEN jsonb_array_length(ev.data -> 'reply' -> 'tool_calls') ELSE 0 END AS tool_calls,
               ev.recorded_at,
               t.position,
               t.render_drift,
               ev.data ->> 'chat_template'                                             AS chat_template{train}
        FROM %1$I.turn_rows t
        LEFT JOIN %1$I.episodes e ON e.started_position = t.episode
        LEFT JOIN public.events ev ON ev.position = t.position
    $view$, target);
    EXECUTE format($view$
        CREATE OR REPLACE VIEW %1$I.samples AS
        SELECT s.turn_id::text || CASE WHEN s.path THEN '\:path' ELSE '' END   AS sample_id,
               e.episode_id,
               e.policy,
               coalesce(nullif(e.group_id, ''), e.episode_id)                AS group_id,
               s.slot,
               coalesce(s.turn_ids, ARRAY[s.turn_id])                        AS turn_ids,
               coalesce(s.policy_version, t.policy_version)                  AS policy_version,
               coalesce(s.tokens, t.prompt_tokens + t.completion_tokens)     AS tokens,
               coalesce(s.model_tokens, t.completion_tokens)                 AS model_tokens,
               coalesce(s.reward, t.discounted_return)                       AS reward,
               s.advantage,
               s.stale,
               s.arrays,
               s.ready_position,
               s.batch_id,
               e.finished_position                                           AS position
        FROM %1$I.sample_rows s
        JOIN %1$I.turn_rows t ON t.turn_id = s.turn_id
        JOIN %1$I.episodes e ON e.started_position = t.episode
    $view$, target);
    EXECUTE format('COMMENT ON VIEW %1$I.turns IS %2$L', target,
        'one row per folded turn: turn_rows (what the materializer derives) with its episode and the '
        'fields of its TurnCompleted event (events.data at position)');
    EXECUTE format('COMMENT ON VIEW %1$I.samples IS %2$L', target,
        'one row per training sample: sample_rows with its episode, and the values of its turn where the '
        'sample has the same (NULL in sample_rows)');
END
$fn$
"""

# The views of 0004 and 0009 that read turns (dropped with the column on downgrade, made again after).
DEPENDENT_VIEWS = """
    SELECT DISTINCT v.oid::regclass::text, pg_get_viewdef(v.oid), obj_description(v.oid, 'pg_class')
    FROM pg_depend d
    JOIN pg_rewrite r ON r.oid = d.objid
    JOIN pg_class v ON v.oid = r.ev_class
    WHERE d.refobjid = 'public.turns'::regclass AND v.oid <> 'public.turns'::regclass
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


def _views(train: str) -> None:
    op.execute(VIEWS_FUNCTION.replace("{train}", train))
    for schema in _schemas():
        op.execute(f"SELECT turnstile_read_model_views('{schema}')")


def upgrade() -> None:
    _views(",\n               " + TRAIN)


def downgrade() -> None:
    dependent = op.get_bind().exec_driver_sql(DEPENDENT_VIEWS).all()
    for name, _, _ in dependent:
        op.execute(f"DROP VIEW {name}")
    for schema in _schemas():
        op.execute(f'DROP VIEW "{schema}".turns')
    _views("")
    for name, definition, comment in dependent:
        op.execute(f"CREATE VIEW {name} AS {definition}")
        if comment is not None:
            quoted = comment.replace("'", "''")
            op.execute(f"COMMENT ON VIEW {name} IS '{quoted}'")
        op.execute(f"GRANT SELECT ON {name} TO {', '.join(READERS)}")
    op.execute(f"GRANT SELECT ON turns TO {', '.join(READERS)}")
