"""Whether a new checkpoint can go into a running engine in place, and its weights read from disk.

Loading weights in place keeps the engine (its compiled graphs, KV cache, tokenizer) and only overwrites
parameter values, so it is right only when the new checkpoint is the same model with other numbers: the
same architecture and the same configuration (every shape, the rope, the norms' epsilon). Anything else (a
grown vocabulary, another layer count, a new rope scaling) needs a fresh engine on the checkpoint: the
backends fall back to that, log why and count it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

CONFIG_KEYS_IGNORED = frozenset({"transformers_version", "_name_or_path", "dtype", "torch_dtype"})
"""Config keys that do not change what the weights compute: the engine keeps its own dtype."""


def in_place_refusal(serving: str | Path, checkpoint: str | Path) -> str | None:
    """Why ``checkpoint`` cannot be loaded into an engine serving ``serving`` in place; None if it can."""
    ours, theirs = _config(Path(serving)), _config(Path(checkpoint))
    if theirs is None:
        return f"{checkpoint} has no readable config.json"
    if ours is None:
        return f"the engine's own checkpoint {serving} has no readable config.json"
    differing = sorted(
        key for key in (ours.keys() | theirs.keys()) - CONFIG_KEYS_IGNORED if ours.get(key) != theirs.get(key)
    )
    if differing:
        return f"the model's configuration differs ({', '.join(differing)})"
    if not weight_files(Path(checkpoint)):
        return f"{checkpoint} holds no safetensors weights"
    return None


def weight_files(checkpoint: Path) -> list[Path]:
    """The checkpoint's safetensors files: the one file, or the shards its index names."""
    single = checkpoint / "model.safetensors"
    if single.is_file():
        return [single]
    index = checkpoint / "model.safetensors.index.json"
    if not index.is_file():
        return []
    shards = set(json.loads(index.read_text())["weight_map"].values())
    return [checkpoint / shard for shard in sorted(shards)]


def read_weights(checkpoint: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint's safetensors files, by name, on the CPU."""
    from safetensors.torch import load_file

    weights: dict[str, torch.Tensor] = {}
    for path in weight_files(Path(checkpoint)):
        weights.update(load_file(str(path)))
    return weights


def state_refusal(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> str | None:
    """Why ``weights`` cannot overwrite ``model``'s parameters in place; None if they can.

    Every name must be one of the model's with the same shape, and every parameter the checkpoint leaves
    out must be tied to one it holds (``save_pretrained`` writes a tied ``lm_head`` once, as the embedding).
    """
    own = model.state_dict()
    unknown = sorted(weights.keys() - own.keys())
    if unknown:
        return f"the checkpoint holds tensors the model has not ({', '.join(unknown[:3])})"
    reshaped = sorted(name for name, tensor in weights.items() if tensor.shape != own[name].shape)
    if reshaped:
        return f"tensors of another shape ({', '.join(reshaped[:3])})"
    given = {own[name].data_ptr() for name in weights}
    missing = sorted(name for name in own.keys() - weights.keys() if own[name].data_ptr() not in given)
    if missing:
        return f"the checkpoint leaves out tensors the model needs ({', '.join(missing[:3])})"
    return None


def _config(directory: Path) -> dict[str, Any] | None:
    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None
