"""A tiny causal language model, built offline and deterministically.

``build_tiny_model`` writes a Qwen2-style model with random weights and a byte-level BPE tokenizer of
1,000 tokens into a directory that ``AutoTokenizer`` / ``AutoModelForCausalLM`` load without a model hub.
Tests and local runs of the inference consumer use it: they need a real model, not a good one.

The tokenizer is trained on a corpus generated here from a fixed seed (arithmetic questions, short English
sentences, JSON tool calls, ChatML conversations), so it never depends on downloaded data; ``seed`` only
picks the model's random weights. It uses Qwen2's own normalizer (NFC) and pre-tokenizer (Qwen2's split
regex, then byte-level), because transformers 5 loads any ``qwen2`` model directory with
``Qwen2Tokenizer``, which rebuilds that pipeline around the saved vocabulary: trained any other way, the
loaded tokenizer would not match ``tokenizer.json``.

The chat template is ChatML in the style of Qwen2.5 with hermes tool calls and no default system prompt,
so rendering a conversation's first k messages gives a prefix of rendering all of it (except inside a run
of consecutive tool results, which share one user turn as in Qwen2.5). Building twice with the same seed
gives byte-identical files.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from tokenizers import AddedToken, Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers
from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM, Qwen2Tokenizer
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
CONTROL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
"""Special tokens (ids 0-2): dropped by ``decode(..., skip_special_tokens=True)``."""
MARKUP_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>")
"""Never split, but (as in Qwen2.5) not special: they survive ``skip_special_tokens`` for the parsers."""
VOCAB_SIZE = 1000
"""The whole vocabulary, added tokens included."""
MAX_POSITIONS = 4096
LONG_MAX_POSITIONS = 131072
"""The long model's context: Claude Code asks for 128,000 output tokens; agent prompts run 20k-60k tokens."""
LONG_WINDOW = 256
"""The long model's sliding attention window, on every layer (see ``build_long_model``)."""

_CORPUS_SEED = 20240601
_CORPUS_DOCUMENTS = 4000

CHAT_TEMPLATE = r"""{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if messages and messages[0].role == 'system' %}
{{- (messages[0].content or '') + '\n\n' }}
{%- endif %}
{{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' }}
{{- 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}
{%- for tool in tools %}
{{- '\n' + (tool | tojson) }}
{%- endfor %}
{{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments ' }}
{{- 'within <tool_call></tool_call> XML tags:\n<tool_call>\n' }}
{{- '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' }}
{%- elif messages and messages[0].role == 'system' %}
{{- '<|im_start|>system\n' + (messages[0].content or '') + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' and loop.first %}
{%- elif message.role == 'assistant' %}
{%- set content = message.content or '' %}
{{- '<|im_start|>assistant\n' }}
{%- if message.reasoning_content %}
{{- '<think>\n' + message.reasoning_content + '\n</think>\n\n' }}
{%- endif %}
{{- content }}
{%- for call in message.tool_calls or [] %}
{%- set function = call.function if call.function is defined else call %}
{%- if content or not loop.first %}
{{- '\n' }}
{%- endif %}
{{- '<tool_call>\n{"name": "' + function.name + '", "arguments": ' }}
{%- if function.arguments is string %}
{{- function.arguments }}
{%- else %}
{{- function.arguments | tojson }}
{%- endif %}
{{- '}\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or loop.previtem.role != 'tool' %}
{{- '<|im_start|>user' }}
{%- endif %}
{{- '\n<tool_response>\n' + (message.content or '') + '\n</tool_response>' }}
{%- if loop.last or loop.nextitem.role != 'tool' %}
{{- '<|im_end|>\n' }}
{%- endif %}
{%- else %}
{{- '<|im_start|>' + message.role + '\n' + (message.content or '') + '<|im_end|>\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

_WORD_TEXT = """
the a an one two three some every this that my your our their small big red blue green old new quick slow
happy quiet bright dark warm cold cat dog bird fish tree house river road city garden book letter number
answer question tool function result value list table file page word sentence robot agent model user
system teacher student friend child morning evening day night week year sees finds reads writes sends
opens closes counts adds takes makes keeps moves helps asks answers runs walks calls checks returns gives
shows likes needs wants uses builds and or but with without from into over under near after before
because while then again always never often today
"""
_WORDS = _WORD_TEXT.split()
_TOOLS = {
    "calculator": ("expression", "Evaluate an arithmetic expression."),
    "search": ("query", "Search the web for a query."),
    "get_weather": ("city", "Get the current weather in a city."),
    "read_file": ("path", "Read a text file."),
}
_CITIES = ("Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Berlin", "Denver", "Seoul")


def _arithmetic(rng: random.Random) -> tuple[str, str, str]:
    """An arithmetic question, its expression and its answer."""
    a, b = rng.randint(0, 999), rng.randint(0, 99)
    op = rng.choice("+-*")
    expression = f"{a} {op} {b}"
    answer = {"+": a + b, "-": a - b, "*": a * b}[op]
    return f"What is {expression}?", expression.replace(" ", ""), str(answer)


def _sentence(rng: random.Random) -> str:
    words = [rng.choice(_WORDS) for _ in range(rng.randint(3, 12))]
    return " ".join(words).capitalize() + rng.choice(".!?")


def _tool_arguments(rng: random.Random, name: str) -> dict[str, str]:
    parameter = _TOOLS[name][0]
    if name == "calculator":
        value = _arithmetic(rng)[1]
    elif name == "get_weather":
        value = rng.choice(_CITIES)
    elif name == "read_file":
        value = f"/data/{rng.choice(_WORDS)}_{rng.randint(1, 99)}.txt"
    else:
        value = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(1, 4)))
    return {parameter: value}


def _tool_schema(name: str) -> dict[str, object]:
    parameter, description = _TOOLS[name]
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {parameter: {"type": "string"}},
                "required": [parameter],
            },
        },
    }


def _turn(role: str, content: str) -> str:
    return f"{IM_START}{role}\n{content}{IM_END}\n"


def _conversation(rng: random.Random) -> str:
    """A ChatML conversation as the chat template renders it: a question, maybe a tool round trip."""
    question, expression, answer = _arithmetic(rng)
    parts = []
    if rng.random() < 0.5:
        tools = "\n".join(json.dumps(_tool_schema(name)) for name in _TOOLS)
        parts.append(
            _turn("system", f"You are a helpful assistant.\n\n# Tools\n\n<tools>\n{tools}\n</tools>")
        )
    parts.append(_turn("user", question))
    thinking = f"<think>\n{_sentence(rng)}\n</think>\n\n" if rng.random() < 0.3 else ""
    if rng.random() < 0.5:
        call = json.dumps({"name": "calculator", "arguments": {"expression": expression}})
        parts.append(_turn("assistant", f"{thinking}<tool_call>\n{call}\n</tool_call>"))
        parts.append(_turn("user", f"<tool_response>\n{answer}\n</tool_response>"))
        thinking = ""
    parts.append(_turn("assistant", f"{thinking}The answer is {answer}."))
    return "".join(parts)


def _document(rng: random.Random) -> str:
    kind = rng.randrange(4)
    if kind == 0:
        question, _, answer = _arithmetic(rng)
        return f"{question}\n{answer}"
    if kind == 1:
        return " ".join(_sentence(rng) for _ in range(rng.randint(1, 4)))
    if kind == 2:
        name = rng.choice(sorted(_TOOLS))
        return json.dumps({"name": name, "arguments": _tool_arguments(rng, name)})
    return _conversation(rng)


def training_corpus(seed: int = _CORPUS_SEED, documents: int = _CORPUS_DOCUMENTS) -> Iterator[str]:
    """The tokenizer's training text, cut at the added tokens (never merged with their neighbours)."""
    rng = random.Random(seed)
    added = re.compile("|".join(re.escape(token) for token in CONTROL_TOKENS + MARKUP_TOKENS))
    for _ in range(documents):
        yield from (piece for piece in added.split(_document(rng)) if piece)


def _train_bpe() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Vocabulary and merges of a byte-level BPE trained with Qwen2's normalizer and pre-tokenizer."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(MARKUP_TOKENS),
        min_frequency=2,
        special_tokens=list(CONTROL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(training_corpus(), trainer=trainer)
    model = json.loads(tokenizer.to_str())["model"]
    return model["vocab"], [(left, right) for left, right in model["merges"]]


def _tokenizer(max_positions: int = MAX_POSITIONS) -> Qwen2Tokenizer:
    """The trained BPE as a ``Qwen2Tokenizer``: control tokens are ids 0-2, markup tokens the last six."""
    vocab, merges = _train_bpe()
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,  # type: ignore[arg-type]  # annotated list[str], but tokenizers.BPE takes pairs
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        chat_template=CHAT_TEMPLATE,
        model_max_length=max_positions,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.add_tokens([AddedToken(IM_START, special=True, normalized=False)])
    tokenizer.add_tokens([AddedToken(token, special=False, normalized=False) for token in MARKUP_TOKENS])
    return tokenizer


def _token_id(tokenizer: Qwen2Tokenizer, token: str) -> int:
    token_id = tokenizer.convert_tokens_to_ids(token)
    assert isinstance(token_id, int)
    return token_id


def _model(
    vocab_size: int,
    eos_id: int,
    pad_id: int,
    seed: int,
    *,
    max_positions: int = MAX_POSITIONS,
    window: int | None = None,
) -> Qwen2ForCausalLM:
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,  # tied, the next token would mostly repeat the current one
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        dtype="float32",
    )
    if window is not None:  # on every layer, so that the reach of the whole model is bounded
        config.use_sliding_window, config.sliding_window, config.max_window_layers = True, window, 0
        config.layer_types = ["sliding_attention"] * config.num_hidden_layers
    with torch.random.fork_rng(devices=[]):  # seed the weights without touching the caller's generator
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)  # type: ignore[no-untyped-call]
    model.generation_config = GenerationConfig(  # type: ignore[no-untyped-call]
        bos_token_id=None, eos_token_id=eos_id, pad_token_id=pad_id
    )
    return model


def build_tiny_model(directory: Path, *, seed: int = 0) -> Path:
    """Write the tokenizer, config, generation config and safetensors weights into ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = _tokenizer()
    tokenizer.save_pretrained(directory)
    eos_id, pad_id = _token_id(tokenizer, IM_END), _token_id(tokenizer, ENDOFTEXT)
    _model(len(tokenizer), eos_id, pad_id, seed).save_pretrained(directory)
    return directory


def build_long_model(directory: Path, *, seed: int = 0, window: int = LONG_WINDOW) -> Path:
    """The tiny model for agent prompts: a 131,072-token context and sliding-window attention on every layer.

    Agent CLIs send 15k-60k-token prompts (a long system prompt and a dozen or more tools). Full attention
    over them costs the square of the prompt per turn; with a window of ``window`` tokens on each of the two
    layers, the logits at a position depend only on the ``2 * (window - 1)`` tokens before it, so an engine
    may run just that tail of the prompt (``TorchBackend`` does) and still produce exactly the numbers of a
    forward pass over the whole prompt, at a cost that does not grow with the prompt. The weights, the
    tokenizer and the chat template are the tiny model's (same seed, same weights: a window changes no
    parameter), so what the tests know of one holds for the other.
    """
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = _tokenizer(LONG_MAX_POSITIONS)
    tokenizer.save_pretrained(directory)
    eos_id, pad_id = _token_id(tokenizer, IM_END), _token_id(tokenizer, ENDOFTEXT)
    model = _model(len(tokenizer), eos_id, pad_id, seed, max_positions=LONG_MAX_POSITIONS, window=window)
    model.save_pretrained(directory)
    return directory
