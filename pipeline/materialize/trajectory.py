"""Pure materialization math: the turn tree by token prefix, discounted rewards, samples, advantages.

No I/O here: each function maps typed records to new typed records, so a trajectory is a fold of the
episode's events that tests can check against hand-computed numbers.
"""

from __future__ import annotations

import math
import statistics
import uuid
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal, Protocol, TypeVar

from schemas import TurnCompleted

Id = TypeVar("Id", bound=Hashable)
_Id_co = TypeVar("_Id_co", bound=Hashable, covariant=True)
Parents = Mapping[uuid.UUID, uuid.UUID | None]
"""Turn id -> the id of the turn it extends, or None for a root."""
Tree = Mapping[Id, Id | None]
"""``Parents`` with ids of any kind (the materializer's fold keys its turns by their ids as text)."""


class Node(Protocol[_Id_co]):
    """What the tree math (``discounted_rewards``, ``lineages``) reads of a turn: ``Turn``, or the
    materializer's packed turns (``pipeline.materialize.packed``)."""

    @property
    def turn_id(self) -> _Id_co: ...
    @property
    def episode_id(self) -> str: ...
    @property
    def index(self) -> int: ...
    @property
    def reward(self) -> float: ...


N = TypeVar("N", bound=Node[Any])
"""A turn of either kind (``path_to``)."""


@dataclass(frozen=True, slots=True)
class Turn:
    """One LLM call of an episode, reduced to what the math needs; ``reward`` is the turn's own reward."""

    turn_id: uuid.UUID
    episode_id: str
    index: int
    prompt_token_ids: tuple[int, ...]
    completion_token_ids: tuple[int, ...]
    completion_logprobs: tuple[float, ...]
    policy_version: int
    reward: float = 0.0
    extends: uuid.UUID | None = None
    """An earlier turn whose prompt + completion begin this turn's prompt, as recorded (a turn that records
    what it adds to its parent): ``parents`` then looks only for a longer one, never token by token."""

    def __post_init__(self) -> None:
        if len(self.completion_logprobs) != len(self.completion_token_ids):
            raise ValueError(
                f"turn {self.turn_id} has {len(self.completion_logprobs)} logprobs for "
                f"{len(self.completion_token_ids)} completion tokens; every model token needs its logprob"
            )

    @classmethod
    def from_event(cls, event: TurnCompleted, *, episode_id: str, index: int, reward: float = 0.0) -> Turn:
        return cls(
            turn_id=event.turn_id,
            episode_id=episode_id,
            index=index,
            prompt_token_ids=tuple(event.prompt_token_ids),
            completion_token_ids=tuple(event.completion_token_ids),
            completion_logprobs=tuple(event.completion_logprobs),
            policy_version=event.policy_version,
            reward=reward,
        )


@dataclass(frozen=True, slots=True)
class Sample:
    """One training sequence; ``loss_mask`` is 1 exactly on the model's own tokens.

    ``policy_version`` is the oldest (minimum) version that produced a masked token, so staleness is
    judged by the sample's stalest part. ``reward`` is a discounted value (see the two builders).
    """

    sample_id: str
    episode_id: str
    turn_ids: tuple[uuid.UUID, ...]
    input_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]
    logprobs: tuple[float, ...]
    policy_version: int
    reward: float
    advantage: float = 0.0
    stale: bool = False


def _order(turn: Node[Any]) -> tuple[str, int]:
    return turn.episode_id, turn.index


def _length(turn: Turn) -> int:
    return len(turn.prompt_token_ids) + len(turn.completion_token_ids)


def _extends(turn: Turn, parent: Turn) -> bool:
    """True when the parent's prompt then completion are, token for token, the start of the turn's prompt."""
    cut = len(parent.prompt_token_ids)
    prompt = turn.prompt_token_ids
    return (
        len(prompt) >= _length(parent)
        and prompt[:cut] == parent.prompt_token_ids
        and prompt[cut : _length(parent)] == parent.completion_token_ids
    )


def parents(turns: Iterable[Turn]) -> dict[uuid.UUID, uuid.UUID | None]:
    """Each turn's parent: the earlier turn of its episode whose tokens start its prompt.

    Token level, never text. Where several earlier turns qualify, the longest prefix wins, then the latest.
    A turn that extends none is a root. A turn that names the turn it extends (``Turn.extends``) is compared
    only with earlier turns at least as long as that one (none, in a linear conversation): the cost of a
    recorded episode grows with its tokens, not with its turns times its tokens.
    """
    ordered = sorted(turns, key=_order)
    by_id = {turn.turn_id: turn for turn in ordered}
    result: dict[uuid.UUID, uuid.UUID | None] = {}
    for i, turn in enumerate(ordered):
        named = by_id.get(turn.extends) if turn.extends is not None else None
        floor = _length(named) if named is not None else 0
        same_episode = (
            e
            for e in ordered[:i]
            if e.episode_id == turn.episode_id and e.index < turn.index and e is not named
            and floor <= _length(e) <= len(turn.prompt_token_ids)
        )  # fmt: skip
        extended = [e for e in same_episode if _extends(turn, e)]
        if named is not None:
            extended.append(named)
        best = max(extended, key=lambda e: (_length(e), e.index), default=None)
        result[turn.turn_id] = None if best is None else best.turn_id
    return result


def children(parents: Tree[Id]) -> dict[Id, tuple[Id, ...]]:
    """Each turn's children in the parents' order; a leaf maps to ``()``, a branch to several ids."""
    kids: dict[Id, list[Id]] = {turn_id: [] for turn_id in parents}
    for turn_id, parent in parents.items():
        if parent is not None:
            kids.setdefault(parent, []).append(turn_id)
    return {turn_id: tuple(ids) for turn_id, ids in kids.items()}


def discounted_rewards(turns: Iterable[Node[Id]], parents: Tree[Id], discount: float) -> dict[Id, float]:
    """A turn's value: its own reward plus ``discount`` times its child's value (AReaL's backprop).

    At a branch the children's values are averaged (AReaL documents the rule for a chain only): a
    turn's value then estimates its expected future under the policy, and a turn that forks into
    many calls is not paid once per fork. Leaves are done first by walking turns in reverse order, so
    a child (always later in its episode) is valued before its parent, without recursion.
    """
    kids = children(parents)
    ordered = sorted(turns, key=_order)
    values: dict[Id, float] = {}
    for turn in reversed(ordered):
        future = [values[kid] for kid in kids.get(turn.turn_id, ())]
        values[turn.turn_id] = turn.reward + discount * (statistics.fmean(future) if future else 0.0)
    return {turn.turn_id: values[turn.turn_id] for turn in ordered}


def monte_carlo_returns(rewards: Sequence[float], gamma: float) -> list[float]:
    """rLLM's returns over a linear trajectory: ``G_t = r_t + gamma * G_{t+1}``, with ``G_T = 0``."""
    returns = [0.0] * len(rewards)
    future = 0.0
    for t in reversed(range(len(rewards))):
        future = rewards[t] + gamma * future
        returns[t] = future
    return returns


def individual_samples(turns: Iterable[Turn], values: Mapping[uuid.UUID, float]) -> list[Sample]:
    """One sample per turn (AReaL's ``individual`` style): its prompt masked out, its completion trained.

    ``reward`` is the turn's own discounted value.
    """
    return [
        Sample(
            sample_id=str(turn.turn_id),
            episode_id=turn.episode_id,
            turn_ids=(turn.turn_id,),
            input_ids=turn.prompt_token_ids + turn.completion_token_ids,
            loss_mask=(0,) * len(turn.prompt_token_ids) + (1,) * len(turn.completion_token_ids),
            logprobs=(0.0,) * len(turn.prompt_token_ids) + turn.completion_logprobs,
            policy_version=turn.policy_version,
            reward=values[turn.turn_id],
        )
        for turn in turns
    ]


def path_to(leaf: N, by_id: Mapping[Id, N], tree: Tree[Id], extends: Callable[[N, N], bool]) -> list[N]:
    """The turns from the root down to ``leaf`` (``Turn``s, or the fold's packed turns with their own
    ``extends``); refuses a link that is not a token-exact extension."""
    path = [leaf]
    while (parent_id := tree[path[-1].turn_id]) is not None:
        parent, child = by_id[parent_id], path[-1]
        if parent.index >= child.index or not extends(child, parent):
            raise ValueError(
                f"turn {child.turn_id} does not extend its parent {parent_id} token for token; "
                "concat samples need exact prefixes (build the parents with trajectory.parents)"
            )
        path.append(parent)
    return path[::-1]


def _concat_sample(path: Sequence[Turn], values: Mapping[uuid.UUID, float]) -> Sample:
    leaf = path[-1]
    input_ids = leaf.prompt_token_ids + leaf.completion_token_ids
    loss_mask = [0] * len(input_ids)
    logprobs = [0.0] * len(input_ids)
    for turn in path:
        start, end = len(turn.prompt_token_ids), _length(turn)
        loss_mask[start:end] = [1] * (end - start)
        logprobs[start:end] = turn.completion_logprobs
    versions = [turn.policy_version for turn in path if turn.completion_token_ids]
    return Sample(
        sample_id=f"{leaf.turn_id}:path",
        episode_id=leaf.episode_id,
        turn_ids=tuple(turn.turn_id for turn in path),
        input_ids=input_ids,
        loss_mask=tuple(loss_mask),
        logprobs=tuple(logprobs),
        policy_version=min(versions, default=leaf.policy_version),
        reward=values[path[0].turn_id],
    )


def concat_samples(
    turns: Iterable[Turn], parents: Parents, values: Mapping[uuid.UUID, float]
) -> list[Sample]:
    """One sample per root-to-leaf path (AReaL's ``concat`` style), in the leaves' order.

    The sequence is the leaf's prompt and completion; each path turn's own completion is trained
    (mask 1, its logprobs), everything between (tool output, user messages, template glue) is not.
    ``reward`` is the discounted value of the path's first turn: the return of the whole path. At a
    branch that value averages over the branches, so sibling paths share it.
    """
    ordered = sorted(turns, key=_order)
    by_id = {turn.turn_id: turn for turn in ordered}
    kids = children(parents)
    leaves = [turn for turn in ordered if not kids.get(turn.turn_id)]
    return [_concat_sample(path_to(leaf, by_id, parents, _extends), values) for leaf in leaves]


def group_advantages(
    rewards: Sequence[float],
    *,
    mode: Literal["grpo", "mean"] = "grpo",
    eps: float = 1e-6,
    weights: Sequence[float] | None = None,
) -> list[float]:
    """Advantages within one group of samples of the same task.

    ``grpo``: ``(r - mean) / (std + eps)`` with the POPULATION std (divide by n, as the group is the
    whole population being compared; verl's ``torch.std`` divides by n - 1). ``mean``: ``r - mean``
    (no scaling, as in Dr. GRPO). A group of one has nothing to compare with: advantage 0.0.
    ``weights``: the mean and std are weighted (``tree_peers`` gives each episode weight 1 in total).
    """
    if len(rewards) < 2:
        return [0.0] * len(rewards)
    if weights is None:
        mean = statistics.fmean(rewards)
        spread = statistics.pstdev(rewards, mu=mean)
    else:
        total = math.fsum(weights)
        mean = math.fsum(w * r for w, r in zip(weights, rewards, strict=True)) / total
        spread = math.sqrt(
            math.fsum(w * (r - mean) ** 2 for w, r in zip(weights, rewards, strict=True)) / total
        )
    if mode == "mean":
        return [r - mean for r in rewards]
    if mode == "grpo":
        return [(r - mean) / (spread + eps) for r in rewards]
    raise ValueError(f"unknown advantage mode {mode!r}; use 'grpo' or 'mean'")


def depths(parents: Tree[Id]) -> dict[Id, int]:
    """Each turn's depth in its episode's tree: 0 for a root, its parent's depth + 1 otherwise."""
    found: dict[Id, int] = {}

    def depth(turn_id: Id) -> int:
        chain = []
        while turn_id not in found:
            parent = parents[turn_id]
            if parent is None:
                found[turn_id] = 0
                break
            chain.append(turn_id)
            turn_id = parent
        for child in reversed(chain):
            found[child] = found[parents[child]] + 1  # type: ignore[index]
        return found[chain[0]] if chain else found[turn_id]

    for turn_id in parents:
        depth(turn_id)
    return found


def tree_peers(keys: Sequence[tuple[str, int]]) -> tuple[dict[int, list[int]], list[float]]:
    """Who a sample is compared with on trees, and with what weight.

    ``keys``: per sample, (its episode, its depth: the turn's depth in the episode's tree for one sample
    per turn, 0 for one per root-to-leaf path). Samples of the same depth across the group's episodes are
    peers, and each episode has weight 1 in total at each depth (its samples there share it): a branch's
    two turns at depth 1 count as half an episode each against a chain's one turn at depth 1, and two
    sibling paths of one episode count as one episode against another episode's single path.
    Returns the peers by depth (indexes into ``keys``) and each sample's weight.
    """
    per_episode_depth: dict[tuple[str, int], int] = {}
    for key in keys:
        per_episode_depth[key] = per_episode_depth.get(key, 0) + 1
    peers: dict[int, list[int]] = {}
    for index, (_, depth) in enumerate(keys):
        peers.setdefault(depth, []).append(index)
    return peers, [1.0 / per_episode_depth[key] for key in keys]


def apply_staleness(
    samples: Iterable[Sample], newest_version: int, max_staleness: int, mode: Literal["drop", "flag"]
) -> list[Sample]:
    """Drop, or flag ``stale``, the samples whose policy version is older than ``newest - max_staleness``."""
    if max_staleness < 0:
        raise ValueError(f"max_staleness must be 0 or more, got {max_staleness}")
    oldest = newest_version - max_staleness
    if mode == "drop":
        return [sample for sample in samples if sample.policy_version >= oldest]
    if mode == "flag":
        return [s if s.policy_version >= oldest else replace(s, stale=True) for s in samples]
    raise ValueError(f"unknown staleness mode {mode!r}; use 'drop' or 'flag'")
