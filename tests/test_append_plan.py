"""The pure decision of what each append in a group-commit batch does."""

from __future__ import annotations

import pytest

from pipeline.errors import DuplicateEventConflict, InvalidEvent, WrongExpectedVersion
from pipeline.log import AppendResult, encode_event
from pipeline.log.appends import RecordedId, plan_appends, prepare_append
from tests.factories import reward, started, turn

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
    event = started("a")
    changed = event.model_copy(update={"task_id": "other"})
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
    ],
)
def test_bad_input_is_refused_before_the_database(
    stream: str, events: list[object], expected: int | None, message: str
) -> None:
    with pytest.raises(InvalidEvent, match=message):
        prepare_append(stream, events, expected, None, LIMIT)  # type: ignore[arg-type]
