"""The tables, declared once (SQLAlchemy Core) for querying; only ``migrations/`` creates them."""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import BYTEA, JSONB, UUID

metadata = sa.MetaData()

events = sa.Table(
    "events",
    metadata,
    sa.Column("position", sa.BigInteger, primary_key=True, autoincrement=False),
    sa.Column("stream", sa.Text, nullable=False),
    sa.Column("category", sa.Text, sa.Computed("split_part(stream, '-', 1)")),
    sa.Column("version", sa.Integer, nullable=False),
    sa.Column("event_id", UUID(as_uuid=True), nullable=False, unique=True),
    sa.Column("type", sa.Text, nullable=False),
    sa.Column("data", JSONB, nullable=False),
    sa.Column("tokens", BYTEA),
    sa.Column("metadata", JSONB, nullable=False),
    sa.Column("content_hash", BYTEA, nullable=False),
    sa.Column("recorded_at", sa.DateTime(timezone=True), nullable=False),
)

checkpoints = sa.Table(
    "checkpoints",
    metadata,
    sa.Column("name", sa.Text, primary_key=True),
    sa.Column("position", sa.BigInteger, nullable=False),
    sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
)

runners = sa.Table(
    "runners",
    metadata,
    sa.Column("runner_id", sa.Text, primary_key=True),
    sa.Column("host", sa.Text, nullable=False),
    sa.Column("pid", sa.Integer, nullable=False),
    sa.Column("started_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
    sa.Column("heartbeat_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
    sa.Column("stopped_at", sa.DateTime(timezone=True)),
)

trained_batches = sa.Table(
    "trained_batches",
    metadata,
    sa.Column("trainer", sa.Text, primary_key=True),
    sa.Column("batch_id", sa.Text, primary_key=True),
    sa.Column("policy", sa.Text, nullable=False),
    sa.Column("policy_version", sa.Integer, nullable=False),
    sa.Column("outcome", sa.Text, nullable=False),
    sa.Column("loss", sa.Float),
    sa.Column("trained_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
)

# -- the materializer's read models (migrations 0003, 0009, 0013): declared here for readers (the episode
# browser); the materializer writes them with COPY and column lists of its own. ``turns`` and ``samples`` are
# views (0013) over the narrow tables ``turn_rows`` and ``sample_rows``, with these columns.

episodes = sa.Table(
    "episodes",
    metadata,
    sa.Column("episode_id", sa.Text, primary_key=True),
    sa.Column("stream", sa.Text, nullable=False),
    sa.Column("policy", sa.Text, nullable=False),
    sa.Column("agent", sa.Text, nullable=False),
    sa.Column("task_id", sa.Text, nullable=False),
    sa.Column("group_id", sa.Text),
    sa.Column("group_size", sa.Integer, nullable=False),
    sa.Column("retry_of", sa.Text),
    sa.Column("tags", JSONB, nullable=False),
    sa.Column("status", sa.Text, nullable=False),
    sa.Column("termination", sa.Text),
    sa.Column("error", sa.Text),
    sa.Column("reward", sa.Float),
    sa.Column("turns", sa.Integer),
    sa.Column("prompt_tokens", sa.BigInteger),
    sa.Column("completion_tokens", sa.BigInteger),
    sa.Column("min_policy_version", sa.Integer),
    sa.Column("max_policy_version", sa.Integer),
    sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("finished_at", sa.DateTime(timezone=True)),
    sa.Column("duration_s", sa.Float),
    sa.Column("started_position", sa.BigInteger, nullable=False),
    sa.Column("finished_position", sa.BigInteger),
)

turns = sa.Table(
    "turns",
    metadata,
    sa.Column("turn_id", UUID(as_uuid=True), primary_key=True),
    sa.Column("episode_id", sa.Text, nullable=False),
    sa.Column("turn_index", sa.Integer, nullable=False),
    sa.Column("parent_turn_id", UUID(as_uuid=True)),
    sa.Column("recorded_parent", UUID(as_uuid=True)),
    sa.Column("prompt_tokens", sa.Integer, nullable=False),
    sa.Column("completion_tokens", sa.Integer, nullable=False),
    sa.Column("finish_reason", sa.Text, nullable=False),
    sa.Column("policy_version", sa.Integer, nullable=False),
    sa.Column("engine_id", sa.Text, nullable=False),
    sa.Column("queued_ms", sa.Float, nullable=False),
    sa.Column("first_token_ms", sa.Float, nullable=False),
    sa.Column("latency_ms", sa.Float, nullable=False),
    sa.Column("mean_logprob", sa.Float),
    sa.Column("reward", sa.Float, nullable=False),
    sa.Column("discounted_return", sa.Float, nullable=False),
    sa.Column("prefix_break", sa.Boolean, nullable=False),
    sa.Column("tool_calls", sa.Integer, nullable=False),
    sa.Column("recorded_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("position", sa.BigInteger, nullable=False),
    sa.Column("render_drift", sa.Boolean),
    sa.Column("chat_template", sa.Text),
    sa.Column("train", sa.Boolean),
    sa.Column("delivered", sa.Boolean),
    sa.Column("trained", sa.Boolean),
    sa.Column("lineage", UUID(as_uuid=True)),
    sa.Column("root_reason", sa.Text),
    sa.Column("model", sa.Text),
    sa.Column("edit", JSONB),
)

samples = sa.Table(
    "samples",
    metadata,
    sa.Column("sample_id", sa.Text, primary_key=True),
    sa.Column("episode_id", sa.Text, nullable=False),
    sa.Column("policy", sa.Text, nullable=False),
    sa.Column("group_id", sa.Text, nullable=False),
    sa.Column("slot", sa.Integer, nullable=False),
    sa.Column("turn_ids", sa.ARRAY(UUID(as_uuid=True)), nullable=False),
    sa.Column("policy_version", sa.Integer, nullable=False),
    sa.Column("tokens", sa.Integer, nullable=False),
    sa.Column("model_tokens", sa.Integer, nullable=False),
    sa.Column("reward", sa.Float, nullable=False),
    sa.Column("advantage", sa.Float),
    sa.Column("stale", sa.Boolean, nullable=False),
    sa.Column("arrays", BYTEA, nullable=False),
    sa.Column("ready_position", sa.BigInteger),
    sa.Column("batch_id", sa.Text),
    sa.Column("position", sa.BigInteger, nullable=False),
)

batches = sa.Table(
    "batches",
    metadata,
    sa.Column("batch_id", sa.Text, primary_key=True),
    sa.Column("policy", sa.Text, nullable=False),
    sa.Column("samples", sa.Integer, nullable=False),
    sa.Column("groups", sa.Integer, nullable=False),
    sa.Column("tokens", sa.BigInteger, nullable=False),
    sa.Column("stale_samples", sa.Integer, nullable=False),
    sa.Column("min_policy_version", sa.Integer, nullable=False),
    sa.Column("max_policy_version", sa.Integer, nullable=False),
    sa.Column("newest_version", sa.Integer, nullable=False),
    sa.Column("config_hash", sa.Text, nullable=False),
    sa.Column("position", sa.BigInteger, nullable=False),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("published_at", sa.DateTime(timezone=True)),
)
