"""Events of the ``episode-<id>`` streams: one agent episode from start to finish."""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

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
    default_sampling,
    default_timings,
    version_1_is_2,
)
from schemas.ids import new_uuid

Termination = Literal["done", "max_turns", "truncated", "error", "cancelled", "timeout", "aborted"]


class EpisodeStarted(Contract):
    type: Literal["EpisodeStarted"] = "EpisodeStarted"
    schema_version: Literal[1] = 1
    event_id: uuid.UUID = Field(default_factory=new_uuid)
    episode_id: str = Field(min_length=1)
    task: dict[str, Any] = Field(default_factory=dict)
    task_id: str
    group_id: str | None = None
    group_size: int = Field(
        default=1, ge=1, lt=2**31, description="episodes in the group (GRPO-style advantages)"
    )
    agent: str
    policy: str = Field(min_length=1)
    sampling: SamplingParams = Field(default_factory=default_sampling)
    tags: dict[str, str] = Field(default_factory=dict)
    retry_of: str | None = Field(
        default=None, description="episode id of the failed attempt this one retries"
    )


class TurnRequest(Contract):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolSpec] = Field(default_factory=list)
    sampling: SamplingParams = Field(default_factory=default_sampling)
    tool_choice: ToolChoice | None = Field(default=None, description="None: auto")


class TurnReply(Contract):
    text: str
    tool_calls: list[ToolCall] = Field(default_factory=list)
    finish_reason: FinishReason
    reasoning: str | None = Field(
        default=None, description="the model's reasoning (``<think>`` ... ``</think>``), apart from ``text``"
    )


class TurnEdit(Contract):
    """What a client changed in substance in a reply it sent back (a different command, other text): the
    turn that carries it does not continue the edited turn's tokens (the policy never wrote the edit), so it
    starts a lineage of its own, and this says why."""

    turn_id: uuid.UUID = Field(description="the recorded turn whose reply came back changed")
    changes: list[str] = Field(min_length=1, description="what changed, one sentence each")


class TurnCompleted(Contract):
    """One LLM call and its reply, with the engine's own tokens: what the turn adds to its parent.

    A turn that continues its parent (``parent_turn_id``) records only what it adds: the messages after the
    parent's conversation and reply (``prefix_messages`` of them are the parent's, not repeated), the prompt
    ids after the parent's prompt + completion ids (``prefix_tokens`` of them, glue excluded: the glue is
    recorded), and no tools when they are the parent's (``tools_from_parent``). A root, or a turn whose
    prompt does not extend its parent's tokens, records everything (the prefix counts are 0). An episode's
    storage therefore grows linearly with its turns; ``pipeline.episodes.expand_turns`` gives the full
    turns back. Version 1 (every turn whole) is read as version 2 with nothing inherited.

    The three token arrays are stored in a binary column of the log, never as JSON numbers.
    """

    type: Literal["TurnCompleted"] = "TurnCompleted"
    schema_version: Literal[2] = 2
    event_id: uuid.UUID = Field(default_factory=new_uuid)
    turn_id: uuid.UUID = Field(default_factory=new_uuid)
    parent_turn_id: uuid.UUID | None = None
    prefix_messages: int = Field(
        default=0,
        ge=0,
        lt=2**31,
        description="leading messages of the request that are the parent turn's messages and its reply, "
        "left out of request.messages",
    )
    prefix_tokens: int = Field(
        default=0,
        ge=0,
        lt=2**31,
        description="leading prompt ids that are the parent turn's prompt + completion ids, left out of "
        "prompt_token_ids",
    )
    tools_from_parent: bool = Field(
        default=False, description="the request's tools are the parent turn's (request.tools is empty)"
    )
    request: TurnRequest
    reply: TurnReply
    prompt_token_ids: TokenIds
    completion_token_ids: TokenIds
    completion_logprobs: Logprobs
    policy_version: int = Field(ge=0, lt=2**31)
    engine_id: str
    timings: Timings = Field(default_factory=default_timings)
    prefix_break: bool = False
    render_drift: bool | None = Field(
        default=None,
        description="whether the prompt differs from what a full re-render of its messages would give "
        "(re-tokenizing the conversation would have changed what the policy saw); None: not checked",
    )
    chat_template: str | None = Field(default=None, description="sha256 of the chat template, 12 hex digits")
    delivered: bool | None = Field(
        default=None,
        description="False: the reply had reached no client when the turn was recorded (a gateway records "
        "every turn so and appends a TurnDelivered once the reply is handed to a live connection); without "
        "that the agent never saw it and it is no training sample; None: delivered in process, or not known "
        "(older turns)",
    )
    train: bool | None = Field(
        default=None,
        description="False: marked not for training (a side call such as a title or a small model's call, by "
        "the gateway's x-turnstile-train header or the session's untrained_models): recorded and shown, no "
        "sample and no share of the episode's reward; True: asked for training (kept even when the lineage "
        "rule would call it a side call); None: the materializer's lineage rule decides (older turns too)",
    )
    model: str | None = Field(
        default=None,
        max_length=1000,
        description="the model name the client asked for (the request's model field); None: not given",
    )
    edit: TurnEdit | None = Field(
        default=None,
        description="set when the call sent back an earlier reply changed in substance: which turn, what "
        "changed (the turn is then a root: see docs/lineages.md)",
    )

    # Version 1 recorded every turn whole: it is version 2 with nothing taken from the parent.
    _upcast_v1_v2 = field_validator("schema_version", mode="before")(version_1_is_2)

    @property
    def is_delta(self) -> bool:
        """Whether the turn leaves out part of its request or prompt (its parent holds it)."""
        return bool(self.prefix_messages or self.prefix_tokens or self.tools_from_parent)

    @model_validator(mode="after")
    def _one_logprob_per_completion_token(self, info: ValidationInfo) -> TurnCompleted:
        # Checked when writing; a stored event is read as it is (a reader must never stop on the log).
        tolerant = info.context is not None and info.context.get("tolerant")
        if not tolerant and len(self.completion_logprobs) != len(self.completion_token_ids):
            raise ValueError(
                f"{len(self.completion_logprobs)} completion_logprobs for {len(self.completion_token_ids)} "
                "completion_token_ids: one logprob per completion token"
            )
        if not tolerant and self.is_delta and self.parent_turn_id is None:
            raise ValueError(
                "prefix_messages, prefix_tokens and tools_from_parent take from the parent turn: set "
                "parent_turn_id, or record the whole turn (all three 0/false)"
            )
        if not tolerant and self.tools_from_parent and self.request.tools:
            raise ValueError("tools_from_parent: the tools are the parent's; leave request.tools empty")
        return self


class TurnDelivered(Contract):
    """Replies handed to a live client after their turns were recorded (``TurnCompleted.delivered`` False
    until then). Appended with the session's next event, so it costs no append of its own."""

    type: Literal["TurnDelivered"] = "TurnDelivered"
    schema_version: Literal[1] = 1
    event_id: uuid.UUID = Field(default_factory=new_uuid)
    turn_ids: list[uuid.UUID] = Field(min_length=1)


class RewardAssigned(Contract):
    type: Literal["RewardAssigned"] = "RewardAssigned"
    schema_version: Literal[1] = 1
    event_id: uuid.UUID = Field(default_factory=new_uuid)
    turn_id: uuid.UUID | None = Field(default=None, description="the rewarded turn; none rewards the episode")
    value: float = Field(allow_inf_nan=False)
    source: str = "agent"


class EpisodeFinished(Contract):
    type: Literal["EpisodeFinished"] = "EpisodeFinished"
    schema_version: Literal[1] = 1
    event_id: uuid.UUID = Field(default_factory=new_uuid)
    termination: Termination
    metrics: dict[str, float] = Field(default_factory=dict)
    error: str | None = Field(default=None, description="the traceback when termination is 'error'")


EpisodeEvent = Annotated[
    EpisodeStarted | TurnCompleted | TurnDelivered | RewardAssigned | EpisodeFinished,
    Field(discriminator="type"),
]
