"""The reference learner on a CUDA device: its bf16 step agrees with the same step in fp32 on the CPU, micro-
batches give the whole batch's update, and a LoRA step publishes a checkpoint that loads as a plain model.

Marked ``gpu`` (left out of the default run); on a machine with a CUDA device and only torch, transformers,
peft, safetensors, numpy and pydantic:

    python -m pytest -q -m gpu --noconftest tests/e2e/test_gpu_learner.py

``TURNSTILE_GPU_TEST_DEVICE=cpu`` runs the same checks on the CPU (bf16 autocast there too) where there is
no GPU. The learner imports without NATS or SQL clients (``pipeline.training``'s names are lazy).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from pipeline.training.ppo import ADAPTER, LearnerOptions, PolicyGradient, micro_batches
from tests.support.learning import synthetic_batch, tiny_causal_lm

pytestmark = pytest.mark.gpu
DEVICE = os.environ.get("TURNSTILE_GPU_TEST_DEVICE", "cuda")
LENGTHS = [40, 96, 64, 17, 128, 80, 33, 57]
LR = 1e-3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    if DEVICE.startswith("cuda") and not torch.cuda.is_available():
        pytest.skip("no CUDA device here: run on a GPU machine (or set TURNSTILE_GPU_TEST_DEVICE=cpu)")
    return tiny_causal_lm(tmp_path_factory.mktemp("gpu-learner") / "tiny")


def weights(learner: PolicyGradient) -> dict[str, torch.Tensor]:
    return {name: p.detach().float().cpu().clone() for name, p in learner.named_weights()}


def flat_gradient(learner: PolicyGradient) -> torch.Tensor:
    return torch.cat([p.grad.detach().float().cpu().flatten() for _, p in learner.named_weights()])


def test_a_bf16_step_on_the_device_matches_the_fp32_step_on_the_cpu(model_dir: Path) -> None:
    batch = synthetic_batch(model_dir, lengths=LENGTHS, noise=0.2, seed=1)
    reference = PolicyGradient(model_dir, LearnerOptions(device="cpu", bf16=False, lr=LR))
    device = PolicyGradient(model_dir, LearnerOptions(device=DEVICE, bf16=True, lr=LR))
    # fp32 master weights on the device, whatever the autocast
    assert all(p.dtype == torch.float32 and p.device.type == DEVICE for _, p in device.named_weights())
    start = weights(reference)

    loss_cpu, loss_device = reference.accumulate(batch), device.accumulate(batch)
    assert loss_device == pytest.approx(loss_cpu, rel=2e-2, abs=2e-3)
    cosine = torch.nn.functional.cosine_similarity(flat_gradient(device), flat_gradient(reference), dim=0)
    assert cosine > 0.99, f"the bf16 gradient points elsewhere than the fp32 one (cosine {cosine:.4f})"

    for learner in (reference, device):
        torch.nn.utils.clip_grad_norm_(learner.parameters, 1.0)
        learner.optimizer.step()
    states = device.optimizer.state_dict()["state"].values()
    assert all(s["exp_avg"].dtype == torch.float32 for s in states)  # Adam's moments in fp32 too
    after_cpu, after_device = weights(reference), weights(device)
    moved = [name for name in start if not torch.equal(after_cpu[name], start[name])]
    assert moved, "the CPU step changed nothing"
    update_cpu = torch.cat([(after_cpu[n] - start[n]).flatten() for n in moved])
    update_device = torch.cat([(after_device[n] - start[n]).flatten() for n in moved])
    # Adam's first step moves each weight by about lr x sign(gradient): close everywhere, and the same way
    assert float((update_device - update_cpu).abs().max()) <= 2 * LR + 1e-6
    assert torch.nn.functional.cosine_similarity(update_device, update_cpu, dim=0) > 0.9


@pytest.mark.parametrize("bf16", [False, True])
def test_micro_batches_on_the_device_give_the_whole_batchs_gradient(model_dir: Path, bf16: bool) -> None:
    batch = synthetic_batch(model_dir, lengths=LENGTHS, noise=0.2, seed=2)
    whole = PolicyGradient(model_dir, LearnerOptions(device=DEVICE, bf16=bf16, kl_coef=0.05))
    parts = PolicyGradient(
        model_dir, LearnerOptions(device=DEVICE, bf16=bf16, kl_coef=0.05, micro_batch_tokens=200)
    )
    assert len(micro_batches(LENGTHS, 200)) >= 4
    loss_whole, loss_parts = whole.accumulate(batch), parts.accumulate(batch)
    tolerance = 1e-2 if bf16 else 1e-5  # bf16: a row's numbers depend a little on its pass's padding
    assert loss_parts == pytest.approx(loss_whole, rel=tolerance, abs=tolerance / 10)
    cosine = torch.nn.functional.cosine_similarity(flat_gradient(parts), flat_gradient(whole), dim=0)
    assert cosine > (0.99 if bf16 else 1 - 1e-6)
    if not bf16:
        torch.testing.assert_close(flat_gradient(parts), flat_gradient(whole), rtol=1e-4, atol=1e-6)


def test_a_lora_step_on_the_device_publishes_a_checkpoint_that_loads(model_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("peft")
    batch = synthetic_batch(model_dir, lengths=LENGTHS, noise=0.2, seed=3)
    learner = PolicyGradient(model_dir, LearnerOptions(device=DEVICE, lora_rank=8, kl_coef=0.05, lr=1e-2))
    losses = [learner.step(batch) for _ in range(3)]
    assert all(loss == loss for loss in losses)  # no NaN
    assert learner.diagnostics["reference_kl"] > 0
    checkpoint = tmp_path / "v000003"
    learner.save(checkpoint)
    assert (checkpoint / ADAPTER / "adapter_model.safetensors").is_file()
    published = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).to(DEVICE).eval()
    learner.model.eval()
    ids, attention = batch.input_ids.to(DEVICE), batch.attention_mask.to(DEVICE)
    with torch.no_grad():
        mine = published(input_ids=ids, attention_mask=attention).logits.float()
        theirs = learner.model(input_ids=ids, attention_mask=attention).logits.float()
    torch.testing.assert_close(mine, theirs, rtol=1e-3, atol=1e-3)
    resumed = PolicyGradient(checkpoint, LearnerOptions(device=DEVICE, lora_rank=8), base=model_dir)
    assert resumed.optimizer.state_dict()["state"][0]["step"] == 3
