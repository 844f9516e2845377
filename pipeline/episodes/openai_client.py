"""``llm.openai()``: an OpenAI SDK client whose chat completions are turns of an episode, in process."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

from pipeline.dialects import ChatCall, ChatResult, ChoiceData, OpenAIRequestError, openai_client
from pipeline.episodes.refusals import InvalidLLMCall
from pipeline.episodes.reply import ChatReply
from pipeline.inference import RequestRejected
from schemas import ChatMessage, SamplingParams, ToolChoice, ToolSpec

if TYPE_CHECKING:  # only for the annotation: openai_client imports the SDK when a client is made
    from openai import AsyncOpenAI

ChatTurn = Callable[
    [list[ChatMessage], list[ToolSpec], SamplingParams, ToolChoice | None, int | None], Awaitable[ChatReply]
]
"""One recorded turn of an episode (``EpisodeSession.chat``)."""


def chat_result(episode_id: str, replies: Sequence[ChatReply], *, whole_prompt: bool = False) -> ChatResult:
    """The OpenAI-shaped result of ``n`` recorded turns, with the ``turnstile`` field: the turn ids, the
    turn's token ids as it records them, and the policy version.

    The prompt's ids come as the turn records them, not whole: ``prefix_tokens`` (how many leading ids are
    the ``parent_turn_id`` turn's prompt + completion ids, which an earlier reply carried) and
    ``added_prompt_token_ids`` (the rest), so a reply's size and the work to encode it stay flat as the
    conversation grows (a 30k-token history would otherwise travel back on every turn: ~120 KB of JSON
    numbers). ``whole_prompt`` (the gateway's ``x-turnstile-prompt-ids: whole`` header) adds the whole
    prompt as ``prompt_token_ids`` for clients that want it without stitching.
    """
    choices = [
        ChoiceData(
            text=reply.text,
            tool_calls=reply.tool_calls,
            finish_reason=reply.finish_reason,
            completion_token_ids=reply.completion_token_ids,
            completion_logprobs=reply.completion_logprobs,
            token_texts=[token.text for token in reply.token_logprobs] if reply.token_logprobs else None,
            token_logprobs=reply.token_logprobs,
            top_logprobs=reply.top_logprobs,
            reasoning=reply.reasoning,
        )
        for reply in replies
    ]
    first = replies[0]
    extra: dict[str, Any] = {
        "episode_id": episode_id,
        "turn_ids": [str(reply.turn_id) for reply in replies],
        "parent_turn_id": str(first.parent_turn_id) if first.parent_turn_id else None,
        "prefix_tokens": first.prefix_tokens,
        "added_prompt_token_ids": first.added_prompt_ids,
        "completion_token_ids": [reply.completion_token_ids for reply in replies],
        "policy_version": first.policy_version,
    }
    if whole_prompt:
        extra["prompt_token_ids"] = first.prompt_token_ids
    return ChatResult(choices=choices, prompt_tokens=first.prompt_token_count, extra={"turnstile": extra})


def wanted_detail(call: ChatCall) -> int | None:
    """What to ask the consumer for: per-token detail with ``top_logprobs`` alternatives when the call asked
    for logprobs, else none (it would only grow the reply)."""
    return call.top_logprobs if call.logprobs else None


def episode_openai_client(
    chat: ChatTurn, *, episode_id: str, policy: str, defaults: SamplingParams
) -> AsyncOpenAI:
    """An OpenAI client of the episode: every ``chat.completions.create`` becomes ``n`` recorded turns
    (``n`` > 1: sibling branches), made with ``chat``; ``policy`` is the model it names.

    Besides the OpenAI fields, the body carries ``turnstile``: the turn ids and the engine's token ids.
    ``tool_choice`` is recorded with the turn; ``none`` is enforced, the others are not (no constrained
    decoding: see ``schemas.ToolChoice``).
    """

    async def handle(call: ChatCall) -> ChatResult:
        try:
            replies = await asyncio.gather(
                *(
                    chat(call.messages, call.tools, call.sampling, call.tool_choice, wanted_detail(call))
                    for _ in range(call.n)
                )
            )
        except (InvalidLLMCall, RequestRejected) as error:
            raise OpenAIRequestError(str(error), param=getattr(error, "field", None)) from None
        return chat_result(episode_id, replies)

    return openai_client(handle, model=policy, defaults=defaults)
