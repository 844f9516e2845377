"""Experiment trackers with the real packages writing to a temporary directory: W&B offline, MLflow to a
local file store; the figures logged are read back."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from pipeline.errors import ConfigError
from pipeline.training import StepRecord, open_tracker


def record(step: int, loss: float) -> StepRecord:
    return StepRecord(
        step=step, batch_id=f"b{step}", policy_version=step - 1, loss=loss, samples=8, tokens=100,
        staleness=1, mean_reward=0.5, mean_advantage=0.0, kl=0.01, clip_fraction=0.1, skipped=2,
    )  # fmt: skip


def test_mlflow_logs_every_step_to_a_local_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    from pipeline.training.tracking import local_store

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    tracker = open_tracker("mlflow", run_name="trainer-a", directory=tmp_path, config={"lr": 0.003})
    for step, loss in [(1, 0.5), (2, 0.25), (3, -0.125)]:
        tracker(record(step, loss))
    tracker.close()

    assert (tmp_path / "mlflow.db").is_file()
    client = MlflowClient(tracking_uri=local_store(tmp_path))
    (run,) = client.search_runs([client.get_experiment_by_name("turnstile").experiment_id])
    assert run.info.run_name == "trainer-a"
    assert run.info.status == "FINISHED"
    assert run.data.params == {"lr": "0.003"}
    history = client.get_metric_history(run.info.run_id, "loss")
    assert [(m.step, m.value) for m in sorted(history, key=lambda m: m.step)] == [
        (1, 0.5),
        (2, 0.25),
        (3, -0.125),
    ]
    assert client.get_metric_history(run.info.run_id, "skipped")[0].value == 2.0
    assert "batch_id" not in run.data.metrics


def wandb_history(run_file: Path) -> list[dict[str, float]]:
    """The history rows of a W&B run file: a 7-byte W&B header, then LevelDB-log framing (32 KiB blocks of
    chunks, each with a 7-byte header: crc, length, type) around protobuf ``Record``s."""
    from wandb.proto import wandb_internal_pb2

    data, position, block, rows, record = run_file.read_bytes(), 7, 32768, [], b""
    while position + 7 <= len(data):
        if block - position % block < 7:  # a block's tail too short for a header is padding
            position += block - position % block
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + 7])
        record += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # a whole record, or the last chunk of one
            parsed = wandb_internal_pb2.Record()
            parsed.ParseFromString(record)
            if parsed.WhichOneof("record_type") == "history":
                items = parsed.history.item
                rows.append({(i.key or ".".join(i.nested_key)): json.loads(i.value_json) for i in items})
            record = b""
    return rows


def test_wandb_writes_an_offline_run_with_every_steps_figures(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_MODE", raising=False)  # the tracker defaults to offline by itself
    monkeypatch.setenv("WANDB_SILENT", "true")
    # wandb's service process must answer within 30 s and its run start within 90 by default: a loaded CI
    # machine (the suite's other tests beside it) is given longer, so only a real failure fails here
    monkeypatch.setenv("WANDB__SERVICE_WAIT", "300")
    monkeypatch.setenv("WANDB_INIT_TIMEOUT", "300")
    tracker = open_tracker("wandb", run_name="trainer-b", directory=tmp_path, config={"lr": 0.003})
    for step, loss in [(1, 0.5), (2, 0.25)]:
        tracker(record(step, loss))
    tracker.close()

    (run_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    steps = [row for row in wandb_history(run_file) if "loss" in row]
    assert [(row["_step"], row["loss"]) for row in steps] == [(1, 0.5), (2, 0.25)]
    assert all(row["skipped"] == 2 and row["tokens"] == 100 for row in steps)


def test_an_unknown_tracker_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--track 'tensorboard': unknown tracker; use one of wandb, mlflow"):
        open_tracker("tensorboard", run_name="t", directory=tmp_path, config={})
