"""The batch payload: a safetensors file any trainer loads with the standard library alone, the same bytes
on every run, version 1 payloads still readable, and the torch views over it (padded tensors, a Dataset)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from pipeline.batches.format import (
    BatchSample,
    TrainingBatch,
    decode_batch,
    encode_batch,
    encode_v1,
    pack_arrays,
    pack_individual,
    read_metadata,
)
from pipeline.errors import InvalidEvent
from pipeline.log.tokens import pack_tokens, unpack_token_tuples, unpack_tokens
from pipeline.materialize.trajectory import Turn, individual_samples
from pipeline.training import payload_tensors, prune_checkpoints, to_tensors
from pipeline.training.dataset import SampleDataset, collate


def sample(n: int, ids: tuple[int, ...], mask: tuple[int, ...]) -> BatchSample:
    logprobs = tuple(-0.25 * (i + 1) if m else 0.0 for i, m in enumerate(mask))
    return BatchSample(
        f"s{n}", f"e{n}", "g", (f"t{n}a", f"t{n}b"), n, 0.1 * n, 0.5 - n, n == 2, ids, mask, logprobs
    )


BATCH = TrainingBatch(
    "b1",
    "main",
    "cfg",
    4,
    (sample(1, (5, 6, 7), (0, 1, 1)), sample(2, (8, 9), (0, 1)), sample(3, (10, 11, 12, 13), (0, 0, 1, 1))),
)


def test_a_payload_reads_back_as_the_batch_and_as_its_version_1_encoding_does() -> None:
    payload = encode_batch(BATCH)
    assert payload[8:9] == b"{"  # a safetensors header, not TSB1
    assert decode_batch(payload) == BATCH
    old = encode_v1(BATCH)
    assert old[:4] == b"TSB1"
    assert decode_batch(old) == BATCH  # payloads already on the stream stay readable
    meta = read_metadata(payload)
    assert (meta["format"], meta["version"], meta["batch_id"]) == ("turnstile.batch", 2, "b1")
    assert [s["tokens"] for s in meta["samples"]] == [3, 2, 4]


def test_a_payload_written_by_the_version_1_code_reads_as_the_same_batch() -> None:
    # tests/support/fixtures/batch_v1.tsb: BATCH encoded by pipeline/batches/format.py as it was before
    # version 2 (commit bd0af96), kept as written: old payloads on the stream or in an outbox stay readable.
    written = (Path(__file__).parents[1] / "support" / "fixtures" / "batch_v1.tsb").read_bytes()
    assert written[:4] == b"TSB1"
    assert decode_batch(written) == BATCH
    assert encode_v1(BATCH) == written  # the version 1 encoder kept for tests and bench/ is the old one


def test_the_bytes_are_the_same_in_every_process() -> None:
    code = (
        "import sys; from tests.unit.test_batch_format import BATCH; "
        "from pipeline.batches.format import encode_batch; sys.stdout.write(encode_batch(BATCH).hex())"
    )
    outputs = set()
    for seed in ("0", "1", "12345"):  # the safetensors writer's hash maps are seeded per process
        env = {**os.environ, "PYTHONHASHSEED": seed}
        done = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
        )
        assert done.returncode == 0, done.stderr
        outputs.add(done.stdout)
    assert outputs == {encode_batch(BATCH).hex()}
    # one metadata entry: a hash map of several could change the order, and so the bytes
    length = int.from_bytes(encode_batch(BATCH)[:8], "little")
    assert list(json.loads(encode_batch(BATCH)[8 : 8 + length])["__metadata__"]) == ["turnstile"]


OUTSIDE = """
import json, sys
import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file

path = sys.argv[1]
with safe_open(path, framework="np") as f:
    meta = json.loads(f.metadata()["turnstile"])
    cu = f.get_tensor("cu_seqlens")
    ids = f.get_tensor("input_ids")
lengths = np.diff(cu)
padded = np.zeros((len(lengths), lengths.max()), dtype=np.int64)
for row, (start, end) in enumerate(zip(cu[:-1], cu[1:])):
    padded[row, : end - start] = ids[start:end]
t = load_file(path)
rows = list(torch.split(t["loss_mask"].float(), lengths.tolist()))
mask = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)
loaded = [m for m in sys.modules if m.split(".")[0] in ("pipeline", "schemas", "consumers")]
print(json.dumps({
    "batch_id": meta["batch_id"], "sample_ids": [s["sample_id"] for s in meta["samples"]],
    "input_ids": padded.tolist(), "loss_mask": mask.tolist(), "advantages": t["advantages"].tolist(),
    "project_modules": loaded,
}))
"""


def test_a_trainer_outside_the_codebase_loads_a_batch_with_plain_safetensors(tmp_path: Path) -> None:
    path = tmp_path / "b1.safetensors"
    path.write_bytes(encode_batch(BATCH))
    script = tmp_path / "outside.py"
    script.write_text(textwrap.dedent(OUTSIDE))
    # -I: isolated (no current directory, no PYTHON* variables on the path); run from elsewhere
    done = subprocess.run(
        [sys.executable, "-I", str(script), str(path)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen["project_modules"] == []
    assert seen["batch_id"] == "b1"
    assert seen["sample_ids"] == ["s1", "s2", "s3"]
    assert seen["input_ids"] == [[5, 6, 7, 0], [8, 9, 0, 0], [10, 11, 12, 13]]
    assert seen["loss_mask"] == [[0, 1, 1, 0], [0, 1, 0, 0], [0, 0, 1, 1]]
    assert seen["advantages"] == [-0.5, -1.5, -2.5]


def test_tensors_from_the_payload_equal_the_tensors_from_the_decoded_batch() -> None:
    payload = encode_batch(BATCH)
    fast, slow = payload_tensors(payload), to_tensors(decode_batch(payload))
    for name in (
        "input_ids",
        "attention_mask",
        "loss_mask",
        "logprobs",
        "advantages",
        "rewards",
        "policy_versions",
    ):
        a, b = getattr(fast, name), getattr(slow, name)
        assert a.dtype == b.dtype, name
        assert torch.equal(a, b), name
    assert fast.sample_ids == slow.sample_ids == ["s1", "s2", "s3"]
    assert fast.input_ids.tolist() == [[5, 6, 7, 0], [8, 9, 0, 0], [10, 11, 12, 13]]


def test_the_dataset_gives_one_sample_per_item_and_collate_pads_them_as_the_batch_tensors() -> None:
    second = TrainingBatch("b2", "main", "cfg", 4, (sample(4, (1, 2), (0, 1)),))
    dataset = SampleDataset([encode_batch(BATCH), encode_batch(second)])
    assert len(dataset) == 4
    assert dataset.sample_ids == ["s1", "s2", "s3", "s4"]
    assert dataset[1]["input_ids"].tolist() == [8, 9]
    assert dataset[3]["reward"].item() == pytest.approx(0.4)
    (first,) = DataLoader(SampleDataset([encode_batch(BATCH)]), batch_size=8, collate_fn=collate)
    whole = payload_tensors(encode_batch(BATCH))
    for name in (
        "input_ids",
        "attention_mask",
        "loss_mask",
        "logprobs",
        "advantages",
        "rewards",
        "policy_versions",
    ):
        assert torch.equal(first[name], getattr(whole, name)), name


@pytest.mark.parametrize(
    ("damage", "said"),
    [
        (lambda p: p[:-3], "damaged safetensors"),
        (lambda p: p.replace(b"turnstile.batch", b"turnstile.bXtch"), "unknown batch format"),  # same length
        (lambda p: b"GIF89a" + p, "not a Turnstile training batch"),
    ],
)
def test_a_damaged_payload_is_refused_with_what_is_wrong(damage: object, said: str) -> None:
    with pytest.raises(ValueError, match=said):
        decode_batch(damage(encode_batch(BATCH)))  # type: ignore[operator]


def test_only_the_newest_checkpoints_are_kept(tmp_path: Path) -> None:
    for version in (1, 2, 3, 4, 10):
        (tmp_path / f"v{version:06d}").mkdir()
    (tmp_path / "v000011.partial").mkdir()  # a save in progress is not a version
    removed = prune_checkpoints(tmp_path, 2)
    assert sorted(p.name for p in removed) == ["v000001", "v000002", "v000003"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v000004", "v000010", "v000011.partial"]
    assert prune_checkpoints(tmp_path, 0) == []  # 0 keeps everything
    assert len(list(tmp_path.iterdir())) == 3


def test_an_individual_sample_packed_from_its_turn_is_the_bytes_of_pack_arrays() -> None:
    """The materializer packs individual samples straight from their turns (``pack_individual``); the bytes
    must be those of ``pack_arrays`` over ``trajectory.individual_samples`` (batch ids and payloads of a
    rebuild depend on it)."""
    turn = Turn(
        turn_id=uuid.uuid4(), episode_id="e", index=0, prompt_token_ids=(5, -1, 2**31 - 1, 0),
        completion_token_ids=(7, 8, 9), completion_logprobs=(-0.0, -1.25, -3.5e-8), policy_version=3,
        reward=0.0,
    )  # fmt: skip
    (sample,) = individual_samples([turn], {turn.turn_id: 0.5})
    expected = pack_arrays(sample.input_ids, sample.loss_mask, sample.logprobs)
    assert (
        pack_individual(turn.prompt_token_ids, turn.completion_token_ids, turn.completion_logprobs)
        == expected
    )
    assert pack_individual((), (1,), (-2.0,)) == pack_arrays((1,), (1,), (-2.0,))
    with pytest.raises(ValueError, match="2 completion ids for 1 logprobs"):
        pack_individual((1,), (2, 3), (-1.0,))


def test_token_arrays_unpack_to_tuples_as_to_lists() -> None:
    blob = pack_tokens([1, 2, 3], [4, 5], [-0.5, -1.5])
    assert unpack_token_tuples(blob) == ((1, 2, 3), (4, 5), (-0.5, -1.5))
    assert unpack_tokens(blob) == ([1, 2, 3], [4, 5], [-0.5, -1.5])
    with pytest.raises(InvalidEvent, match="TSK1"):
        unpack_token_tuples(blob[:-1])
