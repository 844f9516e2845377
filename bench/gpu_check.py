"""The reference learner on a CUDA device against the same learner on the CPU, on the tiny model: a PASS or
FAIL line per check, with the figures behind it. ``bench/gpu_check.sh`` runs it on the GPU machine.

The same starting weights and the same batches (``tests/support/learning.py``: a 2-layer Qwen2 of random
weights, rows of 17-128 tokens scored after a 4-token prompt, sampling logprobs near the model's own) go
through ``PolicyGradient`` three ways: fp32 on the CPU (the reference), fp32 on the device and bf16
autocast on the device (fp32 master weights and Adam moments, as ``turnstile serve trainer`` trains on a
GPU). Checks:

- ``fp32 step``: the device's first loss is the CPU's to 1e-4 (relative), its gradient too (cosine);
  TF32 is off for matmuls by default, so only the order of the sums differs;
- ``bf16 step``: the first loss within 2% (or 2e-3 absolute) of the CPU's, gradient cosine above 0.99;
- ``bf16 steps``: ``--steps`` optimizer steps on successive batches, each loss within 5% (or 5e-3) of
  the CPU run's: the two trajectories stay together, bf16's rounding does not push training elsewhere;
- ``fp32 master weights``: every trained parameter and Adam moment on the device is float32.

Imports torch, transformers and the learner only (no NATS, SQL or pydantic: the GPU machine has none of
them). ``--device cpu`` runs the same checks on the CPU (bf16 autocast there too), to check the script
itself where there is no GPU::

    python bench/gpu_check.py                # on a CUDA machine
    python bench/gpu_check.py --device cpu   # the script's own check, anywhere
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers.utils import logging as transformers_logging

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository, installed or not

from pipeline.training.ppo import LearnerOptions, PolicyGradient
from pipeline.training.tensors import BatchTensors
from tests.support.learning import synthetic_batch, tiny_causal_lm

LENGTHS = [40, 96, 64, 17, 128, 80, 33, 57]
LR = 1e-3


def flat_gradient(learner: PolicyGradient) -> torch.Tensor:
    return torch.cat([p.grad.detach().float().cpu().flatten() for _, p in learner.named_weights()])


def close(a: float, b: float, rel: float, absolute: float) -> bool:
    return abs(a - b) <= max(rel * abs(b), absolute)


def verdict(name: str, ok: bool, detail: str) -> bool:
    print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)
    return ok


def first_step(
    cpu: PolicyGradient, device: PolicyGradient, batch: BatchTensors
) -> tuple[float, float, float]:
    """Both learners' first loss on ``batch`` and the cosine between their gradients (no step taken)."""
    loss_cpu, loss_device = cpu.accumulate(batch), device.accumulate(batch)
    cosine = torch.nn.functional.cosine_similarity(flat_gradient(device), flat_gradient(cpu), dim=0)
    for learner in (cpu, device):
        learner.optimizer.zero_grad(set_to_none=True)
    return loss_cpu, loss_device, float(cosine)


def check_step(name: str, cpu: PolicyGradient, device: PolicyGradient, batch: BatchTensors) -> bool:
    """The device's first loss and gradient against the CPU's: fp32 to 1e-4, bf16 within 2%."""
    loss_cpu, loss_device, cosine = first_step(cpu, device, batch)
    rel, absolute, least = (1e-4, 1e-5, 1 - 1e-4) if name == "fp32" else (2e-2, 2e-3, 0.99)
    return verdict(
        f"{name} step",
        close(loss_device, loss_cpu, rel, absolute) and cosine > least,
        f"loss {loss_device:.6f} on {device.device} ({name}) vs {loss_cpu:.6f} on the CPU (fp32), "
        f"gradient cosine {cosine:.6f}",
    )


def check_steps(cpu: PolicyGradient, device: PolicyGradient, batches: list[BatchTensors]) -> bool:
    """An optimizer step per batch on each learner: each loss within 5% (or 5e-3) of the CPU run's."""
    synchronize = torch.cuda.synchronize if device.device.type == "cuda" else (lambda: None)
    cpu_run, device_run, seconds = [], [], []
    for batch in batches:
        cpu_run.append(cpu.step(batch))
        started = time.perf_counter()
        device_run.append(device.step(batch))
        synchronize()
        seconds.append(time.perf_counter() - started)
    pairs = list(zip(device_run, cpu_run, strict=True))
    return verdict(
        "bf16 steps",
        all(close(a, b, 5e-2, 5e-3) for a, b in pairs),
        f"{len(batches)} steps, losses {' '.join(f'{x:.4f}' for x in device_run)} vs the CPU's "
        f"{' '.join(f'{x:.4f}' for x in cpu_run)} (largest gap {max(abs(a - b) for a, b in pairs):.2e}); "
        f"a bf16 step took {min(seconds) * 1000:.1f} ms (the first {seconds[0] * 1000:.0f} ms)",
    )


def check_master_weights(learner: PolicyGradient) -> bool:
    """Under bf16 autocast the trained parameters and Adam's moments stay float32 on the device."""
    moments = [s["exp_avg"] for s in learner.optimizer.state_dict()["state"].values()]
    weights = [p for _, p in learner.named_weights()]
    on_device = all(p.dtype == torch.float32 and p.device.type == learner.device.type for p in weights)
    return verdict(
        "fp32 master weights",
        on_device and bool(moments) and all(m.dtype == torch.float32 for m in moments),
        f"{len(weights)} trained tensors and {len(moments)} Adam moments, all float32 on {learner.device}",
    )


def run_checks(device: str, steps: int) -> list[bool]:
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as scratch:
        model_dir = tiny_causal_lm(Path(scratch) / "tiny")
        batches = [synthetic_batch(model_dir, lengths=LENGTHS, noise=0.2, seed=s) for s in range(steps)]

        def learner(where: str, bf16: bool) -> PolicyGradient:
            return PolicyGradient(model_dir, LearnerOptions(device=where, bf16=bf16, lr=LR))

        cpu, fp32, bf16 = learner("cpu", False), learner(device, False), learner(device, True)
        return [
            check_step("fp32", cpu, fp32, batches[0]),
            check_step("bf16", cpu, bf16, batches[0]),
            check_steps(cpu, bf16, batches),
            check_master_weights(bf16),
        ]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda", help="the device checked against the CPU (default cuda)")
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps compared (default 5)")
    arguments = parser.parse_args()
    if arguments.device.startswith("cuda") and not torch.cuda.is_available():
        print("FAIL setup: torch sees no CUDA device (run on a GPU machine, or --device cpu)", flush=True)
        return 2
    transformers_logging.disable_progress_bar()
    cuda = arguments.device.startswith("cuda")
    name = torch.cuda.get_device_name(arguments.device) if cuda else "the CPU"
    print(f"torch {torch.__version__} on {name}; the tiny model, {len(LENGTHS)} rows a batch", flush=True)
    results = run_checks(arguments.device, arguments.steps)
    print(f"{'PASS' if all(results) else 'FAIL'} gpu_check.py: {sum(results)} of {len(results)} checks")
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
