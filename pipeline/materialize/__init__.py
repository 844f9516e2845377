"""The materializer: the log folded into trajectories (pure math in ``trajectory``), read models, training
batches and the batch outbox, exactly once.

``config`` (what the batches depend on), ``records`` and ``columns`` (what the fold reads and writes),
``fields`` (its checks of an event), ``fold`` (the fold itself, no I/O), ``workers`` (its episode half in
forked processes), ``rebuild`` (a rebuild's schema and its indexes), ``writes`` (a step's COPYs and
UPDATEs), ``state`` (what a restart loads) and ``writer`` (``Materializer``: the fold on PostgreSQL, one
transaction a step)."""

from pipeline.materialize.config import MaterializerConfig, rebuild_schema
from pipeline.materialize.fold import Fold, TurnLineage, episode_lineages
from pipeline.materialize.metrics import MaterializerMetrics
from pipeline.materialize.rebuild import READ_MODEL_TABLES, drop_rebuild
from pipeline.materialize.report import lineages_of_records
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
from pipeline.materialize.writer import Materializer

__all__ = [
    "READ_MODEL_TABLES",
    "Fold",
    "Materializer",
    "MaterializerConfig",
    "MaterializerMetrics",
    "Sample",
    "Turn",
    "TurnLineage",
    "apply_staleness",
    "children",
    "concat_samples",
    "discounted_rewards",
    "drop_rebuild",
    "episode_lineages",
    "group_advantages",
    "individual_samples",
    "lineages_of_records",
    "monte_carlo_returns",
    "parents",
    "rebuild_schema",
]
