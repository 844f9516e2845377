"""The reference learner's step, against the step as it was (logits over every position), in one run.

A demo-like batch (``--samples`` rows of ``--min-prompt``..``--max-prompt`` unscored prompt tokens and
``--completion`` scored ones, the tiny model's real vocabulary) is trained with one PPO step each way,
alternating, ``--repeat`` times after a warm-up; the median seconds per step are printed with the ratio
(baseline / row: above 1 is faster). Rows:

- baseline: the output layer over every position, then the scored tokens picked (the learner before);
- scored only: the output layer over the scored positions only (``PolicyGradient`` now);
- scored only + micro-batches: the same with ``--micro-batch-tokens`` (rows grouped by length, less padding).

    python bench/learner.py
    python bench/learner.py --samples 256 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from pipeline.inference.tinymodel import build_tiny_model
from pipeline.training.ppo import LearnerOptions, PolicyGradient
from pipeline.training.tensors import BatchTensors

from common import load_average, machine


class FullLogits(PolicyGradient):
    """The learner before: logits at every position, the scored ones picked afterwards."""

    def _logprobs(self, model: Any, ids: Any, attention: Any, scored: Any) -> Any:
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            logits = model(input_ids=ids, attention_mask=attention).logits
        logits = logits[:, :-1].float()
        every = logits.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)
        return every[scored]


def batch(samples: int, low: int, high: int, completion: int, vocab: int) -> BatchTensors:
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(low, high + 1, (samples,), generator=generator) + completion
    width = int(lengths.max())
    ids = torch.zeros((samples, width), dtype=torch.long)
    attention = torch.zeros_like(ids)
    mask = torch.zeros((samples, width))
    for row, n in enumerate(lengths.tolist()):
        ids[row, :n] = torch.randint(1, vocab, (n,), generator=generator)
        attention[row, :n] = 1
        mask[row, n - completion : n] = 1.0
    return BatchTensors(
        input_ids=ids, attention_mask=attention, loss_mask=mask, logprobs=-5.0 * mask,
        advantages=torch.randn(samples, generator=generator), rewards=torch.zeros(samples),
        policy_versions=torch.zeros(samples, dtype=torch.long), sample_ids=[str(r) for r in range(samples)],
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--min-prompt", type=int, default=30)
    parser.add_argument("--max-prompt", type=int, default=90)
    parser.add_argument("--completion", type=int, default=8)
    parser.add_argument("--micro-batch-tokens", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        model = build_tiny_model(Path(directory) / "tiny")
        options = LearnerOptions(device="cpu", threads=args.threads)
        learners = {
            "baseline: logits at every position": FullLogits(model, options),
            "scored positions only": PolicyGradient(model, options),
            f"scored only + --micro-batch-tokens {args.micro_batch_tokens}": PolicyGradient(
                model,
                LearnerOptions(
                    device="cpu", threads=args.threads, micro_batch_tokens=args.micro_batch_tokens
                ),
            ),
        }
        vocab = learners["scored positions only"].model.config.vocab_size
        work = batch(args.samples, args.min_prompt, args.max_prompt, args.completion, vocab)
        times: dict[str, list[float]] = {name: [] for name in learners}
        for attempt in range(args.repeat + 1):  # alternating, so the machine's load falls on each alike
            for name, learner in learners.items():
                started = time.perf_counter()
                learner.step(work)
                if attempt:
                    times[name].append(time.perf_counter() - started)
    print(f"{machine()}; load {load_average()}; torch threads {args.threads}; vocabulary {vocab}")
    shape = f"prompts {args.min_prompt}..{args.max_prompt} tokens + {args.completion} scored"
    print(f"{args.samples} samples, {shape}")
    base = statistics.median(times["baseline: logits at every position"])
    for name, measured in times.items():
        median = statistics.median(measured)
        print(f"{name:<50} {median * 1000:8.1f} ms/step   x{base / median:.2f}")


if __name__ == "__main__":
    main()
