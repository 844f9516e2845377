"""The reference learner: PPO-clip policy gradient on a local Hugging Face causal LM.

Each model token of a batch is weighed by the ratio of the current policy's probability to the sampling
probability recorded with the turn, clipped to [1 - clip, 1 + clip], times the sample's advantage; the
gradient norm is clipped to 1 and Adam takes one step per batch. Checkpoints hold the weights and the
optimizer's state, so a restart resumes exactly.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from pipeline.training.subscription import BatchTensors


def checkpoint_dir(root: Path, version: int) -> Path:
    return root / f"v{version:06d}"


class PolicyGradient:
    """The model, its optimizer and one PPO-clip step (blocking: run it in a thread)."""

    def __init__(self, weights: Path, *, lr: float, clip: float, seed: int, threads: int) -> None:
        import torch  # imported here: torch and transformers take seconds, and only the trainer needs them
        from transformers import AutoModelForCausalLM

        torch.manual_seed(seed)
        torch.set_num_threads(threads)
        self.torch = torch
        self.model: Any = AutoModelForCausalLM.from_pretrained(weights, dtype=torch.float32)
        self.model.train()
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=lr)
        optimizer_state = weights / "optimizer.pt"
        if optimizer_state.is_file():
            self.optimizer.load_state_dict(torch.load(optimizer_state, weights_only=True))
        self.clip = clip
        self.diagnostics: dict[str, float] = {}  # of the last step: approximate KL, clip fraction

    def step(self, batch: BatchTensors) -> float:
        torch = self.torch
        logits = self.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        # the token at position i is scored by the logits at position i - 1
        targets = batch.input_ids[:, 1:]
        new = torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        old, mask = batch.logprobs[:, 1:], batch.loss_mask[:, 1:]
        ratio = torch.exp(new - old)
        advantage = batch.advantages.unsqueeze(1)
        clipped = torch.clamp(ratio, 1 - self.clip, 1 + self.clip)
        per_token = -torch.minimum(ratio * advantage, clipped * advantage)
        loss = (per_token * mask).sum() / mask.sum().clamp(min=1.0)
        self.optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.diagnostics = diagnostics(new.detach(), old, mask, self.clip)
        return float(loss.detach())

    def save(self, directory: Path) -> None:
        """Write the checkpoint next to its final place, then rename: a checkpoint is whole or absent."""
        partial = directory.with_name(directory.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        self.model.save_pretrained(partial)
        self.torch.save(self.optimizer.state_dict(), partial / "optimizer.pt")
        shutil.rmtree(directory, ignore_errors=True)
        os.replace(partial, directory)


def diagnostics(new: Any, old: Any, mask: Any, clip: float) -> dict[str, float]:
    """Over the tokens in ``mask`` (torch tensors of log-probabilities under the policy being trained and
    under the policy that sampled): ``kl``, the estimate E[(r - 1) - log r] of KL(sampling || trained) with
    r = exp(new - old) (Schulman's k3: unbiased, never negative), and ``clip_fraction``, the share of
    tokens whose ratio lies outside [1 - clip, 1 + clip]."""
    import torch

    with torch.no_grad():
        log_ratio = (new - old) * mask
        ratio = torch.exp(log_ratio)
        tokens = mask.sum().clamp(min=1.0)
        kl = (((ratio - 1) - log_ratio) * mask).sum() / tokens
        clipped = ((ratio - 1).abs() > clip).float() * mask
        return {"kl": float(kl), "clip_fraction": float(clipped.sum() / tokens)}
