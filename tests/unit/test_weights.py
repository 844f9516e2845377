"""When a checkpoint may go into a running engine in place, and when the backends must restart instead."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from pipeline.inference.backends.weights import in_place_refusal, read_weights, state_refusal


def copy_of(model_dir: Path, directory: Path, **config_changes: object) -> Path:
    shutil.copytree(model_dir, directory)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(config | config_changes))
    return directory


def test_the_same_model_with_other_values_goes_in_place_and_another_configuration_does_not(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    assert (
        in_place_refusal(tiny_model_dir, copy_of(tiny_model_dir, tmp_path / "same", dtype="bfloat16")) is None
    )
    wider = copy_of(tiny_model_dir, tmp_path / "wider", intermediate_size=512)
    assert in_place_refusal(tiny_model_dir, wider) == "the model's configuration differs (intermediate_size)"
    bare = tmp_path / "bare"
    bare.mkdir()
    assert in_place_refusal(tiny_model_dir, bare) == f"{bare} has no readable config.json"
    unweighted = copy_of(tiny_model_dir, tmp_path / "unweighted")
    (unweighted / "model.safetensors").unlink()
    assert in_place_refusal(tiny_model_dir, unweighted) == f"{unweighted} holds no safetensors weights"


def test_weights_fit_a_model_with_its_tied_output_layer_left_out_but_not_one_of_another_shape(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    weights = read_weights(tiny_model_dir)
    assert weights
    assert state_refusal(model, weights) is None
    partial = dict(weights)
    name = next(name for name in partial if name.endswith("mlp.up_proj.weight"))
    del partial[name]
    assert state_refusal(model, partial) == f"the checkpoint leaves out tensors the model needs ({name})"

    config = AutoConfig.from_pretrained(str(tiny_model_dir))
    config.intermediate_size *= 2
    AutoModelForCausalLM.from_config(config).save_pretrained(str(tmp_path / "wider"))
    refusal = state_refusal(model, read_weights(tmp_path / "wider"))
    assert refusal is not None
    assert refusal.startswith("tensors of another shape (")
