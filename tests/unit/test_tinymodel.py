"""The tiny offline model: deterministic build, loading, chat template, tokenizer and a forward pass."""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from pipeline.inference.tinymodel import CONTROL_TOKENS, MARKUP_TOKENS, build_tiny_model  # noqa: E402

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}
TOOLS_SECTION = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    + json.dumps(CALCULATOR)
    + "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
    "<args-json-object>}\n</tool_call><|im_end|>\n"
)


def _call(call_id: str, expression: str, *, as_string: bool = True) -> dict[str, Any]:
    arguments: Any = {"expression": expression}
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": "calculator", "arguments": json.dumps(arguments) if as_string else arguments},
    }


CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 3*4 and 5+6?"},
    {
        "role": "assistant",
        "reasoning_content": "Two sums, one call each.",
        "content": "Calling the calculator.",
        "tool_calls": [_call("c1", "3*4"), _call("c2", "5+6", as_string=False)],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "12"},
    {"role": "tool", "tool_call_id": "c2", "content": "11"},
    {"role": "assistant", "content": "12 and 11."},
    {"role": "user", "content": "Now 7*8?"},
    {"role": "assistant", "content": None, "tool_calls": [_call("c3", "7*8")]},
    {"role": "tool", "tool_call_id": "c3", "content": "56"},
    {"role": "assistant", "content": "56."},
]


@pytest.fixture(scope="module")
def offline() -> Iterator[None]:
    import huggingface_hub.constants

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")
        patch.setenv("TRANSFORMERS_OFFLINE", "1")
        patch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
        yield


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory, offline: None) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Any:
    return transformers.AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def model(model_dir: Path) -> Any:
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()


def _render(tokenizer: Any, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    text = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    assert isinstance(text, str)
    return text


def _digests(directory: Path) -> dict[str, str]:
    return {
        path.name: hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(directory.iterdir())
        if path.is_file()
    }


def test_builds_are_byte_identical(tmp_path: Path, model_dir: Path) -> None:
    again = build_tiny_model(tmp_path / "again")
    assert again == tmp_path / "again"
    digests = _digests(model_dir)
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(digests)
    assert _digests(again) == digests


def test_seed_changes_only_the_weights(tmp_path: Path, model_dir: Path) -> None:
    other = _digests(build_tiny_model(tmp_path / "other", seed=1))
    same = _digests(model_dir)
    assert other["model.safetensors"] != same["model.safetensors"]
    assert other["tokenizer.json"] == same["tokenizer.json"]


def test_loads_offline(tokenizer: Any, model: Any) -> None:
    assert 900 <= len(tokenizer) <= 1100
    assert model.config.vocab_size == len(tokenizer)
    assert model.config.model_type == "qwen2"
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token == "<|endoftext|>"
    assert model.config.eos_token_id == tokenizer.eos_token_id
    assert model.config.pad_token_id == tokenizer.pad_token_id
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id
    assert model.dtype == torch.float32


def test_added_tokens_are_single_ids(tokenizer: Any) -> None:
    ids = [tokenizer.convert_tokens_to_ids(token) for token in CONTROL_TOKENS + MARKUP_TOKENS]
    assert ids == [0, 1, 2, *range(len(tokenizer) - len(MARKUP_TOKENS), len(tokenizer))]
    for token, token_id in zip(CONTROL_TOKENS + MARKUP_TOKENS, ids, strict=True):
        assert tokenizer.encode(token, add_special_tokens=False) == [token_id]
        assert token_id in tokenizer.encode(f"x{token}y", add_special_tokens=False)
    # Markup survives skip_special_tokens, as in Qwen2.5, so tool calls can be parsed from decoded text.
    text = "<|im_start|>assistant\n<tool_call>\n{}\n</tool_call><|im_end|>"
    decoded = tokenizer.decode(tokenizer.encode(text, add_special_tokens=False), skip_special_tokens=True)
    assert decoded == "assistant\n<tool_call>\n{}\n</tool_call>"


def test_untied_output_layer(model: Any) -> None:
    embeddings = model.get_input_embeddings().weight
    output = model.get_output_embeddings().weight
    assert output.data_ptr() != embeddings.data_ptr()
    assert not torch.equal(output, embeddings)


def test_loaded_tokenizer_matches_tokenizer_json(model_dir: Path, tokenizer: Any) -> None:
    # transformers 5 loads a qwen2 directory with Qwen2Tokenizer, which rebuilds the normalizer and
    # pre-tokenizer itself; engines that read tokenizer.json directly must still get the same ids.
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    text = _render(tokenizer, CONVERSATION, tools=[CALCULATOR]) + "Grüße, 世界! 12345 + 0.5 = ½ 🙂"
    assert tokenizer.encode(text, add_special_tokens=False) == raw.encode(text, add_special_tokens=False).ids
    assert raw.get_vocab_size(with_added_tokens=True) == len(tokenizer)


def test_byte_level_round_trip(tokenizer: Any) -> None:
    # Any NFC text round-trips (the tokenizer normalizes to NFC, as Qwen2's does).
    for text in ("Grüße, 世界! 12345 + 0.5 = ½ 🙂\n\ttabs  and   spaces ", " leading space", ""):
        assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text
    rendered = _render(tokenizer, CONVERSATION, tools=[CALCULATOR])
    assert tokenizer.decode(tokenizer.encode(rendered, add_special_tokens=False)) == rendered


def test_chat_template_small_case(tokenizer: Any) -> None:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 3*4?"},
        {"role": "assistant", "content": None, "tool_calls": [_call("c1", "3*4")]},
        {"role": "tool", "tool_call_id": "c1", "content": "12"},
    ]
    assert _render(tokenizer, messages, tools=[CALCULATOR], add_generation_prompt=True) == (
        "<|im_start|>system\nYou are terse.\n\n"
        + TOOLS_SECTION
        + "<|im_start|>user\nWhat is 3*4?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "3*4"}}\n'
        "</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n12\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_chat_template_without_tools_or_system(tokenizer: Any) -> None:
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "reasoning_content": "Greet back.", "content": "Hello!"},
    ]
    assert _render(tokenizer, messages) == (
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nGreet back.\n</think>\n\nHello!<|im_end|>\n"
    )
    # Tools without a system message create one; no default system prompt is ever injected.
    assert _render(tokenizer, messages[:1], tools=[CALCULATOR]) == (
        "<|im_start|>system\n" + TOOLS_SECTION + "<|im_start|>user\nHi<|im_end|>\n"
    )


def test_chat_template_tool_calls_and_results(tokenizer: Any) -> None:
    text = _render(tokenizer, CONVERSATION, tools=[CALCULATOR])
    assert text.startswith("<|im_start|>system\nYou are terse.\n\n# Tools\n")
    assert text.count("<|im_start|>system") == 1
    assert (
        "<|im_start|>assistant\n<think>\nTwo sums, one call each.\n</think>\n\nCalling the calculator.\n"
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "3*4"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "5+6"}}\n</tool_call><|im_end|>\n'
    ) in text
    # Consecutive tool results share one user turn, as in Qwen2.5.
    assert (
        "<|im_start|>user\n<tool_response>\n12\n</tool_response>\n<tool_response>\n11\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n12 and 11.<|im_end|>\n"
    ) in text


@pytest.mark.parametrize("system", [True, False], ids=["system", "no-system"])
@pytest.mark.parametrize("tools", [None, [CALCULATOR]], ids=["no-tools", "tools"])
def test_chat_template_is_message_local(
    tokenizer: Any, tools: list[dict[str, Any]] | None, system: bool
) -> None:
    conversation = CONVERSATION if system else CONVERSATION[1:]
    full = _render(tokenizer, conversation, tools=tools)
    full_ids = tokenizer.encode(full, add_special_tokens=False)
    for k in range(1, len(conversation) + 1):
        head = conversation[:k]
        if k < len(conversation) and head[-1]["role"] == conversation[k]["role"] == "tool":
            continue  # inside a run of tool results: that shared user turn is not closed yet
        prefix = _render(tokenizer, head, tools=tools)
        assert full.startswith(prefix), k
        assert full_ids[: len(ids := tokenizer.encode(prefix, add_special_tokens=False))] == ids, k
        if k < len(conversation) and conversation[k]["role"] == "assistant":
            prompt = _render(tokenizer, head, tools=tools, add_generation_prompt=True)
            assert full.startswith(prompt), k


def test_forward_pass_is_not_degenerate(tokenizer: Any, model: Any) -> None:
    prompt = _render(tokenizer, CONVERSATION[:2], add_generation_prompt=True)
    input_ids = torch.tensor([tokenizer.encode(prompt, add_special_tokens=False)])
    with torch.no_grad():
        logits = model(input_ids=input_ids).logits
    assert logits.shape == (1, input_ids.shape[1], len(tokenizer))
    assert torch.isfinite(logits).all()
    probabilities = torch.softmax(logits[0, -1], dim=-1)
    entropy = float(-(probabilities * probabilities.clamp_min(1e-12).log()).sum())
    assert entropy > 0.5 * math.log(len(tokenizer))
    assert float(probabilities.max()) < 0.5
    assert len(set(logits[0].argmax(dim=-1).tolist())) > 1
