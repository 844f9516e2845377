"""The pure decision of what each append in a group-commit batch does."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import re
import uuid

import pytest

from pipeline.errors import DuplicateEventConflict, InvalidEvent, WrongExpectedVersion
from pipeline.log import AppendResult, encode_event
from pipeline.log.appends import (
    TOKEN_FIELDS,
    RecordedId,
    decode_event,
    plan_appends,
    prepare_append,
    recorded_event,
)
from pipeline.log.tokens import pack_tokens, unpack_tokens
from schemas import RewardAssigned, SamplingParams, ToolSpec, TurnRequest
from tests.support.factories import reward, started, turn

LIMIT = 1 << 20


def test_appends_to_one_stream_in_one_batch_see_each_others_versions() -> None:
    first = prepare_append("episode-a", [started("a")], 0, None, LIMIT)
    second = prepare_append("episode-a", [turn(), reward()], 1, None, LIMIT)
    stale = prepare_append("episode-a", [reward()], 1, None, LIMIT)
    other = prepare_append("episode-b", [started("b")], None, None, LIMIT)
    plan = plan_appends([first, second, stale, other], {}, {}, head=10)
    assert plan.outcomes[0] == AppendResult("episode-a", (11,), 1)
    assert plan.outcomes[1] == AppendResult("episode-a", (12, 13), 3)
    assert isinstance(plan.outcomes[2], WrongExpectedVersion)
    assert (plan.outcomes[2].expected, plan.outcomes[2].actual) == (1, 3)
    assert plan.outcomes[3] == AppendResult("episode-b", (14,), 1)
    assert [(row[0], row[1], row[2]) for row in plan.rows] == [
        (11, "episode-a", 1),
        (12, "episode-a", 2),
        (13, "episode-a", 3),
        (14, "episode-b", 1),
    ]


def test_a_recorded_append_is_reported_not_rewritten_whatever_its_expected_version() -> None:
    event = started("a")
    recorded = {event.event_id: RecordedId("episode-a", 7, 1, encode_event(event).content_hash)}
    retry = prepare_append("episode-a", [event], 0, None, LIMIT)
    plan = plan_appends([retry], recorded, {"episode-a": 4}, head=20)
    assert plan.outcomes == [AppendResult("episode-a", (7,), 1, duplicate=True)]
    assert plan.rows == []


def test_same_id_with_other_content_or_in_another_stream_is_a_conflict() -> None:
    event = reward(0.5)  # a start could not go in another stream at all
    changed = event.model_copy(update={"value": 0.25})
    recorded = {event.event_id: RecordedId("episode-a", 7, 1, encode_event(event).content_hash)}
    plan = plan_appends(
        [
            prepare_append("episode-a", [changed], None, None, LIMIT),
            prepare_append("episode-z", [event], None, None, LIMIT),
        ],
        recorded,
        {},
        head=7,
    )
    assert all(isinstance(outcome, DuplicateEventConflict) for outcome in plan.outcomes)
    assert "position 7" in str(plan.outcomes[0])
    assert plan.rows == []


def test_a_duplicate_within_one_batch_is_written_once() -> None:
    event = started("a")
    twice = [prepare_append("episode-a", [event], 0, None, LIMIT) for _ in range(2)]
    plan = plan_appends(twice, {}, {}, head=0)
    assert plan.outcomes == [
        AppendResult("episode-a", (1,), 1),
        AppendResult("episode-a", (1,), 1, duplicate=True),
    ]
    assert len(plan.rows) == 1


@pytest.mark.parametrize(
    ("stream", "events", "expected", "message"),
    [
        ("episode a", [started()], None, "bad stream name"),
        ("policy-main", [started()], None, "belongs in a 'episode-<id>' stream"),
        ("episode-a", [], None, "has no events"),
        ("episode-a", [{"type": "Nope"}], None, "unknown type 'Nope'"),
        ("episode-a", [{"type": "RewardAssigned", "value": "high"}], None, "field value"),
        ("episode-a", [started(), started()], -1, "expected_version must be >= 0"),
        ("episode-b", [started("a")], 0, "starts episode 'a', whose stream is 'episode-a', not 'episode-b'"),
        ("episode-a", [started("a"), started("b")], 0, "starts episode 'b', whose stream is 'episode-b'"),
    ],
)
def test_bad_input_is_refused_before_the_database(
    stream: str, events: list[object], expected: int | None, message: str
) -> None:
    with pytest.raises(InvalidEvent, match=message):
        prepare_append(stream, events, expected, None, LIMIT)  # type: ignore[arg-type]


def test_a_retry_of_a_recorded_append_does_not_stop_the_appends_after_it_in_the_batch() -> None:
    event = started("a")
    recorded = {event.event_id: RecordedId("episode-a", 7, 1, encode_event(event).content_hash)}
    retry = prepare_append("episode-a", [event], 0, None, LIMIT)
    new = prepare_append("episode-b", [started("b")], 0, None, LIMIT)
    plan = plan_appends([retry, new], recorded, {"episode-a": 1}, head=7)
    assert plan.outcomes == [
        AppendResult("episode-a", (7,), 1, duplicate=True),
        AppendResult("episode-b", (8,), 1),
    ]


def test_the_stored_form_of_an_event_is_a_format() -> None:
    """What the log stores (and hashes) must not change under recorded events: a retry after an upgrade
    is recognised by this hash, and readers parse this JSON."""
    event = RewardAssigned(event_id=uuid.UUID(int=1), value=0.5, source="test")
    data = (
        '{"type":"RewardAssigned","schema_version":1,"event_id":"00000000-0000-0000-0000-000000000001",'
        '"turn_id":null,"value":0.5,"source":"test"}'
    )
    encoded = encode_event(event)
    assert (encoded.data, encoded.tokens) == (data, None)
    assert encoded.content_hash == hashlib.sha256(b"RewardAssigned\0" + data.encode() + b"\0").digest()
    with_tokens = encode_event(turn(prompt_len=3, completion_len=2))
    assert not TOKEN_FIELDS & json.loads(with_tokens.data).keys()  # token arrays go to `tokens` only
    for a_turn in (turn(), turn().model_copy(update={"parent_turn_id": uuid.uuid4(), "render_drift": False})):
        # a turn: the schema version, then pydantic's JSON without its defaults and token arrays
        pydantic = a_turn.model_dump_json(exclude=set(TOKEN_FIELDS), exclude_defaults=True)
        assert encode_event(a_turn).data == f'{{"schema_version":2,{pydantic[1:]}'
    assert with_tokens.tokens == pack_tokens(*unpack_tokens(with_tokens.tokens or b""))


def test_a_turn_whose_tool_has_no_parameters_is_stored_and_read_back() -> None:
    """A tool without ``parameters`` (the default, {}) leaves the key out of the stored JSON; found by
    tests/unit/test_gateway_fuzz.py, where it stopped the append with a KeyError."""
    bare = ToolSpec.model_validate({"type": "function", "function": {"name": "ping"}})
    with_schema = ToolSpec.model_validate(
        {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}
    )
    event = turn().model_copy(
        update={"request": TurnRequest(messages=turn().request.messages, tools=[bare, with_schema])}
    )
    encoded = encode_event(event)
    stored = json.loads(encoded.data)
    assert "parameters" not in stored["request"]["tools"][0]["function"]
    assert stored["request"]["tools"][1]["function"]["parameters"] == '{"type":"object","properties":{}}'
    assert decode_event("TurnCompleted", stored, encoded.tokens) == event


def test_readers_ignore_unknown_fields_keep_unknown_types_and_skip_a_broken_event_naming_it() -> None:
    event = reward(2.0)
    data = {**json.loads(encode_event(event).data), "from_the_future": True}
    assert decode_event("RewardAssigned", data, None) == event
    assert decode_event("EpisodePaused", {}, None) is None
    envelope = {
        "stream": "episode-x", "version": 1, "event_id": event.event_id, "metadata": {},
        "recorded_at": dt.datetime.now(dt.UTC),
    }  # fmt: skip
    lots = {**data, "value": "lots"}
    broken = recorded_event(position=9, type_="RewardAssigned", data=lots, tokens=None, **envelope)
    assert broken.event is None
    assert broken.problem is not None
    assert re.match(r"stored event at position 9 \(RewardAssigned\) does not parse: .*value", broken.problem)
    turn_data = json.loads(encode_event(turn(prompt_len=3, completion_len=2)).data)
    for blob in (b"", b"TSK1", b"XXXX" + bytes(12), pack_tokens([1, 2], [3], [-0.5])[:-1]):
        torn = recorded_event(position=10, type_="TurnCompleted", data=turn_data, tokens=blob, **envelope)
        assert torn.event is None
        assert torn.problem is not None
        assert "position 10 (TurnCompleted)" in torn.problem
        assert "TSK1" in torn.problem
    fine = recorded_event(position=11, type_="RewardAssigned", data=data, tokens=None, **envelope)
    assert (fine.event, fine.problem) == (event, None)


def test_refusals_name_the_event_the_stream_and_the_limit_exactly() -> None:
    with pytest.raises(InvalidEvent, match="event 1 has unknown type 'EpisodeExploded'"):
        prepare_append("episode-a", [started("a"), {"type": "EpisodeExploded"}], 0, None, LIMIT)
    with pytest.raises(
        InvalidEvent, match="event 0 is a SamplingParams, not an event; known types: EpisodeStarted, "
    ):
        prepare_append("episode-a", [SamplingParams()], 0, None, LIMIT)  # type: ignore[list-item]
    with pytest.raises(InvalidEvent, match="event 1 is a int; pass an event model or a dict"):
        prepare_append("episode-a", [started("a"), 5], 0, None, LIMIT)  # type: ignore[list-item]
    with pytest.raises(InvalidEvent, match="bad stream name 42"):
        prepare_append(42, [started("a")], 0, None, LIMIT)  # type: ignore[arg-type]
    with pytest.raises(InvalidEvent, match="metadata of the append to 'episode-a' is not JSON"):
        prepare_append("episode-a", [started("a")], 0, {"score": float("nan")}, LIMIT)
    big = turn(prompt_len=2000, completion_len=10)
    size = len(encode_event(big).data) + len(encode_event(big).tokens or b"")  # JSON and token arrays
    assert prepare_append("episode-a", [big], 0, None, size).events  # exactly at the limit: accepted
    with pytest.raises(InvalidEvent, match=f"is {size:,} bytes, over the limit of {size - 1:,} bytes"):
        prepare_append("episode-a", [big], 0, None, size - 1)
