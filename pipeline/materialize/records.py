"""What the fold reads (``LogRow``, and the query that reads it) and makes: samples, outcomes, writes."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Final, NamedTuple

from pipeline.materialize.packed import PackedTurn

USABLE: Final = frozenset({"done", "max_turns", "truncated"})
"""Terminations whose episodes become samples; error, timeout, cancelled and aborted ones do not."""


@dataclass(frozen=True, slots=True)
class LogRow:
    """An event as the fold reads it."""

    position: int
    stream: str
    type: str
    data: dict[str, Any]
    tokens: bytes | None
    recorded_at: datetime


UNFOLDED_FIELDS: Final = ("request", "task", "sampling", "metrics", "event_id", "schema_version", "type")
"""Fields of ``events.data`` the fold never reads (nor ``reply.text``): ``Materializer._read`` leaves them in
PostgreSQL. A turn's request is most of its data; what is left is a few hundred bytes of JSON. Of the
request, the lineage rule needs only whether it offered tools: a turn's data gets ``offers_tools`` instead."""
FOLDED_DATA: Final = (
    "(CASE WHEN jsonb_typeof(data) <> 'object' THEN data "
    "WHEN jsonb_typeof(data -> 'reply') = 'object' THEN (data - %(unfolded)s::text[] #- '{reply,text}') "
    "|| jsonb_build_object('offers_tools', jsonb_typeof(data #> '{request,tools}') = 'array' "
    "AND data #> '{request,tools}' <> '[]'::jsonb) "
    "ELSE data - %(unfolded)s::text[] END)::text"
)


@dataclass(slots=True)
class ReadySample:
    """A sample waiting for its group, or for a batch."""

    sample_id: str
    episode_id: str
    group_id: str
    policy: str
    turn_ids: tuple[str, ...]
    policy_version: int
    tokens: int
    reward: float
    arrays: bytes
    position: int
    slot: int = 0
    advantage: float | None = None

    @property
    def key(self) -> str:
        """The sample's own turn (its last: a concat sample's leaf), which keys its ``sample_rows`` row."""
        return self.turn_ids[-1]


class NewSample(NamedTuple):
    """A sample as an episode's end makes it (``trajectory.Sample`` less its sequences, arrays packed)."""

    sample_id: str
    turns: tuple[PackedTurn, ...]
    policy_version: int
    reward: float
    tokens: int
    model_tokens: int
    arrays: bytes


class Finished(NamedTuple):
    """What an episode's end gives the group half of the fold (``Fold.take``)."""

    policy: str
    version: int | None
    """The newest policy version of its turns (None: it has none)."""
    group_id: str | None
    """None: it makes no samples (not usable)."""
    size: int
    episode_id: str
    samples: list[tuple[ReadySample, list[Any]]]
    """Its samples, each with its new ``sample_rows`` row."""


class Published(NamedTuple):
    """A ``PolicyVersionPublished`` as the group half takes it."""

    policy: str
    version: int


Outcome = Finished | Published


@dataclass(slots=True)
class PendingGroup:
    policy: str
    group_id: str
    size: int
    last_time: datetime
    episodes: set[str] = field(default_factory=set)
    samples: list[ReadySample] = field(default_factory=list)


@dataclass
class Writes:
    """What one step produced, written in one transaction. Rows are lists so a later event of the same
    step can still change them (an episode that starts and finishes in one step is one INSERT)."""

    episodes: dict[str, list[Any]] = field(default_factory=dict)
    """New episodes rows by stream (not by episode id: two streams that claim one episode id must both reach
    the table, whose primary key refuses the second; see ``Materializer._fold_one_at_a_time``)."""
    finished: list[tuple[Any, ...]] = field(default_factory=list)
    turns: list[tuple[Any, ...]] = field(default_factory=list)
    samples: dict[str, list[Any]] = field(default_factory=dict)
    ready: list[tuple[Any, ...]] = field(default_factory=list)
    batched: list[tuple[Any, ...]] = field(default_factory=list)
    batches: list[tuple[Any, ...]] = field(default_factory=list)
    """``BATCH_COLUMNS`` rows whose last value is the payload itself: the writer hashes it (in its thread:
    hashlib lets go of the GIL while it hashes a payload, so the fold goes on meanwhile)."""
    outbox: list[tuple[Any, ...]] = field(default_factory=list)
    skipped: list[tuple[Any, ...]] = field(default_factory=list)
    searched: list[int] = field(default_factory=list)
    """Positions of the turns of open episodes this step folded, for the search index (the live
    materializer's only: ``Fold.searches``); an episode's turns reach ``turn_rows`` only when it finishes."""


def read_query(where: str, params: dict[str, Any], limit: int | None) -> tuple[str, dict[str, Any]]:
    query = (
        f"SELECT position, stream, type, {FOLDED_DATA}, tokens, recorded_at FROM events "
        f"WHERE {where} ORDER BY position"
    )
    if limit is not None:
        query += f" LIMIT {int(limit)}"
    return query, {**params, "unfolded": list(UNFOLDED_FIELDS)}


def log_rows(rows: Sequence[tuple[Any, ...]]) -> list[LogRow]:
    data = json.loads(f"[{','.join([r[3] for r in rows])}]")
    return [LogRow(r[0], r[1], r[2], d, r[4], r[5]) for r, d in zip(rows, data, strict=True)]
