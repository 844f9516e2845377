"""Reading recorded turns whole: a ``TurnCompleted`` holds what it adds to its parent turn (messages after
the parent's conversation, prompt ids after the parent's prompt + completion, no tools when they are the
parent's); ``expand_turn`` gives the whole turn back from its parent, made whole first, and ``turn_delta`` is
its inverse. Pure functions over the contract's models: the readers (the fold, replay, the replay backend)
use these; ``turn_delta`` is what a writer records (the session computes the same from the consumer's
reply, without building whole prompts).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence

from pipeline.errors import TurnstileError
from schemas import ChatMessage, Event, TurnCompleted, TurnReply


class UnfoldableTurn(TurnstileError):
    """A recorded turn that takes from a parent it does not match (missing, or shorter than it says)."""


def reply_message(reply: TurnReply) -> ChatMessage:
    """A reply as the assistant message that continues its conversation."""
    return ChatMessage(
        role="assistant",
        content=reply.text,
        tool_calls=reply.tool_calls or None,
        reasoning_content=reply.reasoning,
    )


def conversation(turn: TurnCompleted) -> list[ChatMessage]:
    """A whole turn's messages then its reply: what a turn that continues it begins with."""
    return [*turn.request.messages, reply_message(turn.reply)]


def expand_turn(turn: TurnCompleted, parent: TurnCompleted | None) -> TurnCompleted:
    """The whole turn (nothing left to its parent) from a recorded one and its parent, itself whole.

    Costs what the whole turn holds (list copies), never a walk of the ancestors: the parent is whole."""
    if not turn.is_delta:
        return turn
    if parent is None or parent.turn_id != turn.parent_turn_id or parent.is_delta:
        raise UnfoldableTurn(
            f"turn {turn.turn_id} takes from its parent turn {turn.parent_turn_id}, which is not recorded "
            "before it in its episode"
        )
    inherited = conversation(parent)
    cut, ancestry = (
        len(parent.prompt_token_ids),
        len(parent.prompt_token_ids) + len(parent.completion_token_ids),
    )
    if turn.prefix_messages > len(inherited) or turn.prefix_tokens > ancestry:
        raise UnfoldableTurn(
            f"turn {turn.turn_id} takes {turn.prefix_messages} messages and {turn.prefix_tokens} prompt ids "
            f"from its parent turn {parent.turn_id}, which has {len(inherited)} and {ancestry}"
        )
    if turn.prefix_tokens <= cut:
        prompt = [*parent.prompt_token_ids[: turn.prefix_tokens], *turn.prompt_token_ids]
    else:
        taken = parent.completion_token_ids[: turn.prefix_tokens - cut]
        prompt = [*parent.prompt_token_ids, *taken, *turn.prompt_token_ids]
    request = turn.request.model_copy(
        update={
            "messages": [*inherited[: turn.prefix_messages], *turn.request.messages],
            "tools": parent.request.tools if turn.tools_from_parent else turn.request.tools,
        }
    )
    return turn.model_copy(
        update={
            "request": request,
            "prompt_token_ids": prompt,
            "prefix_messages": 0,
            "prefix_tokens": 0,
            "tools_from_parent": False,
        }
    )


def turn_delta(turn: TurnCompleted, parent: TurnCompleted | None) -> TurnCompleted:
    """What a whole turn adds to its whole parent: the inverse of ``expand_turn``.

    Messages are taken while they equal the parent's conversation exactly (an agent that dropped the
    reasoning of a reply sends that reply again, so it is recorded again); prompt ids when the prompt
    begins with all of the parent's prompt + completion ids (else the prompt is recorded whole)."""
    if parent is None or turn.parent_turn_id != parent.turn_id or turn.is_delta:
        return turn
    inherited = conversation(parent)
    sent = turn.request.messages
    shared = 0
    limit = min(len(inherited), len(sent) - 1)  # a turn adds at least one message
    while shared < limit and sent[shared] == inherited[shared]:
        shared += 1
    cut = len(parent.prompt_token_ids)
    ancestry = cut + len(parent.completion_token_ids)
    prompt = turn.prompt_token_ids
    extends = (
        len(prompt) >= ancestry
        and prompt[:cut] == parent.prompt_token_ids
        and prompt[cut:ancestry] == parent.completion_token_ids
    )
    tools_shared = bool(turn.request.tools) and turn.request.tools == parent.request.tools
    if not (shared or extends or tools_shared):
        return turn
    request = turn.request.model_copy(
        update={"messages": sent[shared:], "tools": [] if tools_shared else turn.request.tools}
    )
    return turn.model_copy(
        update={
            "request": request,
            "prompt_token_ids": prompt[ancestry:] if extends else prompt,
            "prefix_messages": shared,
            "prefix_tokens": ancestry if extends else 0,
            "tools_from_parent": tools_shared,
        }
    )


def expand_turns(turns: Sequence[TurnCompleted]) -> list[TurnCompleted]:
    """Whole turns from an episode's recorded turns, in stream order (a parent precedes its children)."""
    return [turn for turn in whole_events(turns) if isinstance(turn, TurnCompleted)]


def whole_events(events: Sequence[Event]) -> list[Event]:
    """An episode's events in stream order, its turns made whole (``expand_turn``)."""
    whole: dict[uuid.UUID, TurnCompleted] = {}
    result: list[Event] = []
    for event in events:
        if isinstance(event, TurnCompleted):
            parent = whole.get(event.parent_turn_id) if event.parent_turn_id is not None else None
            event = whole[event.turn_id] = expand_turn(event, parent)
        result.append(event)
    return result
