"""A recorded turn as a conversation that later turns of its session extend token-exactly (``TurnContext``),
as the session that recorded it holds it, or rebuilt from the log by another (a gateway replica:
``EpisodeSession.from_log``)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from pipeline.episodes.reply import ChatReply
from pipeline.errors import TurnstileError
from schemas import ChatMessage, ToolSpec, TurnCompleted


@dataclass(frozen=True, slots=True)
class TurnContext:
    """A recorded turn as a conversation that later turns may extend (token-exact continuation).

    Its token ids are held as the recorded turn holds them, what it adds to its parent's context (a chain):
    a session's memory grows with what its episode adds, not with the history of every turn."""

    turn: TurnCompleted
    messages: list[ChatMessage]
    tools: list[ToolSpec]
    reply: ChatMessage
    parent: TurnContext | None
    length: int
    """Prompt + completion ids of the whole turn."""
    tokens_key: str | None
    """Under which the consumer that answered keeps the whole turn (``LLMResponse.tokens_key``)."""

    def token_ids(self) -> list[int]:
        """The whole turn's prompt + completion ids, gathered along the chain."""
        parts: list[list[int]] = []
        node: TurnContext | None = self
        end = self.length
        while node is not None and end > 0:
            own = node.turn.prefix_tokens
            parts.append([*node.turn.prompt_token_ids, *node.turn.completion_token_ids][: end - own])
            end, node = own, node.parent
        return list(itertools.chain.from_iterable(reversed(parts)))

    def prompt_ids(self) -> list[int]:
        return self.token_ids()[: self.length - len(self.turn.completion_token_ids)]


def recorded_context(turn: TurnCompleted, parent: TurnContext | None) -> TurnContext:
    """A recorded turn as a conversation to continue, from its parent's (``parent``: the context of its
    ``parent_turn_id``, None for a root). A turn records what it adds: its messages after the first
    ``prefix_messages`` of the parent's conversation, its tools unless they are the parent's."""
    if turn.parent_turn_id is not None and parent is None:
        raise TurnstileError(
            f"turn {turn.turn_id} continues turn {turn.parent_turn_id}, which is not recorded before it"
        )
    inherited = [*parent.messages, parent.reply][: turn.prefix_messages] if parent is not None else []
    tools = parent.tools if parent is not None and turn.tools_from_parent else turn.request.tools
    return TurnContext(
        turn=turn,
        messages=[*inherited, *turn.request.messages],
        tools=list(tools),
        reply=ChatMessage(
            role="assistant",
            content=turn.reply.text,
            tool_calls=turn.reply.tool_calls or None,
            reasoning_content=turn.reply.reasoning,
        ),
        parent=parent if turn.prefix_tokens else None,
        length=turn.prefix_tokens + len(turn.prompt_token_ids) + len(turn.completion_token_ids),
        tokens_key=None,  # which consumer holds the tokens is not recorded: the next call sends them
    )


def recorded_reply(context: TurnContext) -> ChatReply:
    """What ``chat`` returned for a recorded turn (without the per-token alternatives, which are not
    recorded)."""
    turn = context.turn
    return ChatReply(
        turn_id=turn.turn_id,
        text=turn.reply.text,
        tool_calls=list(turn.reply.tool_calls),
        finish_reason=turn.reply.finish_reason,
        prompt_ids=context.prompt_ids,
        completion_token_ids=turn.completion_token_ids,
        completion_logprobs=turn.completion_logprobs,
        policy_version=turn.policy_version,
        reasoning=turn.reply.reasoning,
        parent_turn_id=turn.parent_turn_id,
        prefix_tokens=turn.prefix_tokens,
        added_prompt_ids=turn.prompt_token_ids,
    )
