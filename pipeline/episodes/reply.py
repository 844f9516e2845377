"""What ``llm.chat`` returns."""

from __future__ import annotations

import functools
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from schemas import ChatMessage, FinishReason, TokenLogprob, ToolCall


@dataclass(frozen=True)
class ChatReply:
    """What ``llm.chat`` returns: the reply, and the engine's tokens for it."""

    turn_id: uuid.UUID
    text: str
    tool_calls: list[ToolCall]
    finish_reason: FinishReason
    prompt_ids: Callable[[], list[int]] = field(repr=False, compare=False)
    """Builds the whole prompt from what the episode recorded, once, when it is asked for (a long
    conversation's prompt is not copied on every turn that nobody reads it on)."""
    completion_token_ids: list[int]
    completion_logprobs: list[float]
    policy_version: int
    token_logprobs: list[TokenLogprob] | None = None
    """Each completion token's text and bytes, when the call asked for ``top_logprobs``."""
    top_logprobs: list[list[TokenLogprob]] | None = None
    reasoning: str | None = None
    """The model's reasoning, split from ``text`` (see ``schemas.TurnReply.reasoning``)."""
    parent_turn_id: uuid.UUID | None = None
    """The recorded turn this one continues token-exactly (None: a root)."""
    prefix_tokens: int = 0
    """How many leading prompt ids are the parent turn's prompt + completion ids."""
    added_prompt_ids: list[int] = field(default_factory=list, repr=False)
    """The prompt ids after those: what this turn adds (the whole prompt for a root). With the parent's
    ids they make the whole prompt; alone they keep a reply's size flat as the conversation grows."""

    @property
    def prompt_token_count(self) -> int:
        """The whole prompt's length, without building it."""
        return self.prefix_tokens + len(self.added_prompt_ids)

    @functools.cached_property
    def prompt_token_ids(self) -> list[int]:
        """The prompt's token ids, the engine's own."""
        return self.prompt_ids()

    @property
    def message(self) -> ChatMessage:
        """The assistant message to append to the conversation for the next turn."""
        return ChatMessage(
            role="assistant",
            content=self.text,
            tool_calls=self.tool_calls or None,
            reasoning_content=self.reasoning,
        )
