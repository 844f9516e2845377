"""The trainer's side: batches from JetStream as tensors, exactly once in effect (``subscription``), the
reference PPO-clip learner (``ppo``), the training loop (``trainer``: checkpoints kept, a per-step logger
hook), policy versions, a torch ``Dataset`` of a batch's samples (``dataset``, imported on its own:
it imports torch), and TRL's trainers on the stream (``trl_adapters``: needs the ``trl`` extra only when
used)."""

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
from pipeline.training.trl_adapters import (
    CheckpointWeightTransfer,
    StreamFeed,
    StreamRollouts,
    StreamRolloutWorker,
    placeholder_prompts,
    reward_turnstile,
    write_checkpoint,
)

__all__ = [
    "BatchStream",
    "BatchSubscription",
    "BatchTensors",
    "CheckpointWeightTransfer",
    "DeliveredBatch",
    "JsonlStepLog",
    "PolicyGradient",
    "StepHook",
    "StepRecord",
    "StreamFeed",
    "StreamRolloutWorker",
    "StreamRollouts",
    "TrainerStats",
    "TrainingPlan",
    "checkpoint_dir",
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
