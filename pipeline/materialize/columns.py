"""The read models' columns as the materializer writes them (COPY order and binary types)."""

from __future__ import annotations

from typing import Final, NamedTuple

EPISODE_COLUMNS: Final = (
    "episode_id", "stream", "policy", "agent", "task_id", "group_id", "group_size", "retry_of", "tags",
    "status", "termination", "error", "reward", "turns", "prompt_tokens", "completion_tokens",
    "min_policy_version", "max_policy_version", "started_at", "finished_at", "duration_s",
    "started_position", "finished_position",
)  # fmt: skip
TURN_COLUMNS: Final = (
    "turn_id", "episode", "position", "mean_logprob", "reward", "discounted_return", "turn_index",
    "prompt_tokens", "completion_tokens", "policy_version", "parent_turn_id", "prefix_break", "render_drift",
    "delivered", "trained", "lineage", "root_reason",
)  # fmt: skip
"""``turn_rows``: what the fold derives; the view ``turns`` reads the rest from the event at ``position``."""
SAMPLE_COLUMNS: Final = (
    "turn_id", "ready_position", "advantage", "reward", "slot", "policy_version", "tokens", "model_tokens",
    "stale", "path", "batch_id", "turn_ids", "arrays",
)  # fmt: skip
"""``sample_rows``, keyed by the sample's own turn (a concat sample's leaf); a value equal to that turn's is
NULL (the view ``samples`` reads it from the turn), and so are ``turn_ids`` when they are just that turn."""
BATCH_COLUMNS: Final = (
    "batch_id", "policy", "samples", "groups", "tokens", "stale_samples", "min_policy_version",
    "max_policy_version", "newest_version", "config_hash", "position", "created_at", "payload_bytes",
    "payload_sha256",
)  # fmt: skip
FINISHED_COLUMNS: Final = (
    "status", "termination", "error", "reward", "turns", "prompt_tokens", "completion_tokens",
    "min_policy_version", "max_policy_version", "finished_at", "duration_s", "finished_position",
)  # fmt: skip


class CopyColumns(NamedTuple):
    """A table's columns as the materializer COPYs them, and their PostgreSQL types (binary COPY)."""

    names: tuple[str, ...]
    types: tuple[str, ...]


EPISODE_COPY: Final = CopyColumns(EPISODE_COLUMNS, (
    "text", "text", "text", "text", "text", "text", "int4", "text", "jsonb", "text", "text", "text", "float8",
    "int4", "int8", "int8", "int4", "int4", "timestamptz", "timestamptz", "float8", "int8", "int8",
))  # fmt: skip
TURN_COPY: Final = CopyColumns(TURN_COLUMNS, (
    "uuid", "int8", "int8", "float8", "float8", "float8", "int4", "int4", "int4", "int4", "uuid", "bool",
    "bool", "bool", "bool", "uuid", "text",
))  # fmt: skip
SAMPLE_COPY: Final = CopyColumns(SAMPLE_COLUMNS, (
    "uuid", "int8", "float8", "float8", "int4", "int4", "int4", "int4", "bool", "bool", "text", "uuid[]",
    "bytea",
))  # fmt: skip
BATCH_COPY: Final = CopyColumns(BATCH_COLUMNS, (
    "text", "text", "int4", "int4", "int8", "int4", "int4", "int4", "int4", "text", "int8", "timestamptz",
    "int4", "bytea",
))  # fmt: skip
OUTBOX_COPY: Final = CopyColumns(
    ("batch_id", "subject", "payload", "created_at"), ("text", "text", "bytea", "timestamptz")
)
SKIPPED_COPY: Final = CopyColumns(
    ("position", "stream", "type", "episode_id", "reason"), ("int8", "text", "text", "text", "text")
)
FINISHED_INDEXES: Final = tuple(EPISODE_COLUMNS.index(c) for c in FINISHED_COLUMNS)
S_ADVANTAGE, S_STALE, S_READY, S_BATCH, S_ARRAYS = (
    SAMPLE_COLUMNS.index(column) for column in ("advantage", "stale", "ready_position", "batch_id", "arrays")
)
