"""Fuzzing the store boundary with hypothesis, on real PostgreSQL: an episode whose events are valid but for
one field replaced by something odd (huge or negative numbers, NaN, NUL, lone surrogates, wrong types, missing
fields, mismatched token arrays) is either refused whole with a ``TurnstileError`` (nothing recorded) or
recorded, and then read back, folded by the materializer and replayed without a skip or an error."""

from __future__ import annotations

import copy
import json
import uuid
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.errors import TurnstileError
from pipeline.log import EventStore
from pipeline.materialize.config import MaterializerConfig
from pipeline.materialize.fold import Fold
from pipeline.materialize.records import LogRow
from pipeline.replay import load_episode
from tests.support.factories import finished, reward, started, turn

TEMPLATES: dict[str, dict[str, Any]] = {
    "started": started().model_dump(mode="json"),
    "turn": turn(prompt_len=4, completion_len=3).model_dump(mode="json"),
    "reward": reward(0.5).model_dump(mode="json"),
    "finished": finished().model_dump(mode="json"),
}
ODD = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(),
    st.text(max_size=6),
    st.sampled_from(["\x00", "a\x00b", "\ud800", "x" * 300, "", "-1", "1e999"]),
    st.lists(st.integers(min_value=-5, max_value=2**33), max_size=4),
    st.lists(st.floats(), max_size=4),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)


@st.composite
def odd_episode(draw: st.DrawFn) -> list[dict[str, Any]]:
    """A started / turn / reward / finished episode with one field of one event made odd (or removed)."""
    events = [copy.deepcopy(TEMPLATES[kind]) for kind in ("started", "turn", "reward", "finished")]
    events[0]["episode_id"] = uuid.uuid4().hex
    events[1]["turn_id"] = str(uuid.uuid4())
    for event in events:
        event["event_id"] = str(uuid.uuid4())
    target = events[draw(st.integers(min_value=0, max_value=3))]
    key = draw(st.sampled_from(sorted(target)))
    nested = target[key]
    if isinstance(nested, dict) and nested and draw(st.booleans()):
        inner = draw(st.sampled_from(sorted(nested)))
        nested[inner] = draw(ODD)
    elif draw(st.integers(min_value=0, max_value=5)) == 0:
        del target[key]
    else:
        target[key] = draw(ODD)
    return events


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
    derandomize=True,
)
@given(events=odd_episode())
async def test_every_event_is_refused_whole_or_recorded_and_then_read_folded_and_replayed(
    store: EventStore, events: list[dict[str, Any]]
) -> None:
    episode_id = str(events[0].get("episode_id", "odd"))
    stream = f"episode-{uuid.uuid4().hex}"
    try:
        await store.append(stream, events, 0)
    except TurnstileError:
        assert await store.stream_version(stream) == 0  # refused whole: nothing of it recorded
        return
    recorded = await store.read_stream(stream)
    assert len(recorded) == 4
    assert all(r.problem is None and r.event is not None for r in recorded), [r.problem for r in recorded]
    fold = Fold(MaterializerConfig(batch_samples=1))
    raw = await store.engine.connect()
    try:
        rows = (
            await raw.exec_driver_sql(
                "SELECT position, stream, type, data, tokens, recorded_at FROM events WHERE stream = %s "
                "ORDER BY position",
                (stream,),
            )
        ).all()
    finally:
        await raw.close()
    for row in rows:
        fold.apply(LogRow(row[0], row[1], row[2], row[3], row[4], row[5]))
    assert fold.skipped == 0
    if isinstance(episode_id, str) and stream.endswith(episode_id):
        await load_episode(store, episode_id)
    assert json.dumps(fold.writes.episodes, default=str)  # the read-model rows it made are plain values
