"""Values shared by events and wire messages: chat messages, tools, sampling, timings."""

from __future__ import annotations

import math
from array import array
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, NonNegativeFloat

from schemas.base import Contract

Role = Literal["system", "user", "assistant", "tool"]
FinishReason = Literal["stop", "length", "tool_calls", "abort", "error"]


def _as_float32(values: list[float]) -> list[float]:
    # Logprobs travel and are stored as float32 (the engines' own precision); rounding here makes an
    # event equal to itself after a round trip through the log. A value beyond float32's range would
    # become -inf there, which no reader accepts: refused here instead.
    rounded = array("f", values).tolist()
    for index, value in enumerate(rounded):
        if math.isinf(value):
            raise ValueError(
                f"logprob {values[index]!r} at index {index} is beyond float32's range (it would be stored "
                "as -inf); logprobs must be finite float32 values"
            )
    return rounded


TokenIds = Annotated[list[Annotated[int, Field(ge=0, lt=2**31)]], Field(max_length=4_000_000)]
Logprobs = Annotated[list[Annotated[float, Field(allow_inf_nan=False, le=0.0)]], AfterValidator(_as_float32)]


class FunctionCall(Contract):
    name: str = Field(min_length=1)
    arguments: str = Field(description="JSON text of the arguments, exactly as the model wrote it")


class ToolCall(Contract):
    id: str = Field(min_length=1)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Contract):
    role: Role
    content: str | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class FunctionSpec(Contract):
    name: str = Field(min_length=1)
    description: str = ""
    parameters: dict[str, Any] = Field(default_factory=dict)


class ToolSpec(Contract):
    type: Literal["function"] = "function"
    function: FunctionSpec


class ToolChoice(Contract):
    """Which tools the model may call: ``auto`` (any or none), ``none`` (no tool call: tool-call blocks stay
    text), ``required`` (at least one), ``function`` (the tool ``name``). The engines sample freely (no
    constrained decoding): ``none`` is enforced when the reply is parsed; ``required`` and ``function`` are
    recorded with the turn, so a reply that did not comply can be found and scored."""

    mode: Literal["auto", "none", "required", "function"] = "auto"
    name: str | None = Field(default=None, min_length=1, description="the tool, when mode is 'function'")


class SamplingParams(Contract):
    temperature: NonNegativeFloat = 1.0
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=1, lt=2**31)
    max_tokens: int = Field(default=256, ge=1, lt=2**31)
    stop: list[str] = Field(default_factory=list)
    seed: int | None = Field(default=None, ge=0, lt=2**63, description="what engines take: a 64-bit seed")


class Timings(Contract):
    """Milliseconds, measured by the inference consumer from the moment it received the request."""

    queued_ms: NonNegativeFloat = 0.0
    first_token_ms: NonNegativeFloat = 0.0
    total_ms: NonNegativeFloat = 0.0
