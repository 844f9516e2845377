"""The trainer's side: batches from JetStream as tensors, exactly once in effect (``subscription``), the
reference PPO-clip learner (``ppo``), the training loop (``trainer``: checkpoints kept, a per-step logger
hook), policy versions, and a torch ``Dataset`` of a batch's samples (``dataset``, imported on its own:
it imports torch)."""

from pipeline.training.dataset import BatchStream
from pipeline.training.ppo import PolicyGradient, checkpoint_dir
from pipeline.training.subscription import (
    BatchSubscription,
    BatchTensors,
    DeliveredBatch,
    payload_tensors,
    publish_policy_version,
    published_version,
    to_tensors,
    version_event_id,
)
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

__all__ = [
    "BatchStream",
    "BatchSubscription",
    "BatchTensors",
    "DeliveredBatch",
    "JsonlStepLog",
    "PolicyGradient",
    "StepHook",
    "StepRecord",
    "TrainerStats",
    "TrainingPlan",
    "checkpoint_dir",
    "payload_tensors",
    "prune_checkpoints",
    "publish_policy_version",
    "published_version",
    "resume",
    "to_tensors",
    "train",
    "version_event_id",
]
