"""The contract: discriminated unions, strict writers, tolerant readers, exported JSON Schema."""

from __future__ import annotations

import base64
import json
import uuid
from array import array
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from pipeline.log.tokens import pack_tokens, unpack_tokens
from schemas import (
    EVENT_TYPES,
    Contract,
    LLMError,
    LLMRequest,
    LLMResponse,
    PolicyVersionPublished,
    SamplingParams,
    TurnCompleted,
    json_schemas,
    parse_event,
    parse_wire,
)
from tests.support.factories import finished, reward, started, turn


@pytest.mark.parametrize(
    "event",
    [
        started(),
        turn(),
        reward(),
        finished(),
        PolicyVersionPublished(policy="main", version=3, checkpoint="/ckpt/3"),
    ],
)
def test_every_event_round_trips_through_the_discriminated_union(event: object) -> None:
    assert isinstance(event, tuple(EVENT_TYPES.values()))
    dumped = event.model_dump_json()  # type: ignore[attr-defined]
    parsed = parse_event(dumped)
    assert type(parsed) is type(event)
    assert parsed == event


def test_writers_refuse_unknown_fields_and_readers_ignore_them_at_every_depth() -> None:
    original = turn()
    data = original.model_dump(mode="json")
    data["added_by_a_newer_writer"] = 1
    data["request"]["messages"][0]["also_new"] = "x"
    with pytest.raises(ValidationError) as refused:
        parse_event(data)
    assert "added_by_a_newer_writer" in str(refused.value)
    assert "also_new" in str(refused.value)
    tolerant = parse_event(data, tolerant=True)
    assert isinstance(tolerant, TurnCompleted)
    assert tolerant == original


def test_events_are_frozen() -> None:
    event = reward()
    with pytest.raises(ValidationError):
        event.value = 2.0  # type: ignore[misc]


def test_unknown_type_and_bad_values_are_refused() -> None:
    with pytest.raises(ValidationError, match="EpisodeStarted"):
        parse_event({"type": "EpisodeRestarted"})
    with pytest.raises(ValidationError, match="completion_logprobs"):
        parse_event({**turn().model_dump(mode="json"), "completion_logprobs": [0.5]})  # a logprob above 0
    with pytest.raises(ValidationError, match="termination"):
        parse_event({**finished().model_dump(mode="json"), "termination": "exploded"})


def test_logprobs_are_float32_so_a_stored_turn_equals_the_original() -> None:
    event = turn(completion_len=50)
    prompt, completion, logprobs = unpack_tokens(
        pack_tokens(event.prompt_token_ids, event.completion_token_ids, event.completion_logprobs)
    )
    assert (prompt, completion, logprobs) == (
        event.prompt_token_ids,
        event.completion_token_ids,
        event.completion_logprobs,
    )


def a_request_and_its_reply() -> tuple[LLMRequest, LLMResponse]:
    request = LLMRequest(policy="main", messages=[{"role": "user", "content": "hi"}])
    response = LLMResponse(
        request_id=request.request_id,
        text="hello",
        finish_reason="stop",
        prompt_token_ids=[1, 2],
        completion_token_ids=[3],
        completion_logprobs=[-0.5],
        policy_version=0,
        consumer_id="c1",
    )
    return request, response


def test_wire_messages_parse_by_type() -> None:
    request, response = a_request_and_its_reply()
    error = LLMError(request_id=uuid.uuid4(), code="invalid_request", message="bad", field="messages")
    for message in (request, response, error):
        assert parse_wire(message.model_dump_json()) == message


def test_version_1_wire_messages_and_turns_read_as_version_2_and_nothing_else_does() -> None:
    for message in a_request_and_its_reply():
        old = {**json.loads(message.model_dump_json()), "schema_version": 1}
        assert parse_wire(json.dumps(old)) == message  # from JSON, as the wire brings it
        assert parse_wire(old) == message  # and from Python
        for version in (True, 3, "1"):
            with pytest.raises(ValidationError, match="schema_version"):
                parse_wire(json.dumps({**old, "schema_version": version}))
    old_turn = {**json.loads(turn().model_dump_json()), "schema_version": 1}
    assert parse_event(old_turn).schema_version == 2


def test_exported_json_schemas_match_the_models(repo_root: Path) -> None:
    directory = repo_root / "schemas" / "json"
    expected = json_schemas()
    on_disk = {path.name: json.loads(path.read_text()) for path in directory.glob("*.json")}
    stale = sorted(
        name for name in expected.keys() | on_disk.keys() if expected.get(name) != on_disk.get(name)
    )
    assert not stale, f"schemas/json is out of date for {stale}: run `turnstile export-schemas`"


def test_one_logprob_per_completion_token_is_checked_when_writing_never_when_reading() -> None:
    fields = {
        **turn().model_dump(mode="json"),
        "completion_token_ids": [1, 2, 3],
        "completion_logprobs": [-0.5],
    }
    with pytest.raises(ValidationError, match="1 completion_logprobs for 3 completion_token_ids"):
        parse_event(fields)
    stored = parse_event(fields, tolerant=True)  # an event recorded before the check stays readable
    assert isinstance(stored, TurnCompleted)
    assert (stored.completion_token_ids, stored.completion_logprobs) == ([1, 2, 3], [-0.5])


@pytest.mark.parametrize(
    ("field", "value"),
    [("seed", -1), ("seed", 2**63), ("max_tokens", 2**31)],
)
def test_sampling_numbers_the_engines_cannot_take_are_refused(field: str, value: int) -> None:
    with pytest.raises(ValidationError, match=field):
        SamplingParams.model_validate({field: value})
    assert SamplingParams.model_validate({"seed": 2**63 - 1, "max_tokens": 2**31 - 1}).seed == 2**63 - 1


def test_a_turn_recorded_before_the_train_mark_existed_reads_as_trained() -> None:
    recorded = turn().model_dump(mode="json")
    del recorded["train"]  # what older writers stored
    for tolerant in (False, True):
        stored = parse_event(recorded, tolerant=tolerant)
        assert isinstance(stored, TurnCompleted)
        assert stored.train is None  # None: trained; only False marks a side call
    marked = parse_event({**recorded, "train": False})
    assert isinstance(marked, TurnCompleted)
    assert marked.train is False


@pytest.mark.parametrize("event", [started(), turn(), reward(), finished()], ids=lambda e: e.type)
def test_a_trusted_model_of_every_field_is_the_validated_model_frozen_copyable_and_encoded_alike(
    event: object,
) -> None:
    assert isinstance(event, Contract)
    fields = {name: getattr(event, name) for name in type(event).model_fields}
    built = type(event).trusted(**fields)
    assert built == event
    assert built.model_dump_json() == event.model_dump_json()
    assert built.model_dump() == event.model_dump()
    assert built.model_copy(update={"event_id": uuid.UUID(int=1)}) == event.model_copy(
        update={"event_id": uuid.UUID(int=1)}
    )
    with pytest.raises(ValidationError, match="frozen"):
        built.event_id = uuid.UUID(int=2)  # type: ignore[attr-defined]


def test_timings_and_temperature_refuse_infinity_which_json_would_store_as_null() -> None:
    """Found by tests/integration/test_store_fuzz.py: ``first_token_ms=inf`` was accepted, stored as null
    (JSON has no infinity) and then could not be read back."""
    from pydantic import ValidationError

    from schemas import SamplingParams, Timings

    for field in ("queued_ms", "first_token_ms", "total_ms", "restarted_ms"):
        with pytest.raises(ValidationError):
            Timings(**{field: float("inf")})
    with pytest.raises(ValidationError):
        SamplingParams(temperature=float("inf"))
    assert Timings(first_token_ms=1.5).first_token_ms == 1.5


@settings(max_examples=300, deadline=None)
@given(
    ids=st.lists(st.integers(-(2**31), 2**31 - 1), max_size=40),
    logprobs=st.lists(st.floats(width=32), max_size=40),
)
def test_a_packed_array_is_accepted_or_refused_exactly_as_the_same_values_as_a_list(
    ids: list[int], logprobs: list[float]
) -> None:
    """Packed arrays skip the per-value validation when a check over the whole array in C passes; whatever
    the values (negative ids, NaN, infinities, positive logprobs), the packed form must be read exactly as
    the list form: the same values, or refused with the same errors."""

    def reply(prompt: object, completion: object) -> dict[str, object]:
        return {
            "type": "LLMResponse", "request_id": str(uuid.uuid4()), "text": "x", "finish_reason": "stop",
            "prompt_token_ids": prompt, "completion_token_ids": [1] * len(logprobs),
            "completion_logprobs": completion, "policy_version": 0, "consumer_id": "c",
        }  # fmt: skip

    def packed(code: str, values: list[Any]) -> str:
        return base64.b64encode(array(code, values).tobytes()).decode()

    def read(message: dict[str, object]) -> tuple[str, object]:
        try:
            parsed = parse_wire(message)
        except ValidationError as error:
            return "refused", [(e["loc"], e["type"]) for e in error.errors()]
        assert isinstance(parsed, LLMResponse)
        return "read", (parsed.prompt_token_ids, [repr(v) for v in parsed.completion_logprobs])

    as_list = read(reply(ids, array("f", logprobs).tolist()))
    as_packed = read(reply(packed("i", ids), packed("f", logprobs)))
    assert as_packed == as_list
