"""Read-only SQL over the log and read models (``turnstile sql``): one statement, as the reader role, in a
read-only transaction that is always rolled back; results as a table, CSV or JSON."""

from pipeline.sql.episodes import episode_ids_where
from pipeline.sql.readonly import (
    READ_MODELS,
    READER_ROLE,
    QueryResult,
    ReadOnlyViolation,
    SqlError,
    run_readonly,
    to_csv,
    to_json,
    to_table,
)

__all__ = [
    "READER_ROLE",
    "READ_MODELS",
    "QueryResult",
    "ReadOnlyViolation",
    "SqlError",
    "episode_ids_where",
    "run_readonly",
    "to_csv",
    "to_json",
    "to_table",
]
