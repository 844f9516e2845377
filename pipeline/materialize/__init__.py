"""The materializer: the log folded into trajectories (pure math in ``trajectory``), read models, training
batches and the batch outbox, exactly once (``materializer``)."""

from pipeline.materialize.materializer import (
    READ_MODEL_TABLES,
    USABLE,
    Fold,
    Materializer,
    MaterializerConfig,
    batch_id_for,
    drop_rebuild,
    rebuild_schema,
)
from pipeline.materialize.metrics import MaterializerMetrics
from pipeline.materialize.trajectory import (
    Sample,
    Turn,
    apply_staleness,
    children,
    concat_samples,
    discounted_rewards,
    group_advantages,
    individual_samples,
    monte_carlo_returns,
    parents,
)

__all__ = [
    "READ_MODEL_TABLES",
    "USABLE",
    "Fold",
    "Materializer",
    "MaterializerConfig",
    "MaterializerMetrics",
    "Sample",
    "Turn",
    "apply_staleness",
    "batch_id_for",
    "children",
    "concat_samples",
    "discounted_rewards",
    "drop_rebuild",
    "group_advantages",
    "individual_samples",
    "monte_carlo_returns",
    "parents",
    "rebuild_schema",
]
