"""The episode browser at any size: rollups for the run pages, indexes for their recent batches, and a
full-text index over what turns say.

The run page read every episode of its policy four times (``episode_stats``, ``reward_by_policy_version``,
``terminations``, the throughput buckets) and every group twice (``group_rewards``): 774/917 ms p50/p95 at
200k turns, growing with the run. Now three rollup tables hold those sums, kept by a statement trigger on
``episodes`` from its transition tables (one upsert per statement, in the materializer's transaction: the
rollups commit with the rows they sum), and filled here from the episodes already there:

- ``run_rollups``: per policy, policy version (the episode's newest), status and termination: episodes,
  rewards (count, sum, sum of squares: mean and standard deviation; min and max), turns, tokens, durations,
  first start and last finish. The run page reads a few hundred rows at most.
- ``throughput_rollups``: finished episodes and their turns per policy and second (``width_s`` 1) and
  minute (60): the throughput chart reads at most one row per second of a short run, per minute of a long one.
- ``group_rollups``: per group of a policy: episodes, finished, reward sums, min and max, last finish (the
  reward spread of the last 2,000 finished groups, by the index on ``(policy, last_finished_at)``).

Rewards are summed as given; min and max only grow (the materializer writes an episode's reward once, when it
finishes). Rebuild schemas (``rm_<name>``) get no trigger: the browser reads ``public``.

Also: ``batches (policy, created_at)`` and ``trained_batches (policy, trained_at)`` for the run page's last
500 batches, and ``events_turn_text``: a GIN index of ``turnstile_turn_text(data)`` over ``TurnCompleted``
events, for the browser's search (``/search``).

Revision ID: 0022
Revises: 0021
Create Date: 2026-11-27
"""

from collections.abc import Sequence

from alembic import op

from migrations.objects import replace

revision: str = "0022"
down_revision: str | None = "0021"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TABLES: dict[str, str] = {
    "run_rollups": """
        policy            text             NOT NULL,
        policy_version    integer,
        status            text             NOT NULL,
        termination       text,
        episodes          bigint           NOT NULL,
        rewarded          bigint           NOT NULL,
        reward_sum        double precision NOT NULL,
        reward_sumsq      double precision NOT NULL,
        reward_min        double precision,
        reward_max        double precision,
        counted_turns     bigint           NOT NULL,
        turns             bigint           NOT NULL,
        prompt_tokens     bigint           NOT NULL,
        completion_tokens bigint           NOT NULL,
        timed             bigint           NOT NULL,
        duration_sum      double precision NOT NULL,
        first_started_at  timestamptz,
        last_finished_at  timestamptz,
        UNIQUE NULLS NOT DISTINCT (policy, policy_version, status, termination)
    """,
    "throughput_rollups": """
        policy   text        NOT NULL,
        width_s  integer     NOT NULL CHECK (width_s IN (1, 60)),
        bucket   timestamptz NOT NULL,
        episodes bigint      NOT NULL,
        turns    bigint      NOT NULL,
        PRIMARY KEY (policy, width_s, bucket)
    """,
    "group_rollups": """
        policy       text             NOT NULL,
        group_id     text             NOT NULL,
        episodes     bigint           NOT NULL,
        finished     bigint           NOT NULL,
        rewarded     bigint           NOT NULL,
        reward_sum   double precision NOT NULL,
        reward_sumsq double precision NOT NULL,
        reward_min   double precision,
        reward_max   double precision,
        last_finished_at timestamptz,
        PRIMARY KEY (policy, group_id)
    """,
}
INDEXES: dict[str, str] = {
    "group_rollups_recent": "group_rollups (policy, last_finished_at DESC NULLS LAST)",
    "batches_policy_created": "batches (policy, created_at DESC)",
    "trained_batches_policy_trained": "trained_batches (policy, trained_at DESC)",
    "events_turn_text": "events USING gin (turnstile_turn_text(data)) WHERE type = 'TurnCompleted'",
}
EVENTS = {"insert": "NEW TABLE AS new_rows", "update": "OLD TABLE AS old_rows NEW TABLE AS new_rows"}
EVENTS["delete"] = "OLD TABLE AS old_rows"


def upgrade() -> None:
    for name, columns in TABLES.items():
        op.execute(f"CREATE TABLE {name} ({columns})")
    replace("turnstile_episode_rollups_sql", 1)
    replace("turnstile_episode_rollups", 1)
    op.execute("REVOKE ALL ON FUNCTION turnstile_episode_rollups() FROM PUBLIC")
    # A trigger with transition tables fires on one kind of statement only: one each.
    for event, tables in EVENTS.items():
        op.execute(
            f"CREATE TRIGGER episodes_rollups_{event} AFTER {event.upper()} ON episodes "
            f"REFERENCING {tables} FOR EACH STATEMENT EXECUTE FUNCTION turnstile_episode_rollups()"
        )
    op.execute(
        "DO $$ BEGIN EXECUTE turnstile_episode_rollups_sql('public', "
        "'SELECT 1 AS sign, * FROM public.episodes'); END $$"
    )
    replace("turnstile_turn_text", 1)
    for name, definition in INDEXES.items():
        op.execute(f"CREATE INDEX {name} ON {definition}")


def downgrade() -> None:
    for name in reversed(INDEXES):
        op.execute(f"DROP INDEX {name}")
    op.execute("DROP FUNCTION turnstile_turn_text(jsonb)")
    for event in reversed(EVENTS):
        op.execute(f"DROP TRIGGER episodes_rollups_{event} ON episodes")
    op.execute("DROP FUNCTION turnstile_episode_rollups()")
    op.execute("DROP FUNCTION turnstile_episode_rollups_sql(text, text)")
    for name in reversed(TABLES):
        op.execute(f"DROP TABLE {name}")
