"""Narrow read models: ``turns`` and ``samples`` become views over narrow tables that reference the log and
each other instead of copying them.

Measured with ``bench/storage.py`` before this change, a turn left ~500 bytes of read models beside the
~3 KB it adds to the log (a ``turns`` row of ~215 bytes, a ``samples`` row of ~280): ids held as text and
fields copied from the event or from the episode. Now:

- ``turn_rows`` keeps what the materializer derives (the turn tree's parent, token counts of the whole turn,
  rewards and returns, mean logprob), the episode as ``episodes.started_position`` (8 bytes instead of the
  id as text) and the event's ``position``; the rest (finish reason, engine, timings, tool calls, recorded
  parent, chat template, recorded_at) is read from the event itself (``events.data``) by the view ``turns``.
- ``sample_rows`` is keyed by the sample's own turn (a concat sample: its leaf); episode, policy, group and
  position come from the episode, and a value equal to the turn's (reward = its discounted return, policy
  version, tokens = prompt + completion, model tokens = completion) is NULL, read from the turn by the view
  ``samples``; ``turn_ids`` is NULL for a sample of one turn.

The views ``turns`` and ``samples`` have the columns and types the tables had, so every reader (the SQL
views, ``turnstile sql``, the episode browser, docs/queries.sql) reads them as before. The function
``turnstile_read_model_views(schema)`` makes both views in a schema: rebuilds (``rm_<name>``) call it after
making their tables ``LIKE`` these.

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-25
"""

from collections.abc import Sequence

from alembic import op

from migrations.objects import replace

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

MATERIALIZER = "turnstile_materializer"
READERS = ("turnstile_writer", "turnstile_materializer", "turnstile_reader")

TURN_ROWS = """
    CREATE TABLE {schema}.turn_rows (
        turn_id           uuid             PRIMARY KEY,
        episode           bigint           NOT NULL,
        position          bigint           NOT NULL,
        mean_logprob      double precision,
        reward            double precision NOT NULL,
        discounted_return double precision NOT NULL,
        turn_index        integer          NOT NULL,
        prompt_tokens     integer          NOT NULL,
        completion_tokens integer          NOT NULL,
        policy_version    integer          NOT NULL,
        parent_turn_id    uuid,
        prefix_break      boolean          NOT NULL,
        render_drift      boolean,
        UNIQUE (episode, turn_index)
    )
"""
SAMPLE_ROWS = """
    CREATE TABLE {schema}.sample_rows (
        turn_id        uuid             PRIMARY KEY,
        ready_position bigint,
        advantage      double precision,
        reward         double precision,
        slot           integer          NOT NULL DEFAULT 0,
        policy_version integer,
        tokens         integer,
        model_tokens   integer,
        stale          boolean          NOT NULL DEFAULT false,
        path           boolean          NOT NULL DEFAULT false,
        batch_id       text,
        turn_ids       uuid[],
        arrays         bytea
    )
"""
INDEXES = (
    "CREATE INDEX turn_rows_prefix_break ON {schema}.turn_rows (episode) WHERE prefix_break",
    "CREATE INDEX turn_rows_render_drift ON {schema}.turn_rows (episode) WHERE render_drift",
    "CREATE INDEX sample_rows_unbatched ON {schema}.sample_rows (ready_position) WHERE batch_id IS NULL",
    "CREATE INDEX sample_rows_batch ON {schema}.sample_rows (batch_id)",
    "CREATE UNIQUE INDEX episodes_started_position ON {schema}.episodes (started_position)",
)

# The views, made by a SQL function so that a rebuild's schema gets the same ones
# (migrations/sql/turnstile_read_model_views/v1.sql). LEFT JOINs on unique keys: a query that reads no column
# of the joined table does not join it (PostgreSQL removes the join).


# The views of 0004 and 0009 that read turns or samples: dropped with the tables, made again over the views.
DEPENDENT_VIEWS = """
    SELECT DISTINCT v.oid::regclass::text, pg_get_viewdef(v.oid), obj_description(v.oid, 'pg_class')
    FROM pg_depend d
    JOIN pg_rewrite r ON r.oid = d.objid
    JOIN pg_class v ON v.oid = r.ev_class
    WHERE d.refobjid IN ({tables}) AND v.oid NOT IN ({tables})
"""


def _schemas() -> list[str]:
    connection = op.get_bind()
    rows = connection.exec_driver_sql(
        "SELECT schema_name FROM materializers WHERE schema_name <> 'public' "
        "AND schema_name IN (SELECT nspname FROM pg_namespace)"
    ).all()
    return ["public", *(row[0] for row in rows)]


def _dependent_views(tables: Sequence[str]) -> list[tuple[str, str, str | None]]:
    listed = ", ".join(f"'{table}'::regclass" for table in tables)
    rows = op.get_bind().exec_driver_sql(DEPENDENT_VIEWS.format(tables=listed)).all()
    return [(row[0], row[1], row[2]) for row in rows]


def _make_views_again(views: list[tuple[str, str, str | None]]) -> None:
    for name, definition, comment in views:
        op.execute(f"CREATE VIEW {name} AS {definition}")
        if comment is not None:
            quoted = comment.replace("'", "''")
            op.execute(f"COMMENT ON VIEW {name} IS '{quoted}'")
        op.execute(f"GRANT SELECT ON {name} TO {', '.join(READERS)}")


def upgrade() -> None:
    replace("turnstile_read_model_views", 1)
    dependent = _dependent_views(("public.turns", "public.samples"))
    for name, _, _ in dependent:
        op.execute(f"DROP VIEW {name}")
    for schema in _schemas():
        quoted = f'"{schema}"'
        op.execute(TURN_ROWS.format(schema=quoted))
        op.execute(SAMPLE_ROWS.format(schema=quoted))
        op.execute(
            f"""
            INSERT INTO {quoted}.turn_rows
            SELECT t.turn_id, e.started_position, t.position, t.mean_logprob, t.reward, t.discounted_return,
                   t.turn_index, t.prompt_tokens, t.completion_tokens, t.policy_version, t.parent_turn_id,
                   t.prefix_break, t.render_drift
            FROM {quoted}.turns t JOIN {quoted}.episodes e USING (episode_id)
            """
        )
        op.execute(
            f"""
            INSERT INTO {quoted}.sample_rows
            SELECT t.turn_id, s.ready_position, s.advantage,
                   nullif(s.reward, t.discounted_return), s.slot, nullif(s.policy_version, t.policy_version),
                   nullif(s.tokens, t.prompt_tokens + t.completion_tokens),
                   nullif(s.model_tokens, t.completion_tokens), s.stale, right(s.sample_id, 5) = '\\:path',
                   s.batch_id, CASE WHEN s.turn_ids = ARRAY[t.turn_id] THEN NULL ELSE s.turn_ids END, s.arrays
            FROM {quoted}.samples s
            JOIN {quoted}.turn_rows t ON t.turn_id = split_part(s.sample_id, '\\:', 1)::uuid
            """
        )
        op.execute(f"DROP TABLE {quoted}.turns, {quoted}.samples")
        for index in INDEXES:
            op.execute(index.format(schema=quoted))
        op.execute(f"SELECT turnstile_read_model_views('{schema}')")
    for table in ("turn_rows", "sample_rows"):
        op.execute(f"GRANT INSERT, UPDATE ON {table} TO {MATERIALIZER}")
        op.execute(f"GRANT SELECT ON {table} TO {', '.join(READERS)}")
    op.execute(f"GRANT SELECT ON turns, samples TO {', '.join(READERS)}")
    _make_views_again(dependent)


OLD_TURNS = """
    CREATE TABLE {schema}.turns (
        turn_id uuid PRIMARY KEY, episode_id text NOT NULL, turn_index integer NOT NULL, parent_turn_id uuid,
        recorded_parent uuid, prompt_tokens integer NOT NULL, completion_tokens integer NOT NULL,
        finish_reason text NOT NULL, policy_version integer NOT NULL, engine_id text NOT NULL,
        queued_ms double precision NOT NULL, first_token_ms double precision NOT NULL,
        latency_ms double precision NOT NULL, mean_logprob double precision, reward double precision NOT NULL,
        discounted_return double precision NOT NULL, prefix_break boolean NOT NULL,
        tool_calls integer NOT NULL,
        recorded_at timestamptz NOT NULL, position bigint NOT NULL, render_drift boolean, chat_template text,
        UNIQUE (episode_id, turn_index)
    )
"""
OLD_SAMPLES = """
    CREATE TABLE {schema}.samples (
        sample_id text PRIMARY KEY, episode_id text NOT NULL, policy text NOT NULL, group_id text NOT NULL,
        slot integer NOT NULL DEFAULT 0, turn_ids uuid[] NOT NULL, policy_version integer NOT NULL,
        tokens integer NOT NULL, model_tokens integer NOT NULL, reward double precision NOT NULL,
        advantage double precision, stale boolean NOT NULL DEFAULT false, arrays bytea,
        ready_position bigint, batch_id text, position bigint NOT NULL
    )
"""
OLD_INDEXES = (
    "CREATE INDEX samples_group ON {schema}.samples (group_id)",
    "CREATE INDEX samples_unbatched ON {schema}.samples (policy, ready_position) WHERE batch_id IS NULL",
    "CREATE INDEX samples_batch ON {schema}.samples (batch_id)",
    "CREATE INDEX turns_prefix_break ON {schema}.turns (episode_id) WHERE prefix_break",
    "CREATE INDEX turns_render_drift ON {schema}.turns (episode_id) WHERE render_drift",
    "CREATE INDEX samples_episode ON {schema}.samples (episode_id)",
)


def downgrade() -> None:
    dependent = _dependent_views(("public.turns", "public.samples"))
    for name, _, _ in dependent:
        op.execute(f"DROP VIEW {name}")
    for schema in _schemas():
        quoted = f'"{schema}"'
        op.execute(f"ALTER VIEW {quoted}.turns RENAME TO turns_view")
        op.execute(f"ALTER VIEW {quoted}.samples RENAME TO samples_view")
        op.execute(OLD_TURNS.format(schema=quoted))
        op.execute(OLD_SAMPLES.format(schema=quoted))
        op.execute(f"INSERT INTO {quoted}.turns SELECT * FROM {quoted}.turns_view")
        op.execute(f"INSERT INTO {quoted}.samples SELECT * FROM {quoted}.samples_view")
        op.execute(f"DROP VIEW {quoted}.turns_view, {quoted}.samples_view")
        op.execute(f"DROP TABLE {quoted}.turn_rows, {quoted}.sample_rows")
        op.execute(f"DROP INDEX {quoted}.episodes_started_position")
        for index in OLD_INDEXES:
            op.execute(index.format(schema=quoted))
    op.execute("GRANT INSERT, UPDATE ON turns, samples TO turnstile_materializer")
    op.execute(f"GRANT SELECT ON turns, samples TO {', '.join(READERS)}")
    _make_views_again(dependent)
    op.execute("DROP FUNCTION turnstile_read_model_views(text)")
