"""A tiny causal LM and synthetic training batches for the learner's tests (``tests/unit/test_learner.py``
and ``tests/e2e/test_gpu_learner.py``). Imports torch, transformers and the learner's tensors only: the GPU
machine that runs the e2e test has no NATS, SQL or tokenizer packages of ours.

The model is the tiny model's architecture (a 2-layer Qwen2, random weights of a fixed seed) without its
tokenizer: the learner needs token ids, not text.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from pipeline.training.tensors import BatchTensors

VOCAB = 512


def tiny_causal_lm(directory: Path, *, seed: int = 0) -> Path:
    """Write a 2-layer Qwen2 with random weights (seeded) to ``directory``; the directory."""
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        dtype="float32",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.save_pretrained(directory)
    return directory


def own_logprobs(model_dir: Path, input_ids: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
    """Each token's log-probability under the model at ``model_dir`` (CPU, float32), position 0 zero:
    what an engine serving exactly these weights would have recorded."""
    model = Qwen2ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention).logits[:, :-1].float()
    chosen = torch.log_softmax(logits, dim=-1).gather(-1, input_ids[:, 1:, None])[..., 0]
    return torch.cat([torch.zeros(len(input_ids), 1), chosen], dim=1)


def synthetic_batch(
    model_dir: Path, *, lengths: list[int], seed: int = 0, noise: float = 0.0, prompt: int = 4
) -> BatchTensors:
    """A right-padded batch of random token rows of ``lengths``: the first ``prompt`` tokens of each row
    unscored, the rest scored, sampling logprobs the model's own (plus ``noise`` x N(0, 1), so ratios are
    not all 1), one advantage per row from N(0, 1)."""
    generator = torch.Generator().manual_seed(seed)
    rows, width = len(lengths), max(lengths)
    input_ids = torch.zeros((rows, width), dtype=torch.long)
    attention = torch.zeros((rows, width), dtype=torch.long)
    mask = torch.zeros((rows, width), dtype=torch.float32)
    for row, n in enumerate(lengths):
        input_ids[row, :n] = torch.randint(1, VOCAB, (n,), generator=generator)
        attention[row, :n] = 1
        mask[row, prompt:n] = 1.0
    logprobs = own_logprobs(model_dir, input_ids, attention)
    logprobs = (logprobs + noise * torch.randn(logprobs.shape, generator=generator)) * mask
    return BatchTensors(
        input_ids=input_ids,
        attention_mask=attention,
        loss_mask=mask,
        logprobs=logprobs,
        advantages=torch.randn(rows, generator=generator),
        rewards=torch.zeros(rows),
        policy_versions=torch.zeros(rows, dtype=torch.long),
        sample_ids=[f"s{row}" for row in range(rows)],
    )
