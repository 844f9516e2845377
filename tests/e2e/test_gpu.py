"""The torch backend on a CUDA device: the numbers it returns are the engine's own, on the GPU as on the CPU.

Marked ``gpu`` (left out of the default run); on a machine with a CUDA device:

    python -m pytest -q -m gpu --noconftest tests/e2e/test_gpu.py

``--noconftest`` because these tests need only torch, transformers and the project (no servers): a GPU
machine need not have PostgreSQL's or NATS's packages. ``TURNSTILE_GPU_TEST_DEVICE`` names another device
(``cpu``) to check the tests themselves where there is none.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from pipeline.inference.backends import Generation
from pipeline.inference.backends.torch_backend import TorchBackend
from pipeline.inference.tinymodel import build_tiny_model
from schemas import ChatMessage, LLMRequest, SamplingParams, TokenPrefix
from tests.support.models import built_model

pytestmark = pytest.mark.gpu
DEVICE = os.environ.get("TURNSTILE_GPU_TEST_DEVICE", "cuda")


@pytest.fixture(scope="module")
def model_dir() -> Iterator[Path]:
    if DEVICE == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device here: run on a GPU machine (or set TURNSTILE_GPU_TEST_DEVICE=cpu)")
    with built_model(build_tiny_model, "tiny", "turnstile-gpu-model-") as directory:
        yield directory


def ask(content: str, **sampling: Any) -> LLMRequest:
    return LLMRequest(
        policy="p",
        messages=[ChatMessage(role="user", content=content)],
        sampling=SamplingParams(**{"max_tokens": 16, **sampling}),
    )


async def generate(backend: TorchBackend, requests: list[LLMRequest]) -> list[Generation]:
    """The requests submitted together: one left-padded batch."""
    return list(await asyncio.gather(*(backend.generate(r) for r in requests)))


def on_device(model_dir: Path, dtype: torch.dtype = torch.float32) -> TorchBackend:
    backend = TorchBackend(model_dir, device=DEVICE, dtype=dtype, max_batch=8)
    assert next(backend.model.parameters()).device.type == DEVICE
    return backend


def run(backend: TorchBackend, scenario: Any) -> Any:
    """``scenario(backend)`` on one event loop (the backend's queue and lock belong to the loop that first
    uses them), closing the backend after."""

    async def main() -> Any:
        try:
            return await scenario(backend)
        finally:
            await backend.close()

    return asyncio.run(main())


def teacher_forced(model_dir: Path, generation: Generation, device: str, dtype: torch.dtype) -> torch.Tensor:
    """Log-softmax over the vocabulary at each completion position, from one plain forward pass over prompt +
    completion on ``device`` in ``dtype`` (scored in float32, as the backend scores)."""
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(device).eval()  # type: ignore[arg-type]
    ids = generation.prompt_token_ids + generation.completion_token_ids
    with torch.inference_mode():
        logits = model(torch.tensor([ids], device=device)).logits[0].float()
    start = len(generation.prompt_token_ids) - 1
    return torch.log_softmax(logits, dim=-1)[start : start + len(generation.completion_token_ids)].cpu()


REQUESTS = [
    ask("hi"),
    ask("What is 17 + 25? Think step by step.", temperature=0.7, top_p=0.9, seed=1),
    ask("a much longer question " * 20, top_k=20, seed=2),
    ask("greedy", temperature=0),
]


def test_logprobs_on_the_gpu_match_a_cpu_forward_pass(model_dir: Path) -> None:
    """fp32 on the device: each returned logprob is the CPU's for the same tokens (TF32 is off for matmuls
    by default), and the batch of four mixed requests is token-exact against its own prompts."""
    backend = on_device(model_dir)
    generations = run(backend, lambda b: generate(b, REQUESTS))
    for request, generation in zip(REQUESTS, generations, strict=True):
        assert generation.prompt_token_ids == backend.renderer.prompt(request).token_ids
        assert len(generation.completion_token_ids) == len(generation.completion_logprobs) > 0
        cpu = teacher_forced(model_dir, generation, "cpu", torch.float32)
        chosen = cpu.gather(1, torch.tensor(generation.completion_token_ids)[:, None])[:, 0].tolist()
        worst = max(abs(a - b) for a, b in zip(generation.completion_logprobs, chosen, strict=True))
        assert worst <= 1e-3, f"{request.messages[0].content[:20]!r}: logprob off by {worst:.2e}"
    greedy = generations[-1]  # greedy picks the CPU's argmax, up to the numerics' noise
    cpu = teacher_forced(model_dir, greedy, "cpu", torch.float32)
    for position, token in enumerate(greedy.completion_token_ids):
        assert float(cpu[position, token]) >= float(cpu[position].max()) - 1e-3


def test_bf16_logprobs_are_the_bf16_models_own_and_greedy_is_reproducible(model_dir: Path) -> None:
    """bf16 on the device: the logprobs recorded for training are the bf16 engine's (a teacher-forced bf16
    pass gives them back), not an fp32 model's; greedy decoding gives the same tokens twice."""

    async def twice(backend: TorchBackend) -> list[Generation]:
        return [(await generate(backend, [ask("same question", temperature=0)]))[0] for _ in range(2)]

    first, second = run(on_device(model_dir, torch.bfloat16), twice)
    assert first.completion_token_ids == second.completion_token_ids
    assert first.completion_logprobs == second.completion_logprobs
    own = teacher_forced(model_dir, first, DEVICE, torch.bfloat16)
    chosen = own.gather(1, torch.tensor(first.completion_token_ids)[:, None])[:, 0].tolist()
    assert max(abs(a - b) for a, b in zip(first.completion_logprobs, chosen, strict=True)) <= 2e-2


def test_a_continuation_on_the_gpu_extends_the_first_turns_exact_tokens(model_dir: Path) -> None:
    """A second turn sent as the first turn's prompt + completion ids (its prefix) is prompted with exactly
    those ids followed by the new message's, and its logprobs are the CPU's for them."""

    async def two_turns(backend: TorchBackend) -> tuple[list[int], Generation]:
        (first,) = await generate(backend, [ask("question one", max_tokens=6, seed=5)])
        prefix = first.prompt_token_ids + first.completion_token_ids
        request = LLMRequest(
            policy="p",
            messages=[
                ChatMessage(role="user", content="question one"),
                ChatMessage(role="assistant", content=first.text),
                ChatMessage(role="user", content="and then?"),
            ],
            sampling=SamplingParams(max_tokens=6, seed=6),
            prefix=TokenPrefix(token_ids=prefix, message_count=2),
        )
        (second,) = await generate(backend, [request])
        return prefix, second

    prefix, second = run(on_device(model_dir), two_turns)
    assert not second.prefix_break
    assert second.prompt_token_ids[: len(prefix)] == prefix
    assert len(second.prompt_token_ids) > len(prefix)
    cpu = teacher_forced(model_dir, second, "cpu", torch.float32)
    chosen = cpu.gather(1, torch.tensor(second.completion_token_ids)[:, None])[:, 0].tolist()
    assert max(abs(a - b) for a, b in zip(second.completion_logprobs, chosen, strict=True)) <= 1e-3
