"""The reference learner: PPO-clip policy gradient on a local Hugging Face causal LM, on CPU or GPU.

Each model token of a batch is weighed by the ratio of the current policy's probability to the sampling
probability recorded with the turn, clipped to [1 - clip, 1 + clip], times the sample's advantage; with
``kl_coef`` > 0 each token also pays ``kl_coef`` times the k3 estimate of KL(trained || reference), the
reference being the starting weights, frozen. The loss is the mean over the batch's scored tokens; the
gradient norm is clipped to 1 and Adam takes one step per batch.

- **Device and precision.** ``device`` (default CUDA when there is one, else CPU). On CUDA the forward
  pass runs under bf16 autocast while the weights, their gradients and Adam's states stay float32 (the
  master copy), and log-probabilities are taken in float32; on CPU everything is float32 unless asked.
- **Micro-batches.** ``micro_batch_tokens`` > 0 cuts a batch into groups of rows whose padded size (rows
  x longest row) stays within the budget; each group's loss is its share of the whole batch's token mean,
  so the accumulated gradient is the whole batch's (tested: 1 vs k micro-batches).
- **LoRA** (``lora_rank`` > 0, the ``lora`` extra: peft). Adapters on every linear layer of the starting
  weights; a checkpoint holds the *merged* model (so any inference backend loads it like a full one) and,
  under ``adapter/``, the adapter and its optimizer state, from which a restarted trainer resumes. The
  reference for the KL is the same model with the adapter switched off: no second copy.

Checkpoints hold the weights and the optimizer's state, so a restart resumes exactly; each is written
next to its final place and renamed, so it is whole or absent.
"""

from __future__ import annotations

import copy
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from pipeline.errors import ConfigError
from pipeline.training.tensors import BatchTensors

ADAPTER: Final = "adapter"
"""The subdirectory of a LoRA checkpoint that holds the adapter and its optimizer state."""


def checkpoint_dir(root: Path, version: int) -> Path:
    return root / f"v{version:06d}"


@dataclass(frozen=True)
class LearnerOptions:
    """How the reference learner trains (``turnstile serve trainer`` options of the same names)."""

    lr: float = 3e-3
    clip: float = 0.2
    seed: int = 0
    threads: int = 1
    device: str | None = None
    """``cuda``, ``cuda:1``, ``cpu``...; None: CUDA when available, else CPU."""
    bf16: bool | None = None
    """bf16 autocast for the forward pass (fp32 master weights); None: on CUDA only."""
    micro_batch_tokens: int = 0
    """Padded tokens per forward pass (gradient accumulation); 0: the whole batch at once."""
    kl_coef: float = 0.0
    """Weight of the k3 KL(trained || starting weights) per scored token; 0: no reference model."""
    lora_rank: int = 0
    """0: full fine-tuning; else LoRA adapters of this rank (needs ``pip install 'turnstile-rl[lora]'``)."""
    lora_alpha: int | None = None
    """LoRA scaling numerator; None: twice the rank."""

    def __post_init__(self) -> None:
        checks = [
            (self.lr > 0, f"--lr must be positive, got {self.lr}"),
            (0 < self.clip < 1, f"--clip must lie between 0 and 1, got {self.clip}"),
            (self.threads >= 1, f"--threads must be at least 1, got {self.threads}"),
            (
                self.micro_batch_tokens >= 0,
                f"--micro-batch-tokens must be 0 or more, got {self.micro_batch_tokens}",
            ),
            (self.kl_coef >= 0, f"--kl-coef must be 0 or more, got {self.kl_coef}"),
            (self.lora_rank >= 0, f"--lora-rank must be 0 (off) or more, got {self.lora_rank}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)


def resolve_device(name: str | None) -> str:
    """The device to train on: ``name``, or CUDA when torch sees one, else CPU. A CUDA device asked for
    and absent is a ConfigError (not a crash deep inside the first step)."""
    import torch

    if name is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"--device {name}: torch sees no CUDA device here; use --device cpu")
    return name


def micro_batches(lengths: list[int], budget: int) -> list[list[int]]:
    """Rows of a batch grouped for one forward pass each: longest first, as many rows as fit in ``budget``
    padded tokens (rows x the group's longest row); a row longer than the budget goes alone. ``budget``
    0: all rows, in order, at once."""
    if budget <= 0 or not lengths:
        return [list(range(len(lengths)))] if lengths else []
    order = sorted(range(len(lengths)), key=lambda row: (-lengths[row], row))
    groups: list[list[int]] = []
    for row in order:
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= budget:
            groups[-1].append(row)
        else:
            groups.append([row])
    return groups


@dataclass
class _Sums:
    """Token sums over a step's micro-batches, divided by the batch's scored tokens at the end."""

    loss: float = 0.0
    kl: float = 0.0
    clipped: float = 0.0
    reference_kl: float = 0.0


class PolicyGradient:
    """The model, its optimizer and one PPO-clip step (blocking: run it in a thread).

    ``weights`` is where training resumes (the starting weights, or a checkpoint); ``base`` the starting
    weights themselves (the KL reference and, under LoRA, the model the adapter sits on), by default
    ``weights``."""

    def __init__(self, weights: Path, options: LearnerOptions, *, base: Path | None = None) -> None:
        import torch  # imported here: torch and transformers take seconds, and only the trainer needs them

        torch.manual_seed(options.seed)
        torch.set_num_threads(options.threads)
        self.torch = torch
        self.options = options
        self.device = torch.device(resolve_device(options.device))
        self.bf16 = self.device.type == "cuda" if options.bf16 is None else options.bf16
        base = weights if base is None else base
        self.model: Any = self._load(weights, base).to(self.device)
        self.model.train()
        self.reference: Any = None
        if options.kl_coef > 0 and not self.lora:
            self.reference = _load_model(base).to(self.device).eval().requires_grad_(False)
        self.parameters = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.Adam(self.parameters, lr=options.lr)
        optimizer_state = (weights / ADAPTER if self.lora else weights) / "optimizer.pt"
        if optimizer_state.is_file():
            state = torch.load(optimizer_state, map_location=self.device, weights_only=True)
            self.optimizer.load_state_dict(state)
        self.diagnostics: dict[str, float] = {}  # of the last step: approximate KLs, clip fraction

    @property
    def lora(self) -> bool:
        return self.options.lora_rank > 0

    def _load(self, weights: Path, base: Path) -> Any:
        if not self.lora:
            return _load_model(weights)
        try:
            from peft import LoraConfig, PeftModel, get_peft_model
        except ImportError as error:
            raise ConfigError(
                "--lora-rank needs peft: pip install 'turnstile-rl[lora]' (or --lora-rank 0)"
            ) from error
        adapter = weights / ADAPTER
        if adapter.is_dir():
            return PeftModel.from_pretrained(_load_model(base), adapter, is_trainable=True)
        if weights != base:
            raise ConfigError(
                f"checkpoint {weights} holds no LoRA adapter ({ADAPTER}/): it was written by a full "
                "fine-tuning trainer; resume it with --lora-rank 0, or start a new trainer (--durable)"
            )
        rank = self.options.lora_rank
        alpha = self.options.lora_alpha if self.options.lora_alpha is not None else 2 * rank
        config = LoraConfig(r=rank, lora_alpha=alpha, target_modules="all-linear", task_type="CAUSAL_LM")
        return get_peft_model(_load_model(base), config)

    # -- one step ------------------------------------------------------------------------------------------

    def step(self, batch: BatchTensors) -> float:
        """One optimizer step on ``batch``; its loss (the mean over its scored tokens)."""
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.accumulate(batch)
        self.torch.nn.utils.clip_grad_norm_(self.parameters, 1.0)
        self.optimizer.step()
        return loss

    def accumulate(self, batch: BatchTensors) -> float:
        """Add ``batch``'s gradient to the parameters' ``.grad``, one micro-batch at a time; its loss."""
        scored = float(batch.loss_mask[:, 1:].sum().clamp(min=1.0))
        lengths = batch.attention_mask.sum(dim=1).tolist()
        sums = _Sums()
        for rows in micro_batches(lengths, self.options.micro_batch_tokens):
            self._micro_step(batch, rows, max(lengths[row] for row in rows), scored, sums)
        self.diagnostics = {"kl": sums.kl / scored, "clip_fraction": sums.clipped / scored}
        if self.options.kl_coef > 0:
            self.diagnostics["reference_kl"] = sums.reference_kl / scored
        return sums.loss

    def _micro_step(
        self, batch: BatchTensors, rows: list[int], width: int, scored: float, sums: _Sums
    ) -> None:
        torch = self.torch
        index = torch.tensor(rows)

        def take(tensor: Any) -> Any:
            return tensor[index, :width].to(self.device, non_blocking=True)

        ids, attention = take(batch.input_ids), take(batch.attention_mask)
        mask = take(batch.loss_mask)[:, 1:]
        scored_here = mask > 0  # the token at position i is scored by the hidden state at position i - 1
        if not bool(scored_here.any()):
            return  # nothing to learn from these rows: no forward pass at all
        old, weight = take(batch.logprobs)[:, 1:][scored_here], mask[scored_here]
        advantage = batch.advantages[index].to(self.device).unsqueeze(1).expand_as(mask)[scored_here]
        new = self._logprobs(self.model, ids, attention, scored_here)
        ratio = torch.exp(new - old)
        clipped = torch.clamp(ratio, 1 - self.options.clip, 1 + self.options.clip)
        per_token = -torch.minimum(ratio * advantage, clipped * advantage)
        if self.options.kl_coef > 0:
            log_ratio = self._reference_logprobs(ids, attention, scored_here) - new
            reference_kl = torch.exp(log_ratio) - log_ratio - 1  # k3: unbiased, never negative
            per_token = per_token + self.options.kl_coef * reference_kl
            sums.reference_kl += float((reference_kl.detach() * weight).sum())
        loss = (per_token * weight).sum() / scored  # this micro-batch's share of the batch's token mean
        loss.backward()
        sums.loss += float(loss.detach())
        tokens = diagnostics(new.detach(), old, weight, self.options.clip, reduce=False)
        sums.kl += tokens["kl"]
        sums.clipped += tokens["clip_fraction"]

    def _logprobs(self, model: Any, ids: Any, attention: Any, scored: Any) -> Any:
        """Log-probability under ``model`` of each token that ``scored`` ([rows, length - 1], true at
        position i - 1 for the token at i) marks, in float32 whatever the autocast. The output layer runs
        on those positions only: prompts and tool output are most of a sample's tokens, and over a real
        vocabulary their logits would be most of the step's time and memory."""
        torch = self.torch
        decoder, head = _decoder_and_head(model)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            hidden = decoder(input_ids=ids, attention_mask=attention).last_hidden_state
            logits = head(hidden[:, :-1][scored]).float()
        chosen = logits.gather(-1, ids[:, 1:][scored].unsqueeze(-1)).squeeze(-1)
        return chosen - torch.logsumexp(logits, dim=-1)

    def _reference_logprobs(self, ids: Any, attention: Any, scored: Any) -> Any:
        with self.torch.no_grad():
            if self.reference is not None:
                return self._logprobs(self.reference, ids, attention, scored)
            with self.model.disable_adapter():  # LoRA: the starting weights are the model without it
                return self._logprobs(self.model, ids, attention, scored)

    # -- checkpoints ---------------------------------------------------------------------------------------

    def save(self, directory: Path) -> None:
        """Write the checkpoint next to its final place, then rename: a checkpoint is whole or absent."""
        partial = directory.with_name(directory.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        if self.lora:
            # the merged weights, for inference; the adapter and its optimizer state, for resuming
            copy.deepcopy(self.model).merge_and_unload().save_pretrained(partial)
            self.model.save_pretrained(partial / ADAPTER)
            self.torch.save(self.optimizer.state_dict(), partial / ADAPTER / "optimizer.pt")
        else:
            self.model.save_pretrained(partial)
            self.torch.save(self.optimizer.state_dict(), partial / "optimizer.pt")
        shutil.rmtree(directory, ignore_errors=True)
        os.replace(partial, directory)

    def named_weights(self) -> Iterator[tuple[str, Any]]:
        """The trained parameters by name (on the learner's device)."""
        return ((name, p) for name, p in self.model.named_parameters() if p.requires_grad)


def _decoder_and_head(model: Any) -> tuple[Any, Any]:
    """A causal LM's stack of layers (hidden states out) and its output layer; under LoRA, those of the
    model peft wraps (its adapters sit inside them)."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return getattr(inner, inner.base_model_prefix), inner.get_output_embeddings()


def _load_model(directory: Path) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)


def diagnostics(new: Any, old: Any, mask: Any, clip: float, *, reduce: bool = True) -> dict[str, float]:
    """Over the tokens in ``mask`` (torch tensors of log-probabilities under the policy being trained and
    under the policy that sampled): ``kl``, the estimate E[(r - 1) - log r] of KL(sampling || trained) with
    r = exp(new - old) (Schulman's k3: unbiased, never negative), and ``clip_fraction``, the share of
    tokens whose ratio lies outside [1 - clip, 1 + clip]. ``reduce`` False: the sums over the tokens, not
    the means (a step adds up its micro-batches' sums)."""
    import torch

    with torch.no_grad():
        log_ratio = (new - old) * mask
        ratio = torch.exp(log_ratio)
        tokens = float(mask.sum().clamp(min=1.0)) if reduce else 1.0
        kl = float((((ratio - 1) - log_ratio) * mask).sum()) / tokens
        clipped = float((((ratio - 1).abs() > clip).float() * mask).sum()) / tokens
        return {"kl": kl, "clip_fraction": clipped}
