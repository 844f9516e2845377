"""The long-context tiny model and the scripted policy: an agent-sized prompt, answered on purpose, with
engine token ids and logprobs that a forward pass over the whole prompt confirms."""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import uuid
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from consumers.inference import InferenceConfig, create_backend  # noqa: E402
from pipeline.episodes import EpisodeSession  # noqa: E402
from pipeline.episodes.fold import whole_events  # noqa: E402
from pipeline.errors import ConfigError  # noqa: E402
from pipeline.inference.backends.torch_backend import TorchBackend, attention_reach  # noqa: E402
from pipeline.inference.client import NatsLLMClient  # noqa: E402
from pipeline.inference.script import Script  # noqa: E402
from pipeline.inference.tinymodel import LONG_MAX_POSITIONS, LONG_WINDOW  # noqa: E402
from pipeline.log import EventStore  # noqa: E402
from schemas import ChatMessage, LLMError, LLMRequest, SamplingParams, TurnCompleted  # noqa: E402
from tests.conftest import Servers  # noqa: E402
from tests.support.reference import recomputed_logprobs  # noqa: E402
from tests.support.serving import serving  # noqa: E402

REACH = 2 * (LONG_WINDOW - 1)
COMMAND = "echo turnstile > written.txt"
SCRIPT: dict[str, Any] = {
    "rules": [
        {
            "name": "run a command",
            "when": {"tool": "Bash", "tool_result": False},
            "reply": {
                "content": "I will write the file.",
                "tool_calls": [{"name": "Bash", "arguments": {"command": COMMAND, "description": "Write"}}],
            },
        },
        {"name": "final answer", "when": {"tool_result": True}, "reply": {"content": "The file is written."}},
        {
            "name": "title",
            "when": {"tools": False, "contains": "title"},
            "reply": {"content": "Writing a file"},
        },
    ]
}
WORD_TEXT = """
agent tool file shell command read write edit search test run build commit branch diff patch user system
always never must should prefer avoid when before after output result error path directory project code
"""
WORDS = WORD_TEXT.split()


def agent_tools(count: int = 16) -> list[dict[str, Any]]:
    """Tools shaped like an agent CLI's: a shell tool named Bash, the rest with long descriptions."""
    rng = random.Random(16)
    names = ["Bash", *(f"Tool{i}" for i in range(1, count))]
    return [
        {
            "type": "function",
            "function": {
                "name": name,
                "description": " ".join(rng.choice(WORDS) for _ in range(400)),
                "parameters": {
                    "type": "object",
                    "properties": {"command": {"type": "string"}, "description": {"type": "string"}},
                    "required": ["command"],
                },
            },
        }
        for name in names
    ]


def agent_system_prompt(words: int = 9000) -> str:
    rng = random.Random(61)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def long_text(tokens_wanted: int, tokenizer: Any) -> str:
    """Deterministic text of at least ``tokens_wanted`` tokens."""
    text = agent_system_prompt(tokens_wanted)
    assert len(tokenizer.encode(text, add_special_tokens=False)) >= tokens_wanted
    return text


@pytest.fixture(scope="module")
def script_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("script") / "script.json"
    path.write_text(json.dumps(SCRIPT))
    return path


@pytest.fixture(scope="module")
def plain(long_model_dir: Path) -> TorchBackend:
    return TorchBackend(long_model_dir, max_batch=4)


@pytest.fixture(scope="module")
def scripted(long_model_dir: Path) -> TorchBackend:
    return TorchBackend(long_model_dir, max_batch=4, script=Script.model_validate(SCRIPT))


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_long_model_is_the_tiny_model_with_a_window_and_a_long_context(
    long_model_dir: Path, tiny_model_dir: Path
) -> None:
    config = transformers.AutoConfig.from_pretrained(long_model_dir)
    assert config.layer_types == ["sliding_attention", "sliding_attention"]
    assert (config.sliding_window, config.max_position_embeddings) == (LONG_WINDOW, LONG_MAX_POSITIONS)
    assert attention_reach(config) == REACH
    assert attention_reach(transformers.AutoConfig.from_pretrained(tiny_model_dir)) is None
    # same seed, same weights; same vocabulary and template
    for name in ("model.safetensors", "tokenizer.json"):
        assert _digest(long_model_dir / name) == _digest(tiny_model_dir / name), name
    tokenizer = transformers.AutoTokenizer.from_pretrained(long_model_dir)
    assert tokenizer.model_max_length == LONG_MAX_POSITIONS


async def test_sampled_logprobs_past_the_reach_equal_a_forward_pass_over_the_whole_prompt(
    plain: TorchBackend, long_model_dir: Path
) -> None:
    # ~6x the reach: the backend runs only the prompt's tail; the reference runs all of it.
    content = long_text(6 * REACH, plain.tokenizer)
    requests = [
        LLMRequest(
            policy="p",
            messages=[ChatMessage(role="user", content=content[:length])],
            sampling=SamplingParams(max_tokens=8, seed=i, temperature=1.0),
        )
        for i, length in enumerate((len(content), len(content) // 2, 300))
    ]  # one left-padded batch: two tails from different starts, and a prompt shorter than the reach
    generations = await asyncio.gather(*(plain.generate(request) for request in requests))
    assert [len(g.prompt_token_ids) > REACH for g in generations] == [True, True, False]
    for generation in generations:
        expected = recomputed_logprobs(
            long_model_dir, generation.prompt_token_ids, generation.completion_token_ids
        )
        difference = max(abs(a - b) for a, b in zip(generation.completion_logprobs, expected, strict=True))
        assert difference <= 2e-6
    # the tolerance sees a tail one token short of the reach (measured ~3e-5 off)
    prompt = generations[0].prompt_token_ids
    start = len(prompt) - REACH
    with torch.inference_mode():
        short = plain.model(
            torch.tensor([prompt[start:]]), position_ids=torch.arange(start, len(prompt))[None]
        ).logits[0, -1]
        full = plain.model(torch.tensor([prompt])).logits[0, -1]
    assert float((torch.log_softmax(short, -1) - torch.log_softmax(full, -1)).abs().max()) > 2e-6


async def test_a_scripted_reply_is_the_tokenizers_ids_scored_by_a_forward_pass(
    scripted: TorchBackend, long_model_dir: Path
) -> None:
    request = LLMRequest(
        policy="p",
        messages=[ChatMessage(role="user", content=long_text(3 * REACH, scripted.tokenizer))],
        tools=agent_tools(2),
        top_logprobs=2,
    )
    generation = await scripted.generate(request)
    text = generation.text
    assert text.startswith("I will write the file.\n<tool_call>\n")
    assert generation.completion_token_ids == [
        *scripted.tokenizer.encode(text, add_special_tokens=False),
        *scripted.eos_ids[:1],
    ]
    assert generation.finish_reason == "stop"
    assert generation.prompt_token_ids == scripted.renderer.prompt(request).token_ids
    expected = recomputed_logprobs(
        long_model_dir, generation.prompt_token_ids, generation.completion_token_ids
    )
    assert max(abs(a - b) for a, b in zip(generation.completion_logprobs, expected, strict=True)) <= 2e-6
    assert generation.top_logprobs is not None
    assert all(top[0][1] >= top[1][1] for top in generation.top_logprobs)
    # an engine stops at max_tokens: so does the script
    cut = await scripted.generate(request.model_copy(update={"sampling": SamplingParams(max_tokens=3)}))
    assert (cut.completion_token_ids, cut.finish_reason) == (generation.completion_token_ids[:3], "length")
    # ... and after the token that completes a stop string
    stopped = await scripted.generate(request.model_copy(update={"sampling": SamplingParams(stop=["write"])}))
    ids = stopped.completion_token_ids
    assert (ids, stopped.finish_reason) == (generation.completion_token_ids[: len(ids)], "stop")
    assert "write" in stopped.text
    assert "write" not in scripted.tokenizer.decode(ids[:-1])


async def test_a_scripted_agent_episode_over_an_agent_sized_prompt_continues_token_exactly(
    servers: Servers, store: EventStore, long_model_dir: Path, script_file: Path
) -> None:
    policy = f"p{uuid.uuid4().hex[:8]}"
    config = InferenceConfig(servers.nats_url, policy, model=long_model_dir, script=script_file)
    client = await NatsLLMClient.connect(servers.nats_url, wait_for_consumer=10.0)
    async with serving(config) as service:
        backend = service.backend
        assert isinstance(backend, TorchBackend)
        session = EpisodeSession(store, client, policy=policy, agent="tests")
        await session.start()
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": agent_system_prompt()},
            {"role": "user", "content": "Write the file, please."},
        ]
        tools = agent_tools()
        first = await session.chat(messages, tools=tools)
        assert len(first.prompt_token_ids) >= 20_000
        (call,) = first.tool_calls
        assert (call.function.name, json.loads(call.function.arguments)["command"]) == ("Bash", COMMAND)
        messages += [
            first.message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": ""},
        ]
        second = await session.chat(messages, tools=tools)
        assert (second.text, second.tool_calls) == ("The file is written.", [])
        title = await session.chat([{"role": "user", "content": "Give this conversation a title."}])
        assert title.text == "Writing a file"
        await session.finish("done")
    await client.close()

    turns = [e for e in whole_events(session.events) if isinstance(e, TurnCompleted)]
    assert [t.parent_turn_id for t in turns] == [None, turns[0].turn_id, None]  # the side call: own root
    assert not any(t.prefix_break for t in turns)
    assert [t.render_drift for t in turns] == [False, False, False]
    history = [*turns[0].prompt_token_ids, *turns[0].completion_token_ids]
    assert turns[1].prompt_token_ids[: len(history)] == history
    replies = [rule.reply.text() for rule in Script.model_validate(SCRIPT).rules]
    for turn, reply in zip(turns, replies, strict=True):
        encoded = backend.tokenizer.encode(reply, add_special_tokens=False)
        assert turn.completion_token_ids == [*encoded, *backend.eos_ids[:1]]
        # exact past the reach (the test above): a forward pass over the last 4k tokens is the whole's
        prompt = turn.prompt_token_ids[-4096:]
        expected = recomputed_logprobs(long_model_dir, prompt, turn.completion_token_ids)
        assert max(abs(a - b) for a, b in zip(turn.completion_logprobs, expected, strict=True)) <= 2e-6


async def test_a_request_no_rule_matches_gets_an_error_naming_it_and_the_consumer_stays_up(
    servers: Servers, long_model_dir: Path, script_file: Path
) -> None:
    policy = f"p{uuid.uuid4().hex[:8]}"
    config = InferenceConfig(servers.nats_url, policy, model=long_model_dir, script=script_file)
    async with serving(config) as service:
        unforeseen = LLMRequest(policy=policy, messages=[ChatMessage(role="user", content="hello")])
        error = LLMError.model_validate_json(
            await service.handle(unforeseen.model_dump_json().encode(), None)
        )
        assert error.field == "messages"
        assert "no rule of the script matches" in error.message
        assert "tools none" in error.message
        titled = LLMRequest(policy=policy, messages=[ChatMessage(role="user", content="a title?")])
        assert b'"text":"Writing a file"' in await service.handle(titled.model_dump_json().encode(), None)


def test_rules_match_in_order_on_what_the_request_carries() -> None:
    script = Script.model_validate(SCRIPT)
    tools = [agent_tools(1)[0]]

    def rule(*messages: tuple[str, str], with_tools: bool = True) -> str | None:
        request = LLMRequest(
            policy="p",
            messages=[ChatMessage(role=role, content=content) for role, content in messages],  # type: ignore[arg-type]
            tools=tools if with_tools else [],
        )
        matched = script.match(request)
        return matched.name if matched else None

    assert rule(("user", "go")) == "run a command"
    assert rule(("user", "go"), ("tool", "ok")) == "final answer"
    assert rule(("user", "go"), ("tool", "ok"), ("user", "more")) == "final answer"
    assert rule(("user", "a title please"), with_tools=False) == "title"
    assert rule(("user", "go"), with_tools=False) is None


def test_a_scripted_reply_renders_as_the_chat_template_renders_it_back(long_model_dir: Path) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(long_model_dir)
    reply = Script.model_validate(SCRIPT).rules[0].reply
    call = reply.tool_calls[0]
    message = {
        "role": "assistant",
        "content": reply.content,
        "tool_calls": [{"function": {"name": call.name, "arguments": json.dumps(call.arguments)}}],
    }
    rendered = tokenizer.apply_chat_template([message], tokenize=False)
    assert rendered == f"<|im_start|>assistant\n{reply.text()}<|im_end|>\n"


def test_a_bad_script_file_is_a_config_error_naming_what_was_wrong(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"rules": [{"when": {"tool_called": "Bash"}, "reply": {}}]}))
    with pytest.raises(ConfigError, match=r"rules\.0\.when\.tool_called"):
        Script.load(bad)
    with pytest.raises(ConfigError, match="cannot read the script"):
        Script.load(tmp_path / "missing.json")
    with pytest.raises(ConfigError, match="needs the torch backend"):
        create_backend(InferenceConfig("nats://x", "p", backend="scripted", script=bad))
