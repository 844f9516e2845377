"""A training batch as right-padded torch tensors (``BatchTensors``), from a decoded batch (``to_tensors``)
or straight from its safetensors payload (``payload_tensors``). Kept apart from the subscription so the
learner (``ppo``) imports with torch alone: no NATS or SQL client on a GPU machine that only trains."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from pipeline.batches import TrainingBatch


@dataclass(frozen=True)
class BatchTensors:
    """A batch as right-padded tensors, one row per sample. ``logprobs`` are the sampling logprobs at the
    positions of the tokens they scored (0 where ``loss_mask`` is 0)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    logprobs: torch.Tensor
    advantages: torch.Tensor
    rewards: torch.Tensor
    policy_versions: torch.Tensor
    sample_ids: list[str]


def to_tensors(batch: TrainingBatch, pad_id: int = 0) -> BatchTensors:
    import torch

    length = max((len(s.input_ids) for s in batch.samples), default=0)
    rows = len(batch.samples)
    input_ids = torch.full((rows, length), pad_id, dtype=torch.long)
    attention = torch.zeros((rows, length), dtype=torch.long)
    mask = torch.zeros((rows, length), dtype=torch.float32)
    logprobs = torch.zeros((rows, length), dtype=torch.float32)
    for row, sample in enumerate(batch.samples):
        n = len(sample.input_ids)
        input_ids[row, :n] = torch.tensor(sample.input_ids, dtype=torch.long)
        attention[row, :n] = 1
        mask[row, :n] = torch.tensor(sample.loss_mask, dtype=torch.float32)
        logprobs[row, :n] = torch.tensor(sample.logprobs, dtype=torch.float32)
    return BatchTensors(
        input_ids=input_ids,
        attention_mask=attention,
        loss_mask=mask,
        logprobs=logprobs,
        advantages=torch.tensor([s.advantage for s in batch.samples], dtype=torch.float32),
        rewards=torch.tensor([s.reward for s in batch.samples], dtype=torch.float32),
        policy_versions=torch.tensor([s.policy_version for s in batch.samples], dtype=torch.long),
        sample_ids=[s.sample_id for s in batch.samples],
    )


def payload_tensors(payload: bytes, pad_id: int = 0) -> BatchTensors:
    """``to_tensors`` straight from a safetensors payload: the flat token tensors cut by ``cu_seqlens`` and
    right-padded, without making Python objects of every token. The same tensors as ``to_tensors``."""
    import torch
    from safetensors.torch import load

    from pipeline.batches import read_metadata

    samples = read_metadata(payload)["samples"]
    flat = load(payload)
    lengths = flat["cu_seqlens"].diff()
    sizes = lengths.tolist()

    def padded(name: str, dtype: torch.dtype, value: float) -> torch.Tensor:
        rows = list(torch.split(flat[name].to(dtype), sizes))
        if not rows:
            return torch.zeros((0, 0), dtype=dtype)
        return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=value)

    input_ids = padded("input_ids", torch.long, pad_id)
    filled = torch.arange(input_ids.shape[1]).unsqueeze(0) < lengths.unsqueeze(1)
    mask = padded("loss_mask", torch.float32, 0.0)
    logprobs = padded("logprobs", torch.float32, 0.0)
    return BatchTensors(
        input_ids=input_ids,
        attention_mask=filled.long(),
        loss_mask=mask,
        logprobs=logprobs,
        advantages=flat["advantages"],
        rewards=flat["rewards"],
        policy_versions=flat["policy_versions"],
        sample_ids=[sample["sample_id"] for sample in samples],
    )


def concat_tensors(parts: Sequence[BatchTensors], pad_id: int = 0) -> BatchTensors:
    """Several batches as one: their rows stacked, right-padded to the longest (one learner step over the
    union of batches that were waiting)."""
    import torch

    if len(parts) == 1:
        return parts[0]
    width = max(part.input_ids.shape[1] for part in parts)

    def stacked(name: str, value: float) -> torch.Tensor:
        rows = [getattr(part, name) for part in parts]
        padded = [torch.nn.functional.pad(row, (0, width - row.shape[1]), value=value) for row in rows]
        return torch.cat(padded)

    return BatchTensors(
        input_ids=stacked("input_ids", pad_id),
        attention_mask=stacked("attention_mask", 0),
        loss_mask=stacked("loss_mask", 0.0),
        logprobs=stacked("logprobs", 0.0),
        advantages=torch.cat([part.advantages for part in parts]),
        rewards=torch.cat([part.rewards for part in parts]),
        policy_versions=torch.cat([part.policy_versions for part in parts]),
        sample_ids=[sample for part in parts for sample in part.sample_ids],
    )
