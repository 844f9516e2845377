"""Rows of different lengths decoded together: one transformers ``DynamicCache`` and its padding mask.

Continuous batching needs a request to join a batch that is already decoding, and to leave it, at a token
boundary. This keeps one ``DynamicCache`` for the whole batch (shape ``[rows, heads, columns, dim]`` per
layer) beside a 2-D attention mask ``[rows, columns]``, every row *right-aligned*: a row's tokens fill its
last columns, contiguously, and the columns before them are padding (mask 0, zero keys and values). Then a
decode step is one forward pass of one token per row over the cache as it is, and:

- **joining** (``join``) left-pads the batch or the newcomers' prefill cache to the wider of the two and
  concatenates them on the batch axis: a copy of the cache, paid once per join, not per step;
- **leaving** (``keep``) selects the remaining rows, then drops the leading columns no row uses any more, so
  a finished long request leaves no padding behind for the short ones;
- **sliding-window layers** (``DynamicSlidingWindowLayer``, the long model) hold only their last
  ``window - 1`` columns: the same right-alignment holds, and their ``cumulative_length`` (what the mask
  and the cache positions are computed from) is set to the mask's width.

Columns are storage, not positions: each row's rotary positions are passed as ``position_ids`` (its true
positions), and since its tokens are contiguous columns, the causal mask and a sliding window measured in
columns are the ones measured in positions. So a row's logits in the batch are those of the row alone (up
to float rounding: ``tests/integration/test_batching.py`` checks them against a plain forward pass).

Why one shared cache and not a cache per request stacked for each step: stacking copies every row's cache
into a padded batch on every step and takes each row's part back after, on top of the copy that
``DynamicCache`` itself makes when it appends a column (``torch.cat``); here the only copies besides that
one are made when a request joins or leaves. Measured on the tiny model (8 rows of 900-1,075 columns, one
thread, machine load 7-9): a decode step over the shared cache 25-28 ms, with stacking 34-44 ms.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

Row = TypeVar("Row")


def pad_left(tensor: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    """``tensor`` with zeros before it along ``dim`` up to ``width`` (itself when already that wide)."""
    missing = width - tensor.shape[dim]
    if missing <= 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor.new_zeros(shape), tensor], dim=dim)


def layers(cache: DynamicCache) -> list[DynamicLayer]:
    """The cache's layers; refused when one is a kind this module cannot pad and slice (a model with
    another kind of attention)."""
    found = []
    for layer in cache.layers:
        if not isinstance(layer, DynamicLayer) or type(layer) not in (
            DynamicLayer,
            DynamicSlidingWindowLayer,
        ):
            raise TypeError(
                f"continuous batching supports full and sliding-window attention caches, not "
                f"{type(layer).__name__}; serve this model with the vllm backend"
            )
        found.append(layer)
    return found


def tensors(layer: DynamicLayer) -> tuple[torch.Tensor, torch.Tensor]:
    """A filled layer's keys and values (a layer is filled by the forward pass that made the cache)."""
    assert layer.keys is not None
    assert layer.values is not None
    return layer.keys, layer.values


class RaggedBatch(Generic[Row]):
    """The rows decoding together, their shared cache and mask, kept in the same order."""

    def __init__(self) -> None:
        self.rows: list[Row] = []
        self.cache: DynamicCache | None = None
        self.mask: torch.Tensor | None = None
        """``[rows, columns]``, 1 where a row has a token, 0 for its left padding."""

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def width(self) -> int:
        """Columns of the mask: what one more decode step attends over (plus the new token)."""
        return 0 if self.mask is None else int(self.mask.shape[1])

    def join(self, rows: list[Row], cache: DynamicCache, mask: torch.Tensor) -> None:
        """Add prefilled ``rows`` (their own cache, right-aligned, and mask) to the batch."""
        theirs_all = layers(cache)
        if self.cache is None or self.mask is None:
            self.rows, self.cache, self.mask = list(rows), cache, mask
            return
        width = max(self.width, int(mask.shape[1]))
        self.mask = torch.cat([pad_left(self.mask, width, 1), pad_left(mask, width, 1)], dim=0)
        for mine, theirs in zip(layers(self.cache), theirs_all, strict=True):
            (my_keys, my_values), (their_keys, their_values) = tensors(mine), tensors(theirs)
            length = max(my_keys.shape[-2], their_keys.shape[-2])
            mine.keys = torch.cat([pad_left(my_keys, length, 2), pad_left(their_keys, length, 2)])
            mine.values = torch.cat([pad_left(my_values, length, 2), pad_left(their_values, length, 2)])
            if isinstance(mine, DynamicSlidingWindowLayer):
                mine.cumulative_length = width
        self.rows.extend(rows)

    def grow(self) -> torch.Tensor:
        """The mask of the next decode step (one more column, every row's new token) and keep it."""
        assert self.mask is not None
        self.mask = torch.cat([self.mask, self.mask.new_ones((len(self.rows), 1))], dim=1)
        return self.mask

    def keep(self, wanted: Callable[[Row], bool]) -> list[Row]:
        """Keep the rows ``wanted`` says to; the others, in order. Leading columns left unused go too."""
        indices = [i for i, row in enumerate(self.rows) if wanted(row)]
        gone = [row for row in self.rows if not wanted(row)]
        if not gone:
            return []
        if not indices:
            self.clear()
            return gone
        assert self.cache is not None
        assert self.mask is not None
        selected = torch.tensor(indices, device=self.mask.device)
        self.rows = [self.rows[i] for i in indices]
        self.mask = self.mask[selected]
        self.cache.batch_select_indices(selected)
        self._trim()
        return gone

    def clear(self) -> None:
        self.rows, self.cache, self.mask = [], None, None

    def _trim(self) -> None:
        """Drop the leading columns that are padding in every row (right-alignment keeps them in front)."""
        assert self.cache is not None
        assert self.mask is not None
        unused = int(self.mask.any(dim=0).int().argmax())  # the first column some row uses
        if unused == 0:
            return
        self.mask = self.mask[:, unused:]
        for layer in layers(self.cache):
            keys, values = tensors(layer)
            start = max(0, keys.shape[-2] - self.width)  # a sliding layer may hold fewer columns than that
            layer.keys, layer.values = keys[:, :, start:], values[:, :, start:]
            if isinstance(layer, DynamicSlidingWindowLayer):
                layer.cumulative_length = self.width
