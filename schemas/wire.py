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


class LLMResponse(Contract):
    type: Literal["LLMResponse"] = "LLMResponse"
    schema_version: Literal[1] = 1
    request_id: uuid.UUID
    text: str
    tool_calls: list[ToolCall] = Field(default_factory=list)
    finish_reason: FinishReason
    prompt_token_ids: TokenIds
    completion_token_ids: TokenIds
    completion_logprobs: Logprobs
    policy_version: int = Field(ge=0, lt=2**31)
    consumer_id: str
    timings: Timings = Field(default_factory=Timings)
    prefix_break: bool = False


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
