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
