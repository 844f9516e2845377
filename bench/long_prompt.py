"""Per-turn cost of an agent-sized prompt on the long-context tiny model (``turnstile model init-long``).

For each prompt length (``--tokens``, default 20k, 40k, 60k) one user message of that many tokens goes to a
``TorchBackend`` in process, three ways, each timed as the median of ``--repeats`` runs:

- ``render``: the chat template and the tokenizer (``ChatRenderer.prompt``), which every backend pays;
- ``prefill``: ``generate`` with ``max_tokens=1`` (render, then the forward pass over the prompt's tail:
  the logits depend only on the last ``layers * (window - 1)`` tokens, so that is all it runs);
- ``scripted``: a scripted reply of ~30 tokens scored by teacher forcing (what an agent-CLI test pays).

The baseline, measured in the same run: the same model's plain forward pass over the whole prompt (what an
engine without the tail does; its sliding-window mask still makes it quadratic), at ``--full`` tokens
(default 8k and 20k; 60k would take ~9x the 20k run's 2.4 GB and ~3 minutes). The last lines give the ratios:
prefill at the longest ÷ at the shortest (flat: linear at most, from tokenizing) and the plain forward pass
÷ the tail at the same length.

    python bench/long_prompt.py
    python bench/long_prompt.py --tokens 20000,60000 --full 8000 --repeats 5

Report ``cat /proc/loadavg`` beside the figures: the machine is shared.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import torch

from pipeline.inference.backends.torch_backend import TorchBackend
from pipeline.inference.script import Script
from pipeline.inference.tinymodel import build_long_model
from schemas import ChatMessage, LLMRequest, SamplingParams

_WORDS = (
    "agent",
    "tool",
    "file",
    "shell",
    "command",
    "read",
    "write",
    "edit",
    "search",
    "test",
    "run",
    "diff",
)
_SCRIPT = Script.model_validate(
    {"rules": [{"reply": {"content": "I will write the file now and then run the tests to check it."}}]}
)


def prompt_text(backend: TorchBackend, tokens: int) -> str:
    """Words, cut to about ``tokens`` tokens."""
    text = " ".join(_WORDS[(i * 7) % len(_WORDS)] for i in range(tokens))
    return str(backend.tokenizer.decode(backend.tokenizer.encode(text, add_special_tokens=False)[:tokens]))


def load() -> str:
    with open("/proc/loadavg") as file:
        return " ".join(file.read().split()[:3])


async def median_seconds(work: Callable[[], Awaitable[object]], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        await work()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def full_forward_seconds(backend: TorchBackend, ids: list[int]) -> float:
    with torch.inference_mode():
        started = time.perf_counter()
        backend.model(torch.tensor([ids]))
        return time.perf_counter() - started


async def main(lengths: list[int], full: list[int], repeats: int) -> None:
    with tempfile.TemporaryDirectory() as directory:
        model = build_long_model(Path(directory) / "long")
        backend = TorchBackend(model)
        scripted = TorchBackend(model, script=_SCRIPT)
        print(f"reach {backend.reach} tokens; load {load()}")
        print(f"{'tokens':>8} {'render s':>9} {'prefill s':>10} {'scripted s':>11}")
        prefill: dict[int, float] = {}
        for length in lengths:
            request = LLMRequest(
                policy="bench",
                messages=[ChatMessage(role="user", content=prompt_text(backend, length))],
                sampling=SamplingParams(max_tokens=1, temperature=0),
            )
            size = len(backend.renderer.prompt(request).token_ids)
            render = await median_seconds(
                lambda r=request: asyncio.to_thread(backend.renderer.prompt, r), repeats
            )
            prefill[size] = await median_seconds(lambda r=request: backend.generate(r), repeats)
            forced = await median_seconds(lambda r=request: scripted.generate(r), repeats)
            print(f"{size:>8} {render:>9.3f} {prefill[size]:>10.3f} {forced:>11.3f}")
        print("baseline: a plain forward pass over the whole prompt")
        ratios = []
        for length in full:
            ids = backend.tokenizer.encode(prompt_text(backend, length), add_special_tokens=False)
            plain = full_forward_seconds(backend, ids)
            request = LLMRequest(
                policy="bench",
                messages=[ChatMessage(role="user", content=backend.tokenizer.decode(ids))],
                sampling=SamplingParams(max_tokens=1, temperature=0),
            )
            tail = await median_seconds(lambda r=request: backend.generate(r), repeats)
            ratios.append((len(ids), plain / tail))
            print(f"{len(ids):>8} plain forward {plain:.3f} s, prefill with the tail {tail:.3f} s")
        sizes = sorted(prefill)
        print(
            f"prefill {sizes[-1]} ÷ {sizes[0]} tokens: {prefill[sizes[-1]] / prefill[sizes[0]]:.2f}x "
            f"(prompt {sizes[-1] / sizes[0]:.1f}x longer)"
        )
        for size, ratio in ratios:
            print(f"plain forward ÷ prefill with the tail at {size} tokens: {ratio:.1f}x")
        print(f"load {load()}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", default="20000,40000,60000")
    parser.add_argument("--full", default="8000,20000")
    parser.add_argument("--repeats", type=int, default=3)
    arguments = parser.parse_args()
    asyncio.run(
        main(
            [int(n) for n in arguments.tokens.split(",")],
            [int(n) for n in arguments.full.split(",") if n],
            arguments.repeats,
        )
    )
