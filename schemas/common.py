"""Values shared by events and wire messages: chat messages, tools, sampling, timings."""

from __future__ import annotations

import base64
import binascii
import math
import sys
from array import array
from collections.abc import Callable
from typing import Annotated, Any, Final, Literal

from pydantic import (
    AfterValidator,
    Field,
    NonNegativeFloat,
    PlainSerializer,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    field_validator,
)

from schemas.base import Contract

Role = Literal["system", "user", "assistant", "tool"]
FinishReason = Literal["stop", "length", "tool_calls", "abort", "error"]


def _as_float32(values: list[float]) -> list[float]:
    # Logprobs travel and are stored as float32 (the engines' own precision); rounding here makes an
    # event equal to itself after a round trip through the log. A value beyond float32's range would
    # become -inf there, which no reader accepts: refused here instead.
    rounded = array("f", values).tolist()
    if _NEGATIVE_INFINITY in rounded:  # a scan in C: the values are <= 0 already, so only -inf can appear
        index = rounded.index(_NEGATIVE_INFINITY)
        raise ValueError(
            f"logprob {values[index]!r} at index {index} is beyond float32's range (it would be stored "
            "as -inf); logprobs must be finite float32 values"
        )
    return rounded


_NEGATIVE_INFINITY: Final = -math.inf
MAX_TOKENS: Final = 4_000_000
"""The most token ids (or logprobs) one array may hold."""


TokenIds = Annotated[list[Annotated[int, Field(ge=0, lt=2**31)]], Field(max_length=MAX_TOKENS)]
Logprobs = Annotated[list[Annotated[float, Field(allow_inf_nan=False, le=0.0)]], AfterValidator(_as_float32)]


def _packer(
    code: str, valid: Callable[[bytes, list[Any]], bool]
) -> tuple[Callable[[Any, ValidatorFunctionWrapHandler], Any], Callable[[list[Any]], str]]:
    """Base64 of a little-endian array (``i``: int32, ``f``: float32) for the wire, and back.

    A packed array's values are int32 or float32 by construction, so when ``valid(raw, values)`` holds
    (checks in C over the whole array: its little-endian bytes, its values), they are the field's value as
    they are: no per-value validation, which cost more than the rest of a reply's parse. Otherwise the
    field's own validation runs and names what is wrong."""

    def unpack(value: Any, validate: ValidatorFunctionWrapHandler) -> Any:
        if not isinstance(value, str):
            return validate(value)  # a list of numbers, validated value by value
        try:  # strict: what b64decode(validate=True) refuses, without its regular expression per array
            raw = binascii.a2b_base64(value, strict_mode=True)
        except ValueError:  # binascii.Error, or a str that is not ASCII
            raise ValueError("not base64 (a packed array is base64 of little-endian 4-byte values)") from None
        if len(raw) % 4:
            raise ValueError(f"a packed array is whole 4-byte values; this one is {len(raw)} bytes")
        packed = array(code, raw)
        if sys.byteorder == "big":
            packed.byteswap()
        values = packed.tolist()
        return values if len(values) <= MAX_TOKENS and valid(raw, values) else validate(values)

    def pack(values: list[Any]) -> str:
        packed = array(code, values)
        if sys.byteorder == "big":
            packed.byteswap()
        return base64.b64encode(packed.tobytes()).decode()

    return unpack, pack


_LOW_BYTES: Final = bytes(range(128))


def _ids_valid(raw: bytes, ids: list[int]) -> bool:
    # int32, so below 2**31 already; none negative: no top byte (every fourth, little-endian) has its high
    # bit set, found by deleting the others (at memory speed, not a Python comparison a value as min() is)
    return not raw[3::4].translate(None, _LOW_BYTES)


def _logprobs_valid(raw: bytes, logprobs: list[float]) -> bool:
    # float32 already; a NaN or an infinity makes the sum NaN or infinite
    return not logprobs or (math.isfinite(sum(logprobs)) and max(logprobs) <= 0.0)


_unpack_ids, _pack_ids = _packer("i", _ids_valid)
_unpack_logprobs, _pack_logprobs = _packer("f", _logprobs_valid)
_PACKED = "; in JSON base64 of little-endian {} values (a list of numbers is accepted too)"

WireTokenIds = Annotated[
    TokenIds,
    WrapValidator(_unpack_ids),
    PlainSerializer(_pack_ids, return_type=str, when_used="json"),
    Field(description="token ids" + _PACKED.format("int32")),
]
"""Token ids on the wire: 4 bytes an id (and a third for base64), not a JSON number each."""
WireLogprobs = Annotated[
    Logprobs,
    WrapValidator(_unpack_logprobs),
    PlainSerializer(_pack_logprobs, return_type=str, when_used="json"),
    Field(description="logprobs" + _PACKED.format("float32")),
]
"""Logprobs on the wire: float32 (what they are), 4 bytes each, not ~20 characters of JSON each."""


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


FLOAT32_TINY: Final = 1.1754943508222875e-38
"""The smallest normal float32 (``numpy.finfo(numpy.float32).tiny``): engines sample in float32, where a
positive value below it is a denormal or 0 (``top_p=1e-300`` becomes 0 and the engine fails)."""


class SamplingParams(Contract):
    """Integers are strict (``max_tokens: true`` is refused, not read as 1; so are ``"5"`` and ``5.0``);
    floats take numbers only (no booleans or strings) and a positive one must survive float32."""

    temperature: NonNegativeFloat = Field(default=1.0, strict=True, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, strict=True)
    top_k: int | None = Field(default=None, ge=1, lt=2**31, strict=True)
    max_tokens: int = Field(default=256, ge=1, lt=2**31, strict=True)
    stop: list[str] = Field(default_factory=list)
    seed: int | None = Field(
        default=None, ge=0, lt=2**63, strict=True, description="what engines take: a 64-bit seed"
    )

    @field_validator("temperature", "top_p")
    @classmethod
    def _float32_representable(cls, value: float) -> float:
        """A positive value that float32 makes a denormal or 0 changes meaning (or fails) in an engine."""
        if 0.0 < value < FLOAT32_TINY:
            raise ValueError(
                f"underflows in float32 (engines sample in float32): use 0 or at least {FLOAT32_TINY:.4g}"
            )
        return value


class Timings(Contract):
    """Milliseconds, measured by the inference consumer from the moment it received the request."""

    # finite: JSON has no infinity (pydantic would store it as null, which no reader parses back)
    queued_ms: NonNegativeFloat = Field(default=0.0, allow_inf_nan=False)
    first_token_ms: NonNegativeFloat = Field(default=0.0, allow_inf_nan=False)
    total_ms: NonNegativeFloat = Field(default=0.0, allow_inf_nan=False)
    restarted_ms: NonNegativeFloat = Field(
        default=0.0,
        allow_inf_nan=False,
        description="time the request ran before a new policy version cut it short and it was run again on "
        "that version (its tokens of the old version dropped; also counted in queued_ms); 0: it ran once",
    )


def version_1_is_2(version: Any) -> Any:
    """A ``schema_version`` "before" validator of models whose version 1 reads as version 2 as it is (a
    turn or a wire message that carried everything). It checks the one field: a model-level "before"
    validator would make pydantic build a whole message as Python objects and validate those, instead of
    reading the JSON straight into the model."""
    return 2 if version == 1 and type(version) is int else version


def default_sampling() -> SamplingParams:
    """The default sampling, one frozen instance for every model that defaults to it (a field's
    ``default_factory``): leaving defaults out of a turn's JSON calls each factory, and building a model
    there cost more than the rest of the comparison."""
    return _DEFAULT_SAMPLING


def default_timings() -> Timings:
    """The default timings (all 0), one frozen instance, as ``default_sampling``."""
    return _DEFAULT_TIMINGS


_DEFAULT_SAMPLING: Final = SamplingParams()
_DEFAULT_TIMINGS: Final = Timings()
