"""The lineage report of an episode read from the store (``turnstile episodes --lineages``): the fold's
own rule over the events as the log holds them."""

from __future__ import annotations

import json
from collections.abc import Sequence

from pipeline.log import RecordedEvent, encode_event
from pipeline.materialize.config import MaterializerConfig
from pipeline.materialize.fold import TurnLineage, episode_lineages
from pipeline.materialize.records import LogRow


def lineages_of_records(records: Sequence[RecordedEvent], config: MaterializerConfig) -> list[TurnLineage]:
    """``episode_lineages`` of an episode's stream as the store reads it (events it cannot parse left out)."""
    rows = []
    for record in records:
        if record.event is None:
            continue
        encoded = encode_event(record.event)
        data = json.loads(encoded.data)
        rows.append(
            LogRow(record.position, record.stream, record.type, data, encoded.tokens, record.recorded_at)
        )
    return episode_lineages(rows, config) if rows else []
