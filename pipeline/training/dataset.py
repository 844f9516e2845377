"""The samples of training batches as a map-style torch ``Dataset``, for trainers that take minibatches
(several PPO epochs over a batch, shuffled) with a ``DataLoader``:

    loader = DataLoader(SampleDataset([delivered.payload]), batch_size=16, shuffle=True, collate_fn=collate)
    for minibatch in loader:   # dict of right-padded tensors, as BatchTensors holds them
        ...

Item ``i`` is one sample's unpadded tensors, loaded from the safetensors payloads (``input_ids``,
``loss_mask``, ``logprobs`` of its tokens; ``advantage``, ``reward``, ``policy_version`` as 0-d tensors).
Imports torch: import it as ``pipeline.training.dataset``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from safetensors.torch import load
from torch.utils.data import Dataset

from pipeline.batches.format import read_metadata

Sample = dict[str, torch.Tensor]


class SampleDataset(Dataset[Sample]):
    def __init__(self, payloads: Iterable[bytes]) -> None:
        self._batches: list[dict[str, torch.Tensor]] = []
        self._index: list[tuple[int, int]] = []  # (batch, sample)
        self.sample_ids: list[str] = []
        for payload in payloads:
            tensors = load(payload)
            self.sample_ids += [sample["sample_id"] for sample in read_metadata(payload)["samples"]]
            self._index += [(len(self._batches), row) for row in range(len(tensors["cu_seqlens"]) - 1)]
            self._batches.append(tensors)

    def __len__(self) -> int:
        return len(self._index)

    def __getitem__(self, index: int) -> Sample:
        batch, row = self._index[index]
        tensors = self._batches[batch]
        start, end = int(tensors["cu_seqlens"][row]), int(tensors["cu_seqlens"][row + 1])
        return {
            "input_ids": tensors["input_ids"][start:end].long(),
            "loss_mask": tensors["loss_mask"][start:end].float(),
            "logprobs": tensors["logprobs"][start:end],
            "advantage": tensors["advantages"][row],
            "reward": tensors["rewards"][row],
            "policy_version": tensors["policy_versions"][row],
        }


def collate(items: Sequence[Sample], pad_id: int = 0) -> Sample:
    """Samples as right-padded rows (``input_ids``, ``attention_mask``, ``loss_mask``, ``logprobs``) and
    stacked scalars (``advantages``, ``rewards``, ``policy_versions``): the fields of ``BatchTensors``."""
    length = max((len(item["input_ids"]) for item in items), default=0)
    rows = len(items)
    padded = {
        "input_ids": torch.full((rows, length), pad_id, dtype=torch.long),
        "attention_mask": torch.zeros((rows, length), dtype=torch.long),
        "loss_mask": torch.zeros((rows, length), dtype=torch.float32),
        "logprobs": torch.zeros((rows, length), dtype=torch.float32),
    }
    for row, item in enumerate(items):
        n = len(item["input_ids"])
        padded["input_ids"][row, :n] = item["input_ids"]
        padded["attention_mask"][row, :n] = 1
        padded["loss_mask"][row, :n] = item["loss_mask"]
        padded["logprobs"][row, :n] = item["logprobs"]
    padded["advantages"] = torch.stack([item["advantage"] for item in items])
    padded["rewards"] = torch.stack([item["reward"] for item in items])
    padded["policy_versions"] = torch.stack([item["policy_version"] for item in items])
    return padded
