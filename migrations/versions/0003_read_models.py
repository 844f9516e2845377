"""Read models of the materializer: episodes, turns, samples, batches, and the batch outbox.

A rebuild (``turnstile rematerialize --name NAME``) makes the same tables in a schema of its own
(``rm_<name>``, ``CREATE TABLE ... (LIKE public.<table> INCLUDING ALL)``), so this is the one definition.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-23
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Each materializer (the live one, "main", and every rebuild) records the configuration its read models
    # and batches were made with; it refuses to go on with another one (the batches would not add up).
    op.execute(
        """
        CREATE TABLE materializers (
            name        text        PRIMARY KEY,
            schema_name text        NOT NULL,
            config      jsonb       NOT NULL,
            config_hash text        NOT NULL,
            created_at  timestamptz NOT NULL DEFAULT now()
        )
        """
    )
    op.execute(
        """
        CREATE TABLE episodes (
            episode_id         text             PRIMARY KEY,
            stream             text             NOT NULL,
            policy             text             NOT NULL,
            agent              text             NOT NULL,
            task_id            text             NOT NULL,
            group_id           text,
            group_size         integer          NOT NULL DEFAULT 1,
            retry_of           text,
            tags               jsonb            NOT NULL DEFAULT '{}'::jsonb,
            status             text             NOT NULL CHECK (status IN ('running', 'finished')),
            termination        text,
            error              text,
            reward             double precision,
            turns              integer,
            prompt_tokens      bigint,
            completion_tokens  bigint,
            min_policy_version integer,
            max_policy_version integer,
            started_at         timestamptz      NOT NULL,
            finished_at        timestamptz,
            duration_s         double precision,
            started_position   bigint           NOT NULL,
            finished_position  bigint
        )
        """
    )
    op.execute("CREATE INDEX episodes_policy_started ON episodes (policy, started_at)")
    op.execute("CREATE INDEX episodes_group ON episodes (group_id)")
    op.execute("CREATE INDEX episodes_running ON episodes (status) WHERE status = 'running'")
    op.execute(
        """
        CREATE TABLE turns (
            turn_id           uuid             PRIMARY KEY,
            episode_id        text             NOT NULL,
            turn_index        integer          NOT NULL,
            parent_turn_id    uuid,
            recorded_parent   uuid,
            prompt_tokens     integer          NOT NULL,
            completion_tokens integer          NOT NULL,
            finish_reason     text             NOT NULL,
            policy_version    integer          NOT NULL,
            engine_id         text             NOT NULL,
            queued_ms         double precision NOT NULL,
            first_token_ms    double precision NOT NULL,
            latency_ms        double precision NOT NULL,
            mean_logprob      double precision,
            reward            double precision NOT NULL,
            discounted_return double precision NOT NULL,
            prefix_break      boolean          NOT NULL,
            tool_calls        integer          NOT NULL,
            recorded_at       timestamptz      NOT NULL,
            position          bigint           NOT NULL,
            UNIQUE (episode_id, turn_index)
        )
        """
    )
    op.execute(
        """
        CREATE TABLE samples (
            sample_id      text             PRIMARY KEY,
            episode_id     text             NOT NULL,
            policy         text             NOT NULL,
            group_id       text             NOT NULL,
            slot           integer          NOT NULL DEFAULT 0,
            turn_ids       uuid[]           NOT NULL,
            policy_version integer          NOT NULL,
            tokens         integer          NOT NULL,
            model_tokens   integer          NOT NULL,
            reward         double precision NOT NULL,
            advantage      double precision,
            stale          boolean          NOT NULL DEFAULT false,
            arrays         bytea            NOT NULL,
            ready_position bigint,
            batch_id       text,
            position       bigint           NOT NULL
        )
        """
    )
    op.execute(
        "COMMENT ON COLUMN samples.slot IS 'the sample''s place in its episode (turn index; path index for "
        "concat samples): advantages compare samples of the same slot across the group'"
    )
    op.execute(
        "COMMENT ON COLUMN samples.arrays IS 'input ids (int32), loss mask (uint8), logprobs (float32)'"
    )
    op.execute("CREATE INDEX samples_group ON samples (group_id)")
    op.execute("CREATE INDEX samples_unbatched ON samples (policy, ready_position) WHERE batch_id IS NULL")
    op.execute("CREATE INDEX samples_batch ON samples (batch_id)")
    op.execute(
        """
        CREATE TABLE batches (
            batch_id           text        PRIMARY KEY,
            policy             text        NOT NULL,
            samples            integer     NOT NULL,
            groups             integer     NOT NULL,
            tokens             bigint      NOT NULL,
            stale_samples      integer     NOT NULL,
            min_policy_version integer     NOT NULL,
            max_policy_version integer     NOT NULL,
            newest_version     integer     NOT NULL,
            config_hash        text        NOT NULL,
            position           bigint      NOT NULL,
            created_at         timestamptz NOT NULL,
            published_at       timestamptz
        )
        """
    )
    # The transactional outbox: a batch is written here in the same transaction as its samples and the
    # checkpoint; the relay publishes it to JetStream and only then sets published_at.
    op.execute(
        """
        CREATE TABLE batch_outbox (
            batch_id     text        PRIMARY KEY,
            subject      text        NOT NULL,
            payload      bytea       NOT NULL,
            created_at   timestamptz NOT NULL DEFAULT now(),
            published_at timestamptz
        )
        """
    )
    op.execute(
        "CREATE INDEX batch_outbox_unpublished ON batch_outbox (created_at) WHERE published_at IS NULL"
    )


def downgrade() -> None:
    for table in ("batch_outbox", "batches", "samples", "turns", "episodes", "materializers"):
        op.execute(f"DROP TABLE {table}")
