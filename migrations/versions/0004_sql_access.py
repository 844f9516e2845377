"""Views for the usual questions, and the read-only role ``turnstile sql`` runs its queries as.

The views summarize the live read models (the public tables). A rebuild's schema ``rm_<name>`` holds tables
only: query them directly (``turnstile sql --schema NAME``).

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-24
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

READER = "turnstile_reader"

# name -> (comment, definition). Every view is a plain aggregate over the read models, so an empty table
# gives an empty view; averages are double precision (never numeric) so clients get floats.
VIEWS: dict[str, tuple[str, str]] = {
    "episode_stats": (
        "per policy: episodes (running, finished), mean reward of those with one, mean turns, tokens",
        """
        SELECT policy,
               count(*)                                                          AS episodes,
               count(*) FILTER (WHERE status = 'running')                        AS running,
               count(*) FILTER (WHERE status = 'finished')                       AS finished,
               avg(reward)                                                       AS mean_reward,
               avg(turns)::double precision                                      AS mean_turns,
               coalesce(sum(prompt_tokens), 0)::bigint                           AS prompt_tokens,
               coalesce(sum(completion_tokens), 0)::bigint                       AS completion_tokens,
               (coalesce(sum(prompt_tokens), 0) + coalesce(sum(completion_tokens), 0))::bigint AS tokens,
               avg(duration_s)                                                   AS mean_duration_s,
               min(started_at)                                                   AS first_started_at,
               max(finished_at)                                                  AS last_finished_at
        FROM episodes
        GROUP BY policy
        """,
    ),
    "reward_by_policy_version": (
        "finished episodes per policy and newest policy version they were sampled with: reward statistics "
        "(stddev_reward is the sample standard deviation, NULL for a single episode)",
        """
        SELECT policy,
               max_policy_version   AS policy_version,
               count(*)             AS episodes,
               count(reward)        AS rewarded,
               avg(reward)          AS mean_reward,
               stddev_samp(reward)  AS stddev_reward,
               min(reward)          AS min_reward,
               max(reward)          AS max_reward
        FROM episodes
        WHERE status = 'finished'
        GROUP BY policy, max_policy_version
        """,
    ),
    "group_rewards": (
        "per group of episodes (same task, sampled together): reward spread; zero_spread groups give "
        "group-relative advantages of 0",
        """
        SELECT group_id,
               policy,
               min(task_id)                                  AS task_id,
               count(*)                                      AS episodes,
               count(*) FILTER (WHERE status = 'finished')   AS finished,
               avg(reward)                                   AS mean_reward,
               stddev_pop(reward)                            AS stddev_reward,
               min(reward)                                   AS min_reward,
               max(reward)                                   AS max_reward,
               coalesce(max(reward) = min(reward), false)    AS zero_spread
        FROM episodes
        WHERE group_id IS NOT NULL
        GROUP BY group_id, policy
        """,
    ),
    "turn_latency_by_consumer": (
        "per inference consumer (engine_id): latency percentiles of its turns, in milliseconds",
        """
        SELECT engine_id,
               count(*)                                                        AS turns,
               percentile_cont(0.5) WITHIN GROUP (ORDER BY latency_ms)         AS p50_latency_ms,
               percentile_cont(0.95) WITHIN GROUP (ORDER BY latency_ms)        AS p95_latency_ms,
               percentile_cont(0.99) WITHIN GROUP (ORDER BY latency_ms)        AS p99_latency_ms,
               avg(latency_ms)                                                 AS mean_latency_ms,
               max(latency_ms)                                                 AS max_latency_ms,
               percentile_cont(0.5) WITHIN GROUP (ORDER BY first_token_ms)     AS p50_first_token_ms,
               percentile_cont(0.95) WITHIN GROUP (ORDER BY queued_ms)         AS p95_queued_ms,
               sum(completion_tokens)::bigint                                  AS completion_tokens
        FROM turns
        GROUP BY engine_id
        """,
    ),
    "prefix_break_rate_by_agent": (
        "per agent: turns whose prompt could not extend the previous turn's exact tokens (prefix_break)",
        """
        SELECT e.agent,
               count(DISTINCT t.episode_id)                                         AS episodes,
               count(*)                                                             AS turns,
               count(*) FILTER (WHERE t.prefix_break)                               AS prefix_breaks,
               (count(*) FILTER (WHERE t.prefix_break))::double precision / count(*) AS prefix_break_rate
        FROM turns t
        JOIN episodes e USING (episode_id)
        GROUP BY e.agent
        """,
    ),
    "batch_staleness": (
        "per batch: how many policy versions its samples lag the newest version at batch time",
        """
        SELECT b.batch_id,
               b.policy,
               b.created_at,
               b.samples,
               b.groups,
               b.tokens,
               b.newest_version,
               b.min_policy_version,
               b.max_policy_version,
               b.newest_version - b.min_policy_version                        AS max_staleness,
               b.newest_version - b.max_policy_version                        AS min_staleness,
               s.mean_staleness,
               b.stale_samples,
               b.stale_samples::double precision / nullif(b.samples, 0)       AS stale_fraction,
               b.published_at,
               extract(epoch FROM b.published_at - b.created_at)::double precision AS publish_delay_s
        FROM batches b
        LEFT JOIN LATERAL (
            SELECT avg(b.newest_version - samples.policy_version)::double precision AS mean_staleness
            FROM samples
            WHERE samples.batch_id = b.batch_id
        ) s ON true
        """,
    ),
    "terminations": (
        "finished episodes per policy and termination reason, with each reason's share of the policy",
        """
        SELECT policy,
               termination,
               count(*) AS episodes,
               count(*)::double precision
                   / sum(count(*)) OVER (PARTITION BY policy)::double precision AS share
        FROM episodes
        WHERE status = 'finished'
        GROUP BY policy, termination
        """,
    ),
}


def upgrade() -> None:
    for name, (comment, definition) in VIEWS.items():
        op.execute(f"CREATE VIEW {name} AS {definition}")
        quoted = comment.replace("'", "''")
        op.execute(f"COMMENT ON VIEW {name} IS '{quoted}'")
    # Roles belong to the server, not to a database: another database on this server (the tests make one
    # per test) may have created it already, maybe concurrently (the migration lock is per database).
    op.execute(
        f"""
        DO $$
        BEGIN
            IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '{READER}') THEN
                CREATE ROLE {READER} NOLOGIN;
            END IF;
        EXCEPTION
            WHEN duplicate_object OR unique_violation THEN NULL;
            WHEN insufficient_privilege THEN
                RAISE EXCEPTION 'creating role {READER} needs CREATEROLE'
                    USING HINT = 'ask an administrator to run: CREATE ROLE {READER} NOLOGIN; '
                                 || 'GRANT {READER} TO ' || current_user || '; then migrate again';
        END
        $$
        """
    )
    # turnstile sql connects as the configured user and switches to the reader with SET LOCAL ROLE, which
    # needs membership. A superuser may switch anyway; granting is harmless and keeps working if it is
    # demoted. Where the role exists and we may not grant it, the migration goes on: say what to do.
    op.execute(
        f"""
        DO $$
        BEGIN
            GRANT {READER} TO CURRENT_USER;
        EXCEPTION
            WHEN insufficient_privilege THEN
                RAISE WARNING 'could not grant {READER} to %: turnstile sql will refuse to run', current_user
                    USING HINT = 'ask an administrator to run: GRANT {READER} TO ' || current_user;
        END
        $$
        """
    )
    op.execute(f"GRANT USAGE ON SCHEMA public TO {READER}")
    op.execute(f"GRANT SELECT ON ALL TABLES IN SCHEMA public TO {READER}")
    # Tables and schemas this user creates later in this database (later migrations, rebuild schemas
    # rm_<name>) are readable too.
    op.execute(f"ALTER DEFAULT PRIVILEGES GRANT SELECT ON TABLES TO {READER}")
    op.execute(f"ALTER DEFAULT PRIVILEGES GRANT USAGE ON SCHEMAS TO {READER}")


def downgrade() -> None:
    op.execute(f"ALTER DEFAULT PRIVILEGES REVOKE USAGE ON SCHEMAS FROM {READER}")
    op.execute(f"ALTER DEFAULT PRIVILEGES REVOKE SELECT ON TABLES FROM {READER}")
    op.execute(f"REVOKE SELECT ON ALL TABLES IN SCHEMA public FROM {READER}")
    op.execute(f"REVOKE USAGE ON SCHEMA public FROM {READER}")
    for name in reversed(VIEWS):
        op.execute(f"DROP VIEW {name}")
    # The role and its membership stay: roles are shared by every database on the server, and other
    # databases may still grant to it (DROP ROLE would fail there, or break their turnstile sql).
