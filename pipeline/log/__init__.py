"""The event log: the store port with its PostgreSQL adapter (the record) and an in-memory adapter, the pure
append rules both share, token packing, the tables, consumer checkpoints and migrations."""

from pipeline.log.appends import decode_event, encode_event, validate_event
from pipeline.log.db import create_engine, migrate, migrate_async
from pipeline.log.memory import InMemoryStore
from pipeline.log.port import (
    AbandonedEpisode,
    AppendResult,
    EpisodeFilter,
    EpisodeIndex,
    EpisodeRow,
    RecordedEvent,
    RunnerLeases,
    Store,
)
from pipeline.log.store import EventStore, is_connection_error

__all__ = [
    "AbandonedEpisode",
    "AppendResult",
    "EpisodeFilter",
    "EpisodeIndex",
    "EpisodeRow",
    "EventStore",
    "InMemoryStore",
    "RecordedEvent",
    "RunnerLeases",
    "Store",
    "create_engine",
    "decode_event",
    "encode_event",
    "is_connection_error",
    "migrate",
    "migrate_async",
    "validate_event",
]
