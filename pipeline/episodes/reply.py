"""What ``llm.chat`` returns."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from schemas import ChatMessage, FinishReason, TokenLogprob, ToolCall


@dataclass(frozen=True, slots=True)
class ChatReply:
    """What ``llm.chat`` returns: the reply, and the engine's tokens for it."""

    turn_id: uuid.UUID
    text: str
    tool_calls: list[ToolCall]
    finish_reason: FinishReason
    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    completion_logprobs: list[float]
    policy_version: int
    token_logprobs: list[TokenLogprob] | None = None
    """Each completion token's text and bytes, when the call asked for ``top_logprobs``."""
    top_logprobs: list[list[TokenLogprob]] | None = None
    reasoning: str | None = None
    """The model's reasoning, split from ``text`` (see ``schemas.TurnReply.reasoning``)."""

    @property
    def message(self) -> ChatMessage:
        """The assistant message to append to the conversation for the next turn."""
        return ChatMessage(
            role="assistant",
            content=self.text,
            tool_calls=self.tool_calls or None,
            reasoning_content=self.reasoning,
        )
