"""Experiment trackers for the trainer (``turnstile serve trainer --track wandb|mlflow``): each is an
``on_step`` hook that logs a learner step's figures (loss, KLs, clip fraction, staleness, skipped batches,
reward...) at the step's number, and is closed when the trainer stops.

- ``wandb`` (the ``wandb`` extra): a run in ``directory``; offline unless ``WANDB_MODE`` says otherwise
  (``wandb sync DIR/wandb/offline-run-*`` uploads it later).
- ``mlflow`` (the ``mlflow`` extra, mlflow-skinny): a run in the tracking store ``MLFLOW_TRACKING_URI``,
  by default a local store in ``directory`` (``DIR/mlflow.db``, SQLite: ``mlflow ui --backend-store-uri
  sqlite:///DIR/mlflow.db``).

The packages are imported when a tracker is opened, never at import time: neither is needed otherwise.
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from typing import Any, Final, Protocol

from pipeline.errors import ConfigError
from pipeline.training.trainer import StepRecord

TRACKERS: Final = ("wandb", "mlflow")
PROJECT: Final = "turnstile"


class Tracker(Protocol):
    def __call__(self, record: StepRecord) -> None: ...

    def close(self) -> None: ...


def metrics(record: StepRecord) -> dict[str, float]:
    """The record's numbers (the batch id is not a metric; it is in the JSON lines of --log-steps)."""
    return {
        name: float(value)
        for name, value in dataclasses.asdict(record).items()
        if name not in ("step", "batch_id") and isinstance(value, int | float)
    }


def open_tracker(kind: str, *, run_name: str, directory: Path, config: dict[str, Any]) -> Tracker:
    """A tracker of ``kind`` (one of ``TRACKERS``) logging a run named ``run_name`` with ``config``."""
    directory.mkdir(parents=True, exist_ok=True)
    if kind == "wandb":
        return WandbTracker(run_name, directory, config)
    if kind == "mlflow":
        return MlflowTracker(run_name, directory, config)
    raise ConfigError(f"--track {kind!r}: unknown tracker; use one of {', '.join(TRACKERS)}")


def _require(package: str) -> Any:
    try:
        return __import__(package)
    except ImportError as error:
        raise ConfigError(
            f"--track {package} needs the {package} package: pip install 'turnstile-rl[{package}]'"
        ) from error


class WandbTracker:
    def __init__(self, run_name: str, directory: Path, config: dict[str, Any]) -> None:
        wandb = _require("wandb")
        os.environ.setdefault("WANDB_MODE", "offline")  # nothing leaves the machine unless asked
        self.run: Any = wandb.init(
            project=os.environ.get("WANDB_PROJECT", PROJECT),
            name=run_name,
            dir=str(directory),
            config=config,
            settings=wandb.Settings(console="off", silent=True),
        )

    def __call__(self, record: StepRecord) -> None:
        self.run.log(metrics(record), step=record.step)

    def close(self) -> None:
        self.run.finish()


def local_store(directory: Path) -> str:
    """MLflow's local store in ``directory``: a SQLite file (MLflow 3 refuses its older ``mlruns`` file
    store unless told otherwise, and recommends this one)."""
    return f"sqlite:///{(directory / 'mlflow.db').absolute()}"


class MlflowTracker:
    def __init__(self, run_name: str, directory: Path, config: dict[str, Any]) -> None:
        _require("mlflow")
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI") or local_store(directory)
        self.client: Any = MlflowClient(tracking_uri=uri)
        experiment = self.client.get_experiment_by_name(PROJECT)
        experiment_id = (
            experiment.experiment_id if experiment is not None else self.client.create_experiment(PROJECT)
        )
        self.run_id: str = self.client.create_run(experiment_id, run_name=run_name).info.run_id
        for name, value in config.items():
            self.client.log_param(self.run_id, name, value)

    def __call__(self, record: StepRecord) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        values = [Metric(name, value, now, record.step) for name, value in metrics(record).items()]
        self.client.log_batch(self.run_id, metrics=values)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)
