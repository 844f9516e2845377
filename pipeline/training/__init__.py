"""The trainer's side: batches from JetStream as tensors, exactly once in effect (``subscription``), the
reference PPO-clip learner (``ppo``: device, bf16, micro-batches, KL to a reference, LoRA), the training
loop (``trainer``: checkpoints kept, a per-step logger hook, experiment trackers in ``tracking``), policy
versions, a torch ``Dataset`` of a batch's samples (``dataset``), and TRL's trainers on the stream
(``trl_adapters``: needs the ``trl`` extra only when used).

The names below are imported when first used (PEP 562 ``__getattr__``), not when the package is: the
learner and the tensors need torch alone, and a GPU machine that only runs the learner (``pytest -m gpu
tests/e2e/test_gpu_learner.py``) has no NATS or SQL client to import.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pipeline.training.dataset import BatchStream
    from pipeline.training.pacing import TrainerBacklog
    from pipeline.training.ppo import LearnerOptions, PolicyGradient, checkpoint_dir
    from pipeline.training.subscription import (
        BatchSubscription,
        DeliveredBatch,
        publish_policy_version,
        published_version,
        version_event_id,
    )
    from pipeline.training.tensors import BatchTensors, concat_tensors, payload_tensors, to_tensors
    from pipeline.training.tracking import TRACKERS, Tracker, open_tracker
    from pipeline.training.trainer import (
        JsonlStepLog,
        StepHook,
        StepRecord,
        TrainerStats,
        TrainingPlan,
        prune_checkpoints,
        resume,
        train,
    )
    from pipeline.training.trl_adapters import (
        CheckpointWeightTransfer,
        StreamFeed,
        StreamRollouts,
        StreamRolloutWorker,
        placeholder_prompts,
        reward_turnstile,
        write_checkpoint,
    )

_HOME: dict[str, str] = {
    "BatchStream": "dataset",
    "TrainerBacklog": "pacing",
    "LearnerOptions": "ppo",
    "PolicyGradient": "ppo",
    "checkpoint_dir": "ppo",
    "BatchSubscription": "subscription",
    "DeliveredBatch": "subscription",
    "publish_policy_version": "subscription",
    "published_version": "subscription",
    "version_event_id": "subscription",
    "BatchTensors": "tensors",
    "concat_tensors": "tensors",
    "payload_tensors": "tensors",
    "to_tensors": "tensors",
    "TRACKERS": "tracking",
    "Tracker": "tracking",
    "open_tracker": "tracking",
    "JsonlStepLog": "trainer",
    "StepHook": "trainer",
    "StepRecord": "trainer",
    "TrainerStats": "trainer",
    "TrainingPlan": "trainer",
    "prune_checkpoints": "trainer",
    "resume": "trainer",
    "train": "trainer",
    "CheckpointWeightTransfer": "trl_adapters",
    "StreamFeed": "trl_adapters",
    "StreamRollouts": "trl_adapters",
    "StreamRolloutWorker": "trl_adapters",
    "placeholder_prompts": "trl_adapters",
    "reward_turnstile": "trl_adapters",
    "write_checkpoint": "trl_adapters",
}

__all__ = [
    "TRACKERS",
    "BatchStream",
    "BatchSubscription",
    "BatchTensors",
    "CheckpointWeightTransfer",
    "DeliveredBatch",
    "JsonlStepLog",
    "LearnerOptions",
    "PolicyGradient",
    "StepHook",
    "StepRecord",
    "StreamFeed",
    "StreamRolloutWorker",
    "StreamRollouts",
    "Tracker",
    "TrainerBacklog",
    "TrainerStats",
    "TrainingPlan",
    "checkpoint_dir",
    "concat_tensors",
    "open_tracker",
    "payload_tensors",
    "placeholder_prompts",
    "prune_checkpoints",
    "publish_policy_version",
    "published_version",
    "resume",
    "reward_turnstile",
    "to_tensors",
    "train",
    "version_event_id",
    "write_checkpoint",
]


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value  # the next look-up finds it without coming here
    return value


def __dir__() -> list[str]:
    return __all__
