"""Events of the ``episode-<id>`` streams: one agent episode from start to finish."""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationInfo, model_validator

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

Termination = Literal["done", "max_turns", "truncated", "error", "cancelled", "timeout", "aborted"]


class EpisodeStarted(Contract):
    type: Literal["EpisodeStarted"] = "EpisodeStarted"
    schema_version: Literal[1] = 1
    event_id: uuid.UUID = Field(default_factory=uuid.uuid4)
    episode_id: str = Field(min_length=1)
    task: dict[str, Any] = Field(default_factory=dict)
    task_id: str
    group_id: str | None = None
    group_size: int = Field(
        default=1, ge=1, lt=2**31, description="episodes in the group (GRPO-style advantages)"
    )
    agent: str
    policy: str = Field(min_length=1)
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    tags: dict[str, str] = Field(default_factory=dict)
    retry_of: str | None = Field(
        default=None, description="episode id of the failed attempt this one retries"
    )


class TurnRequest(Contract):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolSpec] = Field(default_factory=list)
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    tool_choice: ToolChoice | None = Field(default=None, description="None: auto")


class TurnReply(Contract):
    text: str
    tool_calls: list[ToolCall] = Field(default_factory=list)
    finish_reason: FinishReason
    reasoning: str | None = Field(
        default=None, description="the model's reasoning (``<think>`` ... ``</think>``), apart from ``text``"
    )


class TurnCompleted(Contract):
    """One LLM call and its reply, with the engine's own tokens.

    The three token arrays are stored in a binary column of the log, never as JSON numbers.
    """

    type: Literal["TurnCompleted"] = "TurnCompleted"
    schema_version: Literal[1] = 1
    event_id: uuid.UUID = Field(default_factory=uuid.uuid4)
    turn_id: uuid.UUID = Field(default_factory=uuid.uuid4)
    parent_turn_id: uuid.UUID | None = None
    request: TurnRequest
    reply: TurnReply
    prompt_token_ids: TokenIds
    completion_token_ids: TokenIds
    completion_logprobs: Logprobs
    policy_version: int = Field(ge=0, lt=2**31)
    engine_id: str
    timings: Timings = Field(default_factory=Timings)
    prefix_break: bool = False
    render_drift: bool | None = Field(
        default=None,
        description="whether the prompt differs from what a full re-render of its messages would give "
        "(re-tokenizing the conversation would have changed what the policy saw); None: not checked",
    )
    chat_template: str | None = Field(default=None, description="sha256 of the chat template, 12 hex digits")

    @model_validator(mode="after")
    def _one_logprob_per_completion_token(self, info: ValidationInfo) -> TurnCompleted:
        # Checked when writing; a stored event is read as it is (a reader must never stop on the log).
        tolerant = info.context is not None and info.context.get("tolerant")
        if not tolerant and len(self.completion_logprobs) != len(self.completion_token_ids):
            raise ValueError(
                f"{len(self.completion_logprobs)} completion_logprobs for {len(self.completion_token_ids)} "
                "completion_token_ids: one logprob per completion token"
            )
        return self


class RewardAssigned(Contract):
    type: Literal["RewardAssigned"] = "RewardAssigned"
    schema_version: Literal[1] = 1
    event_id: uuid.UUID = Field(default_factory=uuid.uuid4)
    turn_id: uuid.UUID | None = Field(default=None, description="the rewarded turn; none rewards the episode")
    value: float = Field(allow_inf_nan=False)
    source: str = "agent"


class EpisodeFinished(Contract):
    type: Literal["EpisodeFinished"] = "EpisodeFinished"
    schema_version: Literal[1] = 1
    event_id: uuid.UUID = Field(default_factory=uuid.uuid4)
    termination: Termination
    metrics: dict[str, float] = Field(default_factory=dict)
    error: str | None = Field(default=None, description="the traceback when termination is 'error'")


EpisodeEvent = Annotated[
    EpisodeStarted | TurnCompleted | RewardAssigned | EpisodeFinished, Field(discriminator="type")
]
