"""What the engines' numbers are checked against: one plain transformers forward pass."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM


def recomputed_logprobs(model_dir: Path, prompt: list[int], completion: list[int]) -> list[float]:
    """Logprobs of the completion tokens from one plain forward pass over prompt + completion (fp32)."""
    model = _model(str(model_dir))
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + completion])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return [float(logprobs[len(prompt) - 1 + i, token]) for i, token in enumerate(completion)]


@functools.lru_cache(maxsize=4)
def _model(model_dir: str) -> Any:
    """Loaded once per directory: the tests never change a model directory after writing it."""
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def recomputed_top(model_dir: Path, prompt: list[int], completion: list[int], k: int) -> list[list[int]]:
    """The ids of the ``k`` most likely tokens at each completion position, from one plain forward pass."""
    model = _model(str(model_dir))
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + completion])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return [torch.topk(logprobs[len(prompt) - 1 + i], k).indices.tolist() for i in range(len(completion))]
