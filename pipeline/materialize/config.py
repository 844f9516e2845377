"""How the log becomes batches: the materializer's configuration, its hash, and the ids of its batches."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

from pipeline.errors import ConfigError
from pipeline.materialize import lineages

_NAME = re.compile(r"^[a-z][a-z0-9_]{0,40}$")


@dataclass(frozen=True)
class MaterializerConfig:
    """How the log becomes batches. Everything but ``name`` and ``step_events`` goes into the batch ids."""

    name: str = "main"
    discount: float = 1.0
    style: Literal["individual", "concat"] = "individual"
    advantage: Literal["grpo", "mean", "none"] = "grpo"
    advantage_peers: Literal["depth", "slot"] = "depth"
    """Who a sample is compared with in its group: ``depth`` (samples at the same depth of their episodes'
    turn trees, each episode weighing 1: ``trajectory.tree_peers``), or ``slot`` (the k-th sample of each
    episode against the k-th of the others: the rule before trees were considered)."""
    side_calls: Literal["skip", "train"] = "skip"
    """``skip``: side calls are not trained unless asked (``lineages`` rule 4); ``train``: they are."""
    batch_samples: int = 64
    batch_tokens: int | None = None
    max_staleness: int | None = None
    stale: Literal["drop", "flag"] = "drop"
    group_timeout_s: float = 600.0
    step_events: int = 10_000
    """Events folded per transaction (at most). Larger steps cost a rebuild less: a sample batched in the step
    that made it is written once, without its arrays, where one batched a step later is written with them and
    then updated (50k turns: PostgreSQL's CPU -33%, ours -10% against 2,000)."""

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise ConfigError(f"materializer name {self.name!r}: use lowercase letters, digits and _")
        if not 0.0 <= self.discount <= 1.0:
            raise ConfigError(f"--discount must be within [0, 1], got {self.discount}")
        if self.style not in ("individual", "concat"):
            raise ConfigError(f"--style must be individual or concat, got {self.style!r}")
        if self.advantage not in ("grpo", "mean", "none"):
            raise ConfigError(f"--advantage must be grpo, mean or none, got {self.advantage!r}")
        if self.advantage_peers not in ("depth", "slot"):
            raise ConfigError(f"--advantage-peers must be depth or slot, got {self.advantage_peers!r}")
        if self.side_calls not in ("skip", "train"):
            raise ConfigError(f"--side-calls must be skip or train, got {self.side_calls!r}")
        if self.stale not in ("drop", "flag"):
            raise ConfigError(f"--stale must be drop or flag, got {self.stale!r}")
        if self.batch_samples < 1 or (self.batch_tokens is not None and self.batch_tokens < 1):
            raise ConfigError("--batch-samples and --batch-tokens must be at least 1")
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ConfigError(f"--max-staleness must be 0 or more, got {self.max_staleness}")
        if self.step_events < 1:
            raise ConfigError(f"--step-events must be at least 1, got {self.step_events}")

    @property
    def schema(self) -> str:
        """``public`` for the live materializer, ``rm_<name>`` for a rebuild."""
        return "public" if self.name == "main" else rebuild_schema(self.name)

    @property
    def checkpoint(self) -> str:
        return f"materializer:{self.name}"

    def semantics(self) -> dict[str, Any]:
        """What the batches depend on: the options but ``name`` and ``step_events``, and the lineage rule's
        version. A value that was the only behaviour before it was recorded is left out, so that the
        configurations made then keep their hash: ``advantage_peers`` slot, lineage rule 1 (whose
        materializers cannot be told apart from those made before the rule existed: rebuild those).
        ``side_calls`` came with rule 2, so it is always in a hash that has a rule version."""
        fields = asdict(self)
        del fields["name"], fields["step_events"]
        if fields["advantage_peers"] == "slot":
            del fields["advantage_peers"]
        rule: int = lineages.RULE
        if rule != 1:
            fields["lineage_rule"] = rule
        else:
            del fields["side_calls"]
        return fields

    def config_hash(self) -> str:
        canonical = json.dumps(self.semantics(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def rebuild_schema(name: str) -> str:
    """The schema of the rebuild ``name`` (``turnstile rematerialize --name``): ``rm_<name>``."""
    return f"rm_{name}"


def batch_id_for(config_hash: str, sample_ids: Sequence[str]) -> str:
    digest = hashlib.sha256(config_hash.encode())
    for sample_id in sample_ids:
        digest.update(b"\n" + sample_id.encode())
    return digest.hexdigest()[:32]
