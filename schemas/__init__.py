"""The Turnstile contract: pydantic models of events and wire messages. No I/O lives here."""

from __future__ import annotations

from typing import Annotated, Any, Final

from pydantic import BaseModel, Field, TypeAdapter

from schemas.base import IGNORE, TOLERANT, Contract
from schemas.common import (
    ChatMessage,
    FinishReason,
    FunctionCall,
    FunctionSpec,
    Role,
    SamplingParams,
    Timings,
    ToolCall,
    ToolChoice,
    ToolSpec,
    default_sampling,
)
from schemas.episode import (
    EpisodeEvent,
    EpisodeFinished,
    EpisodeStarted,
    RewardAssigned,
    Termination,
    TurnCompleted,
    TurnDelivered,
    TurnEdit,
    TurnReply,
    TurnRequest,
)
from schemas.ids import new_uuid
from schemas.policy import PolicyEvent, PolicyVersionPublished
from schemas.task import TaskSubmitted
from schemas.wire import LLMError, LLMReply, LLMRequest, LLMResponse, TokenLogprob, TokenPrefix, WireMessage

Event = Annotated[
    EpisodeStarted
    | TurnCompleted
    | TurnDelivered
    | RewardAssigned
    | EpisodeFinished
    | PolicyVersionPublished,
    Field(discriminator="type"),
]

EVENT_TYPES: Final[dict[str, type[BaseModel]]] = {
    model.model_fields["type"].default: model
    for model in (
        EpisodeStarted,
        TurnCompleted,
        TurnDelivered,
        RewardAssigned,
        EpisodeFinished,
        PolicyVersionPublished,
    )
}
"""Event type name -> model."""

CATEGORY_OF: Final[dict[str, str]] = {
    "EpisodeStarted": "episode",
    "TurnCompleted": "episode",
    "TurnDelivered": "episode",
    "RewardAssigned": "episode",
    "EpisodeFinished": "episode",
    "PolicyVersionPublished": "policy",
}
"""Event type name -> the stream category its events belong to."""

WIRE_TYPES: Final[dict[str, type[BaseModel]]] = {
    model.model_fields["type"].default: model for model in (LLMRequest, LLMResponse, LLMError)
}

event_adapter: Final[TypeAdapter[Event]] = TypeAdapter(Event)
wire_adapter: Final[TypeAdapter[WireMessage]] = TypeAdapter(WireMessage)


def parse_event(data: dict[str, Any] | str | bytes, *, tolerant: bool = False) -> Event:
    """Validate any event from a dict or JSON; ``tolerant`` drops unknown fields (for stored data)."""
    context, extra = (TOLERANT, IGNORE) if tolerant else (None, None)
    if isinstance(data, dict):
        return event_adapter.validate_python(data, context=context, extra=extra)
    return event_adapter.validate_json(data, context=context, extra=extra)


def parse_wire(data: dict[str, Any] | str | bytes, *, tolerant: bool = True) -> WireMessage:
    """Validate a wire message; tolerant by default, since peers may run a newer contract."""
    context, extra = (TOLERANT, IGNORE) if tolerant else (None, None)
    if isinstance(data, dict):
        return wire_adapter.validate_python(data, context=context, extra=extra)
    return wire_adapter.validate_json(data, context=context, extra=extra)


def json_schemas() -> dict[str, dict[str, Any]]:
    """JSON Schema of every event and wire message, keyed by file name, for agents in other languages."""
    schemas: dict[str, dict[str, Any]] = {}
    models: dict[str, type[BaseModel]] = {**EVENT_TYPES, **WIRE_TYPES, "TaskSubmitted": TaskSubmitted}
    for name, model in models.items():
        schemas[f"{name}.json"] = model.model_json_schema()
    schemas["Event.json"] = event_adapter.json_schema()
    schemas["WireMessage.json"] = wire_adapter.json_schema()
    return schemas


__all__ = [
    "CATEGORY_OF",
    "EVENT_TYPES",
    "IGNORE",
    "TOLERANT",
    "WIRE_TYPES",
    "ChatMessage",
    "Contract",
    "EpisodeEvent",
    "EpisodeFinished",
    "EpisodeStarted",
    "Event",
    "FinishReason",
    "FunctionCall",
    "FunctionSpec",
    "LLMError",
    "LLMReply",
    "LLMRequest",
    "LLMResponse",
    "PolicyEvent",
    "PolicyVersionPublished",
    "RewardAssigned",
    "Role",
    "SamplingParams",
    "TaskSubmitted",
    "Termination",
    "Timings",
    "TokenLogprob",
    "TokenPrefix",
    "ToolCall",
    "ToolChoice",
    "ToolSpec",
    "TurnCompleted",
    "TurnDelivered",
    "TurnEdit",
    "TurnReply",
    "TurnRequest",
    "WireMessage",
    "default_sampling",
    "event_adapter",
    "json_schemas",
    "new_uuid",
    "parse_event",
    "parse_wire",
    "wire_adapter",
]
