"""What an append does, decided without I/O: events validated and encoded (JSON data + packed token
arrays + a content hash), and each append of a batch planned against the log's state (idempotency by
event id, expected versions, positions). Both store adapters use these, so they accept and refuse the same.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Final

from pydantic import BaseModel, ValidationError
from pydantic_core import PydanticSerializationError

from pipeline.errors import (
    DuplicateEventConflict,
    InvalidEvent,
    TurnstileError,
    WrongExpectedVersion,
    describe_validation_error,
)
from pipeline.log.port import AppendResult, RecordedEvent
from pipeline.log.tokens import pack_tokens, unpack_tokens
from schemas import CATEGORY_OF, EVENT_TYPES, EpisodeStarted, Event, TurnCompleted, parse_event

log = logging.getLogger(__name__)

STREAM_PATTERN: Final = re.compile(r"^(?P<category>[a-z]+)-[A-Za-z0-9][A-Za-z0-9._:-]{0,199}$")
EPISODE_STREAM_PREFIX: Final = "episode-"
TOKEN_FIELDS: Final = frozenset({"prompt_token_ids", "completion_token_ids", "completion_logprobs"})
_TURN_WRITTEN_BY_HAND: Final = {*TOKEN_FIELDS, "event_id", "turn_id"}
"""Left out of pydantic's JSON of a turn: the token arrays (stored in binary) and the two ids, which
``encode_event`` writes itself (see there)."""


@dataclass(frozen=True, slots=True)
class EncodedEvent:
    event_id: uuid.UUID
    type: str
    data: str
    tokens: bytes | None
    content_hash: bytes


@dataclass(slots=True)
class PendingAppend:
    stream: str
    events: list[EncodedEvent]
    expected_version: int | None
    metadata: str
    future: asyncio.Future[AppendResult] | None = None


@dataclass(frozen=True, slots=True)
class RecordedId:
    stream: str
    position: int
    version: int
    content_hash: bytes


def encode_event(event: Event) -> EncodedEvent:
    """Split an event into its JSON data and its packed token arrays, with a hash of the content."""
    try:
        if isinstance(event, TurnCompleted):
            # A turn is the bulk of the log: fields at their defaults are left out (readers fill them in), the
            # type is the row's own column, and the schema version is always written. The ids come first,
            # written here: to leave out defaults pydantic calls each field's default factory, and theirs is
            # uuid4 (a read of the OS's random source each, only to find the ids differ).
            rest = event.model_dump_json(exclude=_TURN_WRITTEN_BY_HAND, exclude_defaults=True)
            data = (  # the rest always has fields (request and reply)
                f'{{"schema_version":{event.schema_version},"event_id":"{event.event_id}",'
                f'"turn_id":"{event.turn_id}",{rest[1:]}'
            )
            if event.request.tools:
                data = _parameters_as_text(data)
            tokens: bytes | None = pack_tokens(
                event.prompt_token_ids, event.completion_token_ids, event.completion_logprobs
            )
        else:
            data = event.model_dump_json()
            tokens = None
    except PydanticSerializationError as error:
        raise InvalidEvent(
            f"{event.type} cannot be stored: {error}; its strings must be valid Unicode (no lone surrogates "
            "such as '\\ud800')"
        ) from None
    digest = hashlib.sha256(event.type.encode())
    digest.update(b"\0" + data.encode())
    digest.update(b"\0" + (tokens or b""))
    return EncodedEvent(event.event_id, event.type, data, tokens, digest.digest())


def _parameters_as_text(data: str) -> str:
    """A turn's JSON with each tool's ``parameters`` held as JSON text. ``events.data`` is jsonb, which
    reorders object keys; a template that prints ``tools | tojson`` would render a turn read back from the
    log differently from how it was rendered for the model. Text keeps the keys in the order they came."""
    fields = json.loads(data)
    for tool in fields["request"]["tools"]:
        function = tool["function"]
        if "parameters" in function:  # left out at its default ({}): readers fill it in
            function["parameters"] = json.dumps(
                function["parameters"], ensure_ascii=False, separators=(",", ":")
            )
    return json.dumps(fields, ensure_ascii=False, separators=(",", ":"))


def _parameters_from_text(fields: dict[str, Any]) -> None:
    """Undo ``_parameters_as_text`` in ``fields`` (copying what it changes: the stored row stays as it is)."""
    request = fields.get("request")
    if not isinstance(request, dict) or not isinstance(request.get("tools"), list):
        return
    tools = []
    for tool in request["tools"]:
        function = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(function, dict) and isinstance(function.get("parameters"), str):
            with contextlib.suppress(ValueError):  # not JSON: validation names it
                tool = {**tool, "function": {**function, "parameters": json.loads(function["parameters"])}}
        tools.append(tool)
    fields["request"] = {**request, "tools": tools}


def decode_event(type_: str, data: Mapping[str, Any], tokens: bytes | None) -> Event | None:
    """The event stored as ``data`` + ``tokens``; unknown fields are ignored, unknown types give None."""
    if type_ not in EVENT_TYPES:
        return None
    fields = dict(data)
    fields.setdefault("type", type_)  # a turn's data leaves it to the row's type column
    if type_ == "TurnCompleted":
        _parameters_from_text(fields)
    if tokens is not None:
        prompt, completion, logprobs = unpack_tokens(tokens)
        fields.update(prompt_token_ids=prompt, completion_token_ids=completion, completion_logprobs=logprobs)
    return parse_event(fields, tolerant=True)


_EVENT_CLASSES: Final = frozenset(EVENT_TYPES.values())


def validate_event(index: int, event: Event | Mapping[str, Any]) -> Event:
    """An event model from a model or a dict, or InvalidEvent naming what was wrong."""
    if isinstance(event, BaseModel):
        if type(event) not in _EVENT_CLASSES:
            known = ", ".join(EVENT_TYPES)
            raise InvalidEvent(
                f"event {index} is a {type(event).__name__}, not an event; known types: {known}"
            )
        return event
    if not isinstance(event, Mapping):
        raise InvalidEvent(f"event {index} is a {type(event).__name__}; pass an event model or a dict")
    type_ = event.get("type")
    if not isinstance(type_, str) or type_ not in EVENT_TYPES:
        raise InvalidEvent(f"event {index} has unknown type {type_!r}; known types: {', '.join(EVENT_TYPES)}")
    try:
        return EVENT_TYPES[type_].model_validate(dict(event))  # type: ignore[return-value]
    except ValidationError as error:
        raise InvalidEvent(
            f"event {index} ({type_}) is invalid: {describe_validation_error(error)}"
        ) from None


def prepare_append(
    stream: str,
    events: Sequence[Event | Mapping[str, Any]],
    expected_version: int | None,
    metadata: Mapping[str, Any] | None,
    max_event_bytes: int,
) -> PendingAppend:
    """Check everything that can be checked without the database; raise InvalidEvent naming the problem."""
    match = STREAM_PATTERN.match(stream) if isinstance(stream, str) else None
    if match is None:
        raise InvalidEvent(
            f"bad stream name {stream!r}: expected '<category>-<id>' such as 'episode-1b2c' or 'policy-main' "
            "(id: letters, digits, . _ : -; at most 200 characters)"
        )
    if not events:
        raise InvalidEvent(f"append to {stream!r} has no events")
    if expected_version is not None and expected_version < 0:
        raise InvalidEvent(
            f"expected_version must be >= 0 (0: a new stream) or None (any), not {expected_version}"
        )
    encoded = []
    seen: set[uuid.UUID] = set()
    for index, raw in enumerate(events):
        event = validate_event(index, raw)
        category = CATEGORY_OF[event.type]
        if match["category"] != category:
            raise InvalidEvent(
                f"event {index} ({event.type}) belongs in a '{category}-<id>' stream, not in {stream!r}"
            )
        if isinstance(event, EpisodeStarted):
            _check_episode_stream(index, event, stream)
        if event.event_id in seen:
            raise InvalidEvent(f"event {index} repeats event_id {event.event_id} within one append")
        seen.add(event.event_id)
        item = encode_event(event)
        size = len(item.data) + len(item.tokens or b"")
        if size > max_event_bytes:
            raise InvalidEvent(
                f"event {index} ({event.type}) is {size:,} bytes, over the limit of {max_event_bytes:,} "
                "bytes (TURNSTILE_MAX_EVENT_BYTES); shorten the messages or raise the limit"
            )
        encoded.append(item)
    metadata_json = "{}"  # what an append without metadata stores, without running the encoder
    try:
        if metadata:
            metadata_json = json.dumps(dict(metadata), separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as error:
        raise InvalidEvent(f"metadata of the append to {stream!r} is not JSON: {error}") from None
    return PendingAppend(stream, encoded, expected_version, metadata_json)


def _check_episode_stream(index: int, event: EpisodeStarted, stream: str) -> None:
    """An episode starts only in its own stream, ``episode-<episode_id>``. Stream names are unique, so no
    two streams can then hold one episode: the read models key episodes by id, and a second stream claiming
    an id would have its samples dropped. SQL checks the same (migration 0021)."""
    own = EPISODE_STREAM_PREFIX + event.episode_id
    if stream != own:
        raise InvalidEvent(
            f"event {index} (EpisodeStarted) starts episode {event.episode_id!r}, whose stream is {own!r}, "
            f"not {stream!r}: an episode is recorded in the stream named by its id, so no two streams hold "
            f"one episode; append it to {own!r} (if that stream already holds the episode, choose a new "
            "episode_id)"
        )


@dataclass(slots=True)
class AppendPlan:
    rows: list[tuple[Any, ...]] = field(default_factory=list)
    outcomes: list[AppendResult | TurnstileError] = field(default_factory=list)


def plan_appends(
    appends: Sequence[PendingAppend],
    recorded: Mapping[uuid.UUID, RecordedId],
    versions: Mapping[str, int],
    head: int,
) -> AppendPlan:
    """Decide, in order, what each append does given the log's state under the append lock.

    Returns the rows to insert (in ``COPY_COLUMNS`` order) and, per append, its result or its error.
    One append's error never affects another's outcome.
    """
    plan = AppendPlan()
    recorded = dict(recorded)
    versions = dict(versions)
    for append in appends:
        found = [recorded.get(item.event_id) for item in append.events]
        if any(found):
            plan.outcomes.append(_idempotent_outcome(append, found))
            continue
        actual = versions.get(append.stream, 0)
        if append.expected_version is not None and append.expected_version != actual:
            plan.outcomes.append(WrongExpectedVersion(append.stream, append.expected_version, actual))
            continue
        positions = []
        for item in append.events:
            head += 1
            actual += 1
            positions.append(head)
            plan.rows.append(
                (
                    head,
                    append.stream,
                    actual,
                    item.event_id,
                    item.type,
                    item.data,
                    item.tokens,
                    append.metadata,
                    item.content_hash,
                )
            )
            recorded[item.event_id] = RecordedId(append.stream, head, actual, item.content_hash)
        versions[append.stream] = actual
        plan.outcomes.append(AppendResult(append.stream, tuple(positions), actual))
    return plan


def _idempotent_outcome(
    append: PendingAppend, found: list[RecordedId | None]
) -> AppendResult | TurnstileError:
    for item, was in zip(append.events, found, strict=True):
        if was is None:
            return DuplicateEventConflict(
                f"append to {append.stream!r} mixes recorded and new events (event {item.event_id} is new); "
                "an append is atomic, so a retry must resend exactly the same events"
            )
        if was.stream != append.stream or was.content_hash != item.content_hash:
            where = f"stream {was.stream!r} at position {was.position}"
            return DuplicateEventConflict(
                f"event_id {item.event_id} is already recorded in {where} with other content; "
                "a retry must resend the same event, and a new event needs a new event_id"
            )
    recorded = [was for was in found if was is not None]
    return AppendResult(append.stream, tuple(was.position for was in recorded), recorded[-1].version, True)


def recorded_event(
    *,
    position: int,
    stream: str,
    version: int,
    event_id: uuid.UUID,
    type_: str,
    data: Mapping[str, Any],
    tokens: bytes | None,
    metadata: dict[str, Any],
    recorded_at: datetime,
) -> RecordedEvent:
    """A stored event with its envelope. One that does not parse comes back with ``event=None`` and the
    reason in ``problem`` (naming its position), so that no recorded event can stop a reader."""
    try:
        event = decode_event(type_, data, tokens)
    except (ValidationError, InvalidEvent) as error:
        why = describe_validation_error(error) if isinstance(error, ValidationError) else str(error)
        problem = f"stored event at position {position} ({type_}) does not parse: {why}"
    else:
        return RecordedEvent(position, stream, version, event_id, type_, event, metadata, recorded_at)
    log.warning("skipping %s", problem)
    return RecordedEvent(position, stream, version, event_id, type_, None, metadata, recorded_at, problem)
