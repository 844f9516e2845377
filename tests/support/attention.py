"""FlashAttention's varlen attention in plain torch: AsyncGRPOTrainer's tree attention calls the kernel
``kernels-community/flash-attn3`` (CUDA, fetched from the Hub); tests where it cannot be had run the trainer
with this in its place. Imports torch only (``tests/e2e/test_gpu_trl.py`` runs without the conftest)."""

from __future__ import annotations

from typing import Any

import torch


def varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
    max_q: Any, max_k: Any, *, softmax_scale: float | None = None, causal: bool = True,
    window_size: tuple[int, int] = (-1, -1), **_: Any,
) -> torch.Tensor:  # fmt: skip
    """FlashAttention's ``flash_attn_varlen_func`` in plain torch (causal aligned bottom-right, as FA does
    when a segment has fewer queries than keys): what AsyncGRPOTrainer's tree attention calls, for CPU."""
    assert causal
    assert window_size == (-1, -1)
    out = torch.empty_like(q)
    for s in range(len(cu_q) - 1):
        qs, qe, ks, ke = int(cu_q[s]), int(cu_q[s + 1]), int(cu_k[s]), int(cu_k[s + 1])
        query, key, value = q[qs:qe], k[ks:ke], v[ks:ke]  # [tokens, heads, dim]
        repeat = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
        scale = softmax_scale if softmax_scale is not None else query.shape[-1] ** -0.5
        scores = torch.einsum("qhd,khd->hqk", query.float(), key.float()) * scale
        rows = torch.arange(qe - qs, device=q.device).unsqueeze(1)
        cols = torch.arange(ke - ks, device=q.device).unsqueeze(0)
        scores = scores.masked_fill(cols > rows + (ke - ks) - (qe - qs), float("-inf"))
        out[qs:qe] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), value.float()).to(q.dtype)
    return out
