"""``write_checkpoint``: the directory a TRL weight transfer publishes is a whole model or absent."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from pipeline.errors import ConfigError
from pipeline.training import write_checkpoint


def test_weights_sent_lie_over_the_base_and_the_directory_loads(tiny_model_dir: Path, tmp_path: Path) -> None:
    base = load_file(str(tiny_model_dir / "model.safetensors"))
    name = sorted(base)[0]
    sent = {name: base[name] + 1.0}
    directory = write_checkpoint(tmp_path / "v000001", tiny_model_dir, sent)

    written = load_file(str(directory / "model.safetensors"))
    assert torch.equal(written[name], base[name] + 1.0)
    assert all(torch.equal(written[other], base[other]) for other in base if other != name)  # kept
    model = AutoModelForCausalLM.from_pretrained(directory)
    assert torch.equal(dict(model.named_parameters())[name].detach(), base[name] + 1.0)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    assert tokenizer.encode("hello") == AutoTokenizer.from_pretrained(tiny_model_dir).encode("hello")
    assert not (tmp_path / "v000001.partial").exists()


def test_a_name_the_model_lacks_is_refused_and_nothing_is_published(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    with pytest.raises(ConfigError, match=r"not in the model.*lm_head\.nope"):
        write_checkpoint(tmp_path / "v000002", tiny_model_dir, {"lm_head.nope": torch.zeros(2)})
    assert list(tmp_path.iterdir()) == []


def test_a_partial_directory_left_by_a_crash_is_replaced(tiny_model_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "v000003.partial").mkdir()
    (tmp_path / "v000003.partial" / "model.safetensors").write_bytes(b"half a file")
    directory = write_checkpoint(tmp_path / "v000003", tiny_model_dir, {})
    assert AutoModelForCausalLM.from_pretrained(directory) is not None
    assert not (tmp_path / "v000003.partial").exists()
