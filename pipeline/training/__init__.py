"""The trainer's side: batches from JetStream as tensors, exactly once in effect (``subscription``), the
reference PPO-clip learner (``ppo``), the training loop (``trainer``) and policy versions."""

from pipeline.training.ppo import PolicyGradient, checkpoint_dir
from pipeline.training.subscription import (
    BatchSubscription,
    BatchTensors,
    DeliveredBatch,
    publish_policy_version,
    published_version,
    to_tensors,
    version_event_id,
)
from pipeline.training.trainer import TrainerStats, TrainingPlan, resume, train

__all__ = [
    "BatchSubscription",
    "BatchTensors",
    "DeliveredBatch",
    "PolicyGradient",
    "TrainerStats",
    "TrainingPlan",
    "checkpoint_dir",
    "publish_policy_version",
    "published_version",
    "resume",
    "to_tensors",
    "train",
    "version_event_id",
]
