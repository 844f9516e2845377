"""Messages on ``llm.<policy>.requests``: a request and the reply (or error) on its inbox."""

from __future__ import annotations

import uuid
from typing import Annotated, Literal

from pydantic import Field

from schemas.base import Contract
from schemas.common import (
    ChatMessage,
    FinishReason,
    Logprobs,
    SamplingParams,
    Timings,
    TokenIds,
    ToolCall,
    ToolChoice,
    ToolSpec,
)


class TokenPrefix(Contract):
    """The exact tokens of an earlier turn that the request's first ``message_count`` messages render to.

    The inference consumer tokenizes only the messages after them (token-exact continuation).
    """

    token_ids: TokenIds
    message_count: int = Field(ge=1, lt=2**31)


class TokenLogprob(Contract):
    """One token as an API shows it: its id, the text it decodes to on its own, its raw bytes (a token that
    is part of a multi-byte character decodes to U+FFFD; its bytes are exact) and its logprob."""

    token_id: int = Field(ge=0, lt=2**31)
    text: str
    bytes: list[Annotated[int, Field(ge=0, le=255)]]
    logprob: float = Field(le=0.0, allow_inf_nan=False, description="-9999.0 for a token the model rules out")


class LLMRequest(Contract):
    type: Literal["LLMRequest"] = "LLMRequest"
    schema_version: Literal[1] = 1
    request_id: uuid.UUID = Field(default_factory=uuid.uuid4)
    policy: str = Field(min_length=1)
    episode_id: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolSpec] = Field(default_factory=list)
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    prefix: TokenPrefix | None = None
    tool_choice: ToolChoice | None = Field(default=None, description="None: auto")
    top_logprobs: int | None = Field(
        default=None,
        ge=0,
        le=20,
        description="None: no per-token detail; k: each completion token's text and bytes, with the k most "
        "likely tokens at its position",
    )


class LLMResponse(Contract):
    type: Literal["LLMResponse"] = "LLMResponse"
    schema_version: Literal[1] = 1
    request_id: uuid.UUID
    text: str
    tool_calls: list[ToolCall] = Field(default_factory=list)
    finish_reason: FinishReason
    reasoning: str | None = Field(
        default=None, description="the model's reasoning, split from ``text`` at the consumer's markers"
    )
    prompt_token_ids: TokenIds
    completion_token_ids: TokenIds
    completion_logprobs: Logprobs
    policy_version: int = Field(ge=0, lt=2**31)
    consumer_id: str
    timings: Timings = Field(default_factory=Timings)
    prefix_break: bool = False
    render_drift: bool | None = Field(
        default=None,
        description="whether the prompt differs from a full re-render of its messages with the template "
        "(None: not checked)",
    )
    chat_template: str | None = Field(default=None, description="sha256 of the chat template, 12 hex digits")
    token_logprobs: list[TokenLogprob] | None = Field(
        default=None, description="the completion's tokens with their text, when the request set top_logprobs"
    )
    top_logprobs: list[list[TokenLogprob]] | None = Field(
        default=None, description="per completion token, the request's top_logprobs most likely tokens"
    )


ErrorCode = Literal["invalid_request", "payload_too_large", "engine_error", "unavailable"]


class LLMError(Contract):
    type: Literal["LLMError"] = "LLMError"
    schema_version: Literal[1] = 1
    request_id: uuid.UUID | None = None
    code: ErrorCode
    message: str
    field: str | None = Field(default=None, description="dotted path of the request field that was refused")
    consumer_id: str | None = None


LLMReply = Annotated[LLMResponse | LLMError, Field(discriminator="type")]
WireMessage = Annotated[LLMRequest | LLMResponse | LLMError, Field(discriminator="type")]
