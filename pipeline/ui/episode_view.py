"""One episode as the page shows it: the fold of its events (``pipeline.replay``, never the stored event
data itself) plus the read models' per-turn numbers (discounted return, advantage) when materialized."""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pipeline.replay import ReplayedEpisode, mean_logprob, turn_values
from schemas import ChatMessage, TurnCompleted


@dataclass(frozen=True)
class ToolCallView:
    name: str
    arguments: str
    call_id: str


@dataclass(frozen=True)
class MessageView:
    role: str
    content: str
    name: str | None = None
    tool_call_id: str | None = None
    reasoning: str | None = None
    tool_calls: tuple[ToolCallView, ...] = ()


@dataclass(frozen=True)
class TokenView:
    text: str
    title: str
    color: str
    token_id: int
    decoded: str | None  # with a tokenizer
    logprob: float
    probability: float


@dataclass
class TurnView:
    index: int  # 1-based, in recorded order
    turn: TurnCompleted
    parent_index: int | None
    messages: list[MessageView]
    reply: MessageView
    tokens: list[TokenView]
    new_prompt_ids: list[int]  # what the prompt adds to the parent's prompt and completion
    prompt_text: str | None  # those decoded, with a tokenizer
    reward: float
    discounted_return: float | None
    advantages: list[float]
    numbers: dict[str, str]
    children: list[TurnView] = field(default_factory=list)

    @property
    def turn_id(self) -> str:
        return str(self.turn.turn_id)

    @property
    def short_id(self) -> str:
        return self.turn_id[:8]


@dataclass(frozen=True)
class EpisodeView:
    replayed: ReplayedEpisode
    turns: list[TurnView]
    roots: list[TurnView]
    branching: bool
    tokenizer_name: str | None

    @property
    def lineages(self) -> int:
        return len(self.roots)


def shade(logprob: float) -> str:
    """Green for likely tokens through yellow to red for unlikely ones (``turnstile replay --tokens``'s
    colours, by probability)."""
    p = min(1.0, max(0.0, math.exp(logprob))) if math.isfinite(logprob) else 0.0
    return f"rgb({round(255 * min(1.0, 2 * (1 - p)))},{round(200 * min(1.0, 2 * p))},0)"


def _message(message: ChatMessage) -> MessageView:
    return MessageView(
        role=message.role,
        content=message.content or "",
        name=message.name,
        tool_call_id=message.tool_call_id,
        reasoning=message.reasoning_content,
        tool_calls=tuple(
            ToolCallView(call.function.name, call.function.arguments, call.id)
            for call in message.tool_calls or []
        ),
    )


def new_messages(turn: TurnCompleted, parent: TurnCompleted | None) -> list[ChatMessage]:
    """The messages this turn added to its parent's conversation and reply (all of them for a root)."""
    if parent is None:
        return list(turn.request.messages)
    return list(turn.request.messages[len(parent.request.messages) + 1 :])


def tokens(turn: TurnCompleted, tokenizer: Any | None) -> list[TokenView]:
    shown = []
    for token_id, logprob in zip(turn.completion_token_ids, turn.completion_logprobs, strict=False):
        text = str(tokenizer.decode([token_id])) if tokenizer is not None else str(token_id)
        probability = math.exp(logprob) if math.isfinite(logprob) else 0.0
        about = f"token {token_id}"
        if tokenizer is not None:
            about += f" {json.dumps(text, ensure_ascii=False)}"
        title = f"{about} · logprob {logprob:.4f} · p {probability:.3f}"
        shown.append(
            TokenView(
                text if tokenizer is not None else f"{token_id} ",
                title,
                shade(logprob),
                token_id,
                text if tokenizer is not None else None,
                logprob,
                probability,
            )
        )
    return shown


def new_prompt_ids(turn: TurnCompleted, parent: TurnCompleted | None) -> list[int]:
    """The prompt ids this turn added to its parent's prompt and completion (all of them for a root or a
    turn that broke the prefix): each turn's section shows these, so a page grows with the episode's
    tokens, not with the sum of its prompts."""
    if parent is None or turn.prefix_break:
        return list(turn.prompt_token_ids)
    inherited = len(parent.prompt_token_ids) + len(parent.completion_token_ids)
    return list(turn.prompt_token_ids[inherited:])


def decode(tokenizer: Any | None, ids: list[int]) -> str | None:
    return None if tokenizer is None else str(tokenizer.decode(ids))


def _number(value: float | None, digits: int = 4) -> str:
    if value is None:
        return "\u2013"
    return str(int(value)) if float(value).is_integer() and abs(value) < 1e15 else f"{value:.{digits}g}"


def lineage_numbers(
    turn: TurnCompleted, materialized: Mapping[str, Any] | None, index_of: Mapping[uuid.UUID, int]
) -> dict[str, str]:
    """What the page says of a turn's lineage: the model asked for, whether its reply was delivered and it is
    trained (from the read model once materialized), why its lineage started, and the edit it carries."""
    shown: dict[str, str] = {}
    if turn.model:
        shown["model"] = turn.model
    delivered = materialized.get("delivered") if materialized is not None else None
    if delivered is not None:
        shown["delivered"] = "yes" if delivered else "no: the client was gone (no sample)"
    elif turn.delivered is False:
        shown["delivered"] = "not confirmed yet"
    trained = materialized.get("trained") if materialized is not None else None
    if trained is not None:
        shown["trained"] = "yes" if trained else "no"
    elif turn.train is not None:
        shown["trained"] = "asked" if turn.train else "no (marked)"
    reason = materialized.get("root_reason") if materialized is not None else None
    if reason:
        shown["lineage started"] = str(reason)
    if turn.edit is not None:
        edited = index_of.get(turn.edit.turn_id)
        shown[f"edit of turn {edited}" if edited else "edit"] = "; ".join(turn.edit.changes)
    return shown


def episode_view(
    replayed: ReplayedEpisode,
    *,
    read_model_turns: Mapping[uuid.UUID, Mapping[str, Any]],
    advantages: Mapping[uuid.UUID, Sequence[float]],
    tokenizer: Any | None = None,
    tokenizer_name: str | None = None,
) -> EpisodeView:
    """The page's episode: each turn's new messages, reply, shaded tokens and numbers, and the turn tree
    (by recorded parent; a turn whose parent is not in the episode starts a lineage of its own)."""
    episode = replayed.episode
    values = turn_values(episode, 1.0)
    by_id = {turn.turn_id: turn for turn in episode.turns}
    index_of = {turn.turn_id: index + 1 for index, turn in enumerate(episode.turns)}
    views: list[TurnView] = []
    for index, turn in enumerate(episode.turns):
        parent = by_id.get(turn.parent_turn_id) if turn.parent_turn_id else None
        materialized = read_model_turns.get(turn.turn_id)
        returned = (
            float(materialized["discounted_return"])
            if materialized is not None
            else (None if values.returns is None else values.returns[index])
        )
        timings = turn.timings
        numbers = {
            "finish": turn.reply.finish_reason,
            "prompt tokens": str(len(turn.prompt_token_ids)),
            "completion tokens": str(len(turn.completion_token_ids)),
            "mean logprob": _number(mean_logprob(turn)),
            "reward": _number(values.rewards[index]),
            "return": _number(returned),
            "advantage": ", ".join(_number(a) for a in advantages.get(turn.turn_id, [])) or "\u2013",
            "policy version": f"v{turn.policy_version}",
            "consumer": turn.engine_id,
            "latency": f"{timings.total_ms:.1f} ms",
            "queued": f"{timings.queued_ms:.1f} ms",
            "first token": f"{timings.first_token_ms:.1f} ms",
        }
        if timings.restarted_ms:
            numbers["restarted"] = f"after {timings.restarted_ms:.1f} ms on an older version"
        if turn.chat_template:
            numbers["chat template"] = turn.chat_template
        numbers.update(lineage_numbers(turn, materialized, index_of))
        reply = ChatMessage(
            role="assistant", content=turn.reply.text, tool_calls=turn.reply.tool_calls or None
        )
        reply_view = _message(reply)
        if turn.reply.reasoning:
            reply_view = MessageView(
                role="assistant",
                content=reply_view.content,
                reasoning=turn.reply.reasoning,
                tool_calls=reply_view.tool_calls,
            )
        views.append(
            TurnView(
                index=index + 1,
                turn=turn,
                parent_index=index_of.get(turn.parent_turn_id) if turn.parent_turn_id else None,
                messages=[_message(message) for message in new_messages(turn, parent)],
                reply=reply_view,
                tokens=tokens(turn, tokenizer),
                new_prompt_ids=(added := new_prompt_ids(turn, parent)),
                prompt_text=decode(tokenizer, added),
                reward=values.rewards[index],
                discounted_return=returned,
                advantages=list(advantages.get(turn.turn_id, [])),
                numbers=numbers,
            )
        )
    roots = []
    for view in views:
        if view.parent_index is None:
            roots.append(view)
        else:
            views[view.parent_index - 1].children.append(view)
    branching = len(roots) > 1 or any(len(view.children) > 1 for view in views)
    return EpisodeView(replayed, views, roots, branching, tokenizer_name)
