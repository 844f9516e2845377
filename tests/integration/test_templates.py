"""Token-exact continuation on the chat templates real models ship, with real tokenizers.

A six-turn tool conversation (tool calls, tool results, a user follow-up, a reply with reasoning) goes through
``ChatRenderer`` turn by turn; each completion is what the template itself renders for that assistant message,
ending on the model's stop token. Every continued prompt must begin with the previous prompt + completion
(no ``prefix_break``) and never hold two end tokens in a row.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import uuid
from pathlib import Path
from typing import Any

import pytest

from consumers.inference import InferenceConfig
from pipeline.episodes import EpisodeSession, expand_turns
from pipeline.inference.chat import ChatRenderer
from pipeline.inference.client import NatsLLMClient
from pipeline.log import EventStore
from schemas import (
    ChatMessage,
    LLMRequest,
    SamplingParams,
    TokenPrefix,
    ToolSpec,
    TurnCompleted,
)
from tests.conftest import Servers
from tests.support.real_templates import PAIRS, build_model, tokenizer_with_template
from tests.support.serving import serving
from tests.support.template_conversation import SCRIPT, TOOLS, assert_new_part_is_the_templates_own


def deepseek(name: str) -> str:
    """A DeepSeek special token: full-width bars (U+FF5C) around the name, U+2581 for its spaces."""
    return "<\uff5c" + name.replace(" ", "\u2581") + "\uff5c>"


END_MARKERS = ("<|im_end|>", "<|eot_id|>", deepseek("end of sentence"))


def completion_text(template: str, reply: ChatMessage) -> str:
    """What a model trained on ``template`` writes for ``reply`` (before its stop token)."""
    if reply.tool_calls:
        function = reply.tool_calls[0].function
        arguments = json.loads(function.arguments)
        if template == "llama-3.1-json":
            return json.dumps({"name": function.name, "parameters": arguments})
        if template == "deepseek-v3":
            return (
                f"{deepseek('tool calls begin')}{deepseek('tool call begin')}function{deepseek('tool sep')}"
                f"{function.name}\n```json\n{json.dumps(arguments)}\n```"
                f"{deepseek('tool call end')}{deepseek('tool calls end')}"
            )
        return f"<tool_call>\n{json.dumps({'name': function.name, 'arguments': arguments})}\n</tool_call>"
    text = reply.content or ""
    if template == "qwen3" and reply.reasoning_content:
        return f"<think>\n{reply.reasoning_content}\n</think>\n\n{text}"
    return text


@pytest.mark.parametrize(("tokenizer_name", "template"), PAIRS)
def test_a_six_turn_tool_conversation_continues_token_exactly(tokenizer_name: str, template: str) -> None:
    tokenizer = tokenizer_with_template(tokenizer_name, template)
    stop_ids = {tokenizer.eos_token_id}
    for marker in END_MARKERS:
        ids = tokenizer.encode(marker, add_special_tokens=False)
        if len(ids) == 1:
            stop_ids.add(ids[0])
    renderer = ChatRenderer(tokenizer, stop_ids=stop_ids)
    ends = [
        tokenizer.encode(m, add_special_tokens=False) for m in END_MARKERS if m in tokenizer.chat_template
    ]
    stop = ends[0][0] if ends and len(ends[0]) == 1 else tokenizer.eos_token_id  # what the model stops on
    messages = [
        ChatMessage(role="system", content="You are a careful calculator."),
        ChatMessage(role="user", content="What is (2+3)*7? Use the calculator."),
    ]
    prefix: TokenPrefix | None = None
    breaks, extended, drifted = 0, 0, 0
    for reply, following in SCRIPT:
        request = LLMRequest(policy="p", messages=messages, tools=TOOLS, prefix=prefix)
        prompt = renderer.prompt(request)
        breaks += prompt.prefix_break
        drifted += bool(prompt.render_drift)
        assert prompt.render_drift is not None  # every turn is checked against a full re-render
        if prefix is not None:
            extended += prompt.token_ids[: len(prefix.token_ids)] == prefix.token_ids
            assert_new_part_is_the_templates_own(renderer, request, prompt.token_ids, len(prefix.token_ids))
        pairs = zip(prompt.token_ids, prompt.token_ids[1:], strict=False)
        assert not any(a in stop_ids and b in stop_ids for a, b in pairs), "two end tokens in a row"
        completion = [*tokenizer.encode(completion_text(template, reply), add_special_tokens=False), stop]
        prefix = TokenPrefix(token_ids=[*prompt.token_ids, *completion], message_count=len(messages) + 1)
        messages = [*messages, reply, *following]
    print(f"{tokenizer_name} + {template}: prefix_break {breaks}, extends {extended}/5, drift {drifted}/5")
    if renderer.closers - renderer.stop_ids:
        assert (breaks, extended) == (0, len(SCRIPT) - 1)
    else:
        # a stand-in tokenizer without the template's markers: BPE merges across the seam where a full render
        # would, so those turns are not the template's own tokens and are flagged; the others extend exactly
        assert breaks + extended == len(SCRIPT) - 1


@pytest.mark.parametrize(("tokenizer_name", "template"), PAIRS)
def test_the_start_up_diagnosis_of_each_real_template(tokenizer_name: str, template: str) -> None:
    problems = ChatRenderer(tokenizer_with_template(tokenizer_name, template)).diagnose()
    assert not [p for p in problems if "prefix_break" in p or "cannot render" in p]  # all continue exactly
    # Qwen3 renders the last assistant with an empty <think> block, DeepSeek-V3 ends a render in a newline:
    # a full re-render differs from the continued tokens, and the consumer says so when it starts.
    assert bool(problems) == (template in ("qwen3", "deepseek-v3"))


@pytest.mark.slow
@pytest.mark.parametrize(("tokenizer_name", "template"), PAIRS)
async def test_episodes_through_a_torch_consumer_on_a_real_template_continue_token_exactly(
    servers: Servers, store: EventStore, server_dir: Path, tokenizer_name: str, template: str
) -> None:
    """Three six-turn episodes on a random-weight model of the real tokenizer and template, served by
    ``turnstile serve inference --backend torch``'s service and driven by an ``EpisodeSession``: the agent
    sends each reply back and adds a tool result or a user message, as a tool agent does."""
    model_dir = build_model(tokenizer_name, template, server_dir / "model")
    policy = f"t{uuid.uuid4().hex[:8]}"
    config = InferenceConfig(servers.nats_url, policy, model=model_dir, consumer_id="real", max_batch=4)
    llm = await NatsLLMClient.connect(servers.nats_url, wait_for_consumer=30.0)
    try:
        async with serving(config):

            async def episode(seed: int) -> list[TurnCompleted]:
                session = EpisodeSession(
                    store, llm, policy=policy, sampling=SamplingParams(max_tokens=8, seed=seed)
                )
                await session.start()
                messages = [ChatMessage(role="user", content="What is (2+3)*7? Use the calculator.")]
                for turn in range(6):
                    reply = await session.chat(messages, TOOLS)
                    follow = ChatMessage(role="user", content=f"Go on ({turn}).")
                    messages = [*messages, reply.message, follow]
                await session.finish("done")
                recorded = [e for e in session.events if isinstance(e, TurnCompleted)]
                # every continued turn records only what it adds to its parent's tokens
                assert all(t.prefix_tokens > 0 for t in recorded[1:])
                return expand_turns(recorded)

            episodes = await asyncio.gather(*(episode(seed) for seed in range(3)))
    finally:
        await llm.close()
    breaks = sum(t.prefix_break for turns in episodes for t in turns)
    extended = sum(
        later.prompt_token_ids[: len(earlier.prompt_token_ids) + len(earlier.completion_token_ids)]
        == earlier.prompt_token_ids + earlier.completion_token_ids
        for turns in episodes
        for earlier, later in itertools.pairwise(turns)
    )
    samples = concat_samples_of(episodes)
    print(
        f"e2e {tokenizer_name} + {template}: prefix_break {breaks}, extends {extended}/15, samples {samples}"
    )
    assert (breaks, extended, samples) == (0, 15, 3)
    assert all(t.chat_template is not None for turns in episodes for t in turns)
    assert all(t.render_drift is not None for turns in episodes for t in turns[1:])


def concat_samples_of(episodes: list[list[TurnCompleted]]) -> int:
    """How many concat-style samples the episodes make (one per root-to-leaf path: 1 each when exact)."""
    from pipeline.materialize.trajectory import Turn, concat_samples, discounted_rewards, parents

    total = 0
    for turns in episodes:
        items = [
            Turn(
                turn_id=t.turn_id, episode_id="e", index=i, prompt_token_ids=tuple(t.prompt_token_ids),
                completion_token_ids=tuple(t.completion_token_ids),
                completion_logprobs=tuple(t.completion_logprobs), policy_version=0, reward=0.0,
            )
            for i, t in enumerate(turns)
        ]  # fmt: skip
        tree = parents(items)
        total += len(concat_samples(items, tree, discounted_rewards(items, tree, 1.0)))
    return total


async def test_tools_read_back_from_the_log_render_as_they_were_sent(store: EventStore) -> None:
    """jsonb reorders object keys; a tool's parameters are kept as text, so a turn read back from the log
    re-renders (``tools | tojson`` in the system prompt) exactly as it was rendered for the model."""
    parameters = {
        "type": "object",
        "required": ["alpha_long", "z"],
        "properties": {"alpha_long": {"type": "string", "description": "first"}, "z": {"type": "number"}},
    }
    tools = [
        ToolSpec.model_validate({"function": {"name": "f", "description": "d", "parameters": parameters}})
    ]
    messages = [ChatMessage(role="user", content="hi")]
    sent = turn_with(messages, tools)
    await store.append("episode-tools", [sent], None)
    [recorded] = [r.event for r in await store.read_stream("episode-tools")]
    assert isinstance(recorded, TurnCompleted)
    assert json.dumps(recorded.request.tools[0].function.parameters) == json.dumps(parameters)  # same order
    renderer = ChatRenderer(tokenizer_with_template("qwen", "qwen2.5-instruct"))
    as_sent = LLMRequest(policy="p", messages=messages, tools=tools)
    read_back = LLMRequest(policy="p", messages=recorded.request.messages, tools=recorded.request.tools)
    assert renderer.full(read_back) == renderer.full(as_sent)
    stored = await raw_tools(store)
    assert list(stored["properties"]) == ["z", "alpha_long"]  # what jsonb would have done to a dict


def turn_with(messages: list[ChatMessage], tools: list[ToolSpec]) -> TurnCompleted:
    from schemas import TurnReply, TurnRequest

    return TurnCompleted(
        request=TurnRequest(messages=messages, tools=tools),
        reply=TurnReply(text="ok", finish_reason="stop"),
        prompt_token_ids=[1, 2],
        completion_token_ids=[3],
        completion_logprobs=[-0.5],
        policy_version=0,
        engine_id="e",
    )


async def raw_tools(store: EventStore) -> dict[str, Any]:
    """The parameters as jsonb holds a dict (to show the reordering the text avoids)."""
    async with store.engine.connect() as connection:
        text = (
            await connection.exec_driver_sql(
                "SELECT data->'request'->'tools'->0->'function'->>'parameters' FROM events "
                "WHERE stream = 'episode-tools'"
            )
        ).scalar_one()
        reordered = (await connection.exec_driver_sql(f"SELECT CAST('{text}' AS jsonb)::text")).scalar_one()
    return dict(json.loads(reordered))
