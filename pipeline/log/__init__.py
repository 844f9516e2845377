"""The event log: the store port with its PostgreSQL adapter (the record) and an in-memory adapter, the pure
append rules both share, token packing, the tables, consumer checkpoints and migrations."""

from pipeline.log.appends import decode_event, encode_event, validate_event
from pipeline.log.db import READER_ROLE, Logins, create_engine, make_logins, migrate, migrate_async
from pipeline.log.json_text import JsonText
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
from pipeline.log.probe import DatabaseProbe
from pipeline.log.store import (
    EventStore,
    JsonTextBinaryDumper,
    is_connection_error,
)
from pipeline.log.tables import batches as batches_table
from pipeline.log.tables import episodes as episodes_table
from pipeline.log.tables import samples as samples_table
from pipeline.log.tables import trained_batches as trained_batches_table
from pipeline.log.tables import turns as turns_table
from pipeline.log.turns import (
    UnfoldableTurn,
    conversation,
    expand_turn,
    expand_turns,
    reply_message,
    turn_delta,
    whole_events,
)

__all__ = [
    "READER_ROLE",
    "AbandonedEpisode",
    "AppendResult",
    "DatabaseProbe",
    "EpisodeFilter",
    "EpisodeIndex",
    "EpisodeRow",
    "EventStore",
    "InMemoryStore",
    "JsonText",
    "JsonTextBinaryDumper",
    "Logins",
    "RecordedEvent",
    "RunnerLeases",
    "Store",
    "UnfoldableTurn",
    "batches_table",
    "conversation",
    "create_engine",
    "decode_event",
    "encode_event",
    "episodes_table",
    "expand_turn",
    "expand_turns",
    "is_connection_error",
    "make_logins",
    "migrate",
    "migrate_async",
    "reply_message",
    "samples_table",
    "trained_batches_table",
    "turn_delta",
    "turns_table",
    "validate_event",
    "whole_events",
]
