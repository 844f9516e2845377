"""Messages on ``llm.<policy>.requests``: a request and the reply (or error) on its inbox."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from schemas.base import Contract
from schemas.common import (
    ChatMessage,
    FinishReason,
    SamplingParams,
    Timings,
    ToolCall,
    ToolChoice,
    ToolSpec,
    WireLogprobs,
    WireTokenIds,
    default_sampling,
    default_timings,
    version_1_is_2,
)
from schemas.ids import new_uuid


class TokenPrefix(Contract):
    """The exact tokens of an earlier turn that the conversation's first ``message_count`` messages render
    to. The inference consumer tokenizes only the messages after them (token-exact continuation).

    ``token_ids`` are the tokens; or None, and ``key`` names them: the earlier reply's ``tokens_key``, under
    which its consumer keeps that turn's prompt + completion ids, messages and tools. Then the request
    carries only what is new (``messages`` after the prefix, no tools) and a consumer that lacks the key
    answers ``prefix_unknown``; the requester sends the request again with the tokens and everything.
    """

    token_ids: WireTokenIds | None = None
    key: str | None = Field(default=None, min_length=1, max_length=200)
    token_count: int | None = Field(default=None, ge=0, lt=2**31, description="len(token_ids)")
    message_count: int = Field(ge=1, lt=2**31)

    @model_validator(mode="after")
    def _tokens_or_key(self) -> TokenPrefix:
        if self.token_ids is None and (self.key is None or self.token_count is None):
            raise ValueError("a prefix holds token_ids, or names them by key with their token_count")
        if self.token_ids is not None and self.token_count not in (None, len(self.token_ids)):
            raise ValueError(f"token_count {self.token_count} but {len(self.token_ids)} token_ids")
        return self

    @property
    def ids(self) -> Sequence[int]:
        """The token ids; a held prefix is resolved by the consumer before a backend sees it, to the
        sequence the consumer keeps it in (not necessarily a list: read it, do not copy it needlessly)."""
        if self.token_ids is None:
            raise ValueError(f"prefix {self.key!r} is held by a consumer: resolve it first")
        return self.token_ids

    @property
    def held(self) -> bool:
        """The tokens, messages and tools are the consumer's (by ``key``), not in the request."""
        return self.token_ids is None


class TokenLogprob(Contract):
    """One token as an API shows it: its id, the text it decodes to on its own, its raw bytes (a token that
    is part of a multi-byte character decodes to U+FFFD; its bytes are exact) and its logprob."""

    token_id: int = Field(ge=0, lt=2**31)
    text: str
    bytes: list[Annotated[int, Field(ge=0, le=255)]]
    logprob: float = Field(le=0.0, allow_inf_nan=False, description="-9999.0 for a token the model rules out")


class LLMRequest(Contract):
    """One LLM call. ``messages`` is the whole conversation, except with a held prefix
    (``prefix.token_ids`` None): then only the messages after its ``message_count``, and no tools."""

    type: Literal["LLMRequest"] = "LLMRequest"
    schema_version: Literal[2] = 2
    request_id: uuid.UUID = Field(default_factory=new_uuid)
    policy: str = Field(min_length=1)
    episode_id: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolSpec] = Field(default_factory=list)
    sampling: SamplingParams = Field(default_factory=default_sampling)
    prefix: TokenPrefix | None = None
    tool_choice: ToolChoice | None = Field(default=None, description="None: auto")
    top_logprobs: int | None = Field(
        default=None,
        ge=0,
        le=20,
        description="None: no per-token detail; k: each completion token's text and bytes, with the k most "
        "likely tokens at its position",
    )

    _upcast_v1_v2 = field_validator("schema_version", mode="before")(version_1_is_2)

    @model_validator(mode="after")
    def _held_prefix_sends_no_tools(self) -> LLMRequest:
        if self.prefix is not None and self.prefix.held and self.tools:
            raise ValueError("with a held prefix (prefix.key) the tools are the consumer's: send none")
        return self


class LLMResponse(Contract):
    """A reply. ``prompt_token_ids`` are the prompt after its first ``prompt_prefix_tokens`` ids (the
    request's prefix, which the requester has): the reply never echoes the history."""

    type: Literal["LLMResponse"] = "LLMResponse"
    schema_version: Literal[2] = 2
    request_id: uuid.UUID
    text: str
    tool_calls: list[ToolCall] = Field(default_factory=list)
    finish_reason: FinishReason
    reasoning: str | None = Field(
        default=None, description="the model's reasoning, split from ``text`` at the consumer's markers"
    )
    prompt_token_ids: WireTokenIds
    prompt_prefix_tokens: int = Field(
        default=0, ge=0, lt=2**31, description="prompt ids before prompt_token_ids: the request's prefix"
    )
    completion_token_ids: WireTokenIds
    completion_logprobs: WireLogprobs
    policy_version: int = Field(ge=0, lt=2**31)
    consumer_id: str
    tokens_key: str | None = Field(
        default=None,
        description="the consumer keeps this turn's prompt + completion ids, messages and tools under this "
        "key for a while: a request that continues the turn may name it (prefix.key) instead of sending them",
    )
    timings: Timings = Field(default_factory=default_timings)
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

    _upcast_v1_v2 = field_validator("schema_version", mode="before")(version_1_is_2)


ErrorCode = Literal["invalid_request", "payload_too_large", "engine_error", "unavailable", "prefix_unknown"]


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
