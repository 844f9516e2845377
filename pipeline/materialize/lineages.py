"""Lineages: the several conversations one episode may hold, and what training makes of each.

A black-box agent's calls are not one conversation. Besides its own loop it makes side calls (opencode's
title, Claude Code's small-model calls), runs subagents (Claude Code's Agent tool: a fresh conversation
whose result comes back to the loop as a tool result) and compacts (a summarised restart: a new
conversation that carries the work on). Every call that does not extend an earlier turn token for token
starts a new root (``trajectory.parents``); a **lineage** is a root and every turn below it.

The rule, as a demanding RL user wants it:

1. **Marked calls are not trained.** A turn recorded with ``train: false`` (the gateway's
   ``x-turnstile-train: false`` header, or the session's ``untrained_models`` patterns matching the
   request's ``model``; ``llm.chat(..., train=False)`` in process) is recorded and shown like any other,
   but makes no sample and takes no reward. So does a turn never delivered (its client left) that no later
   turn continues. The rest of this rule works on the **trained tree**: the turn tree with those turns
   taken out; a trained turn whose parent was taken out is a root there (its sample keeps the whole
   prompt, the untrained parent's tokens included, with loss mask 0 on them).
2. **The episode's reward reaches every trained lineage.** A reward without a turn (the outcome) is added
   to the last turn of each lineage of the trained tree, and flows back along it with ``--discount``. A
   subagent's work and a compacted restart's work both led to the outcome, so both learn from it; a call
   that should not learn from it is marked (rule 1). A single-lineage episode gets exactly what it got
   before lineages had a meaning: the reward on its last turn. A reward for a turn
   (``RewardAssigned.turn_id``, ``POST .../reward {"turn_id": ...}``) stays on that turn: that is how a
   lineage gets a reward of its own.
3. **One lineage is the main one**: the trained lineage with the most turns, the earliest root on a tie
   (the agent's own loop makes more calls than any one side call or subagent; a restart after compaction
   is main when it outlasts what came before it). It matters for advantages: with ``--advantage-peers
   depth`` a sample is compared with samples of the *same kind of lineage* at the same depth across the
   group (the main lineages' turns with each other, side lineages' turns with each other), never a title
   call against the agent's first turn. Main lineage samples keep ``slot`` = depth as before; side
   lineage samples get ``slot`` = -1 - depth.
4. **Side calls are not trained unless asked** (rule version 2; ``--side-calls train`` turns it off). In an
   episode whose calls offer tools, a lineage whose root offers none (opencode's title, Claude Code's topic
   check) is a side call; so is one whose root names another model than the episode's main one (the model of
   its first call that offers tools, else of its first call: Claude Code's small-model calls). Its turns are
   left out like marked ones, unless a turn was asked for training (``train: true``). An episode whose calls
   offer no tools at all (a plain chat task) has no side calls by this rule.
5. **Delivered means delivered** (rule version 2). A turn recorded ``delivered: false`` is delivered once a
   later ``TurnDelivered`` names it (the gateway appends one when the reply was handed to a live client);
   without one, and with no later turn continuing it, it is left out (rule 1).

Pure functions over the turn tree; the materializer (``Fold._turns``) applies them.

The rule changes what a log folds to, so its version (``RULE``) is part of a materializer's configuration
hash (``MaterializerConfig.semantics``): change it with the rule.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from pipeline.materialize.trajectory import Id, Node, Tree

RULE: Final = 2
"""This rule's version. Bump it whenever the rule changes what a log folds to: a materializer built under
another version then refuses to go on (its batches would mix two rules), and a rebuild gets batch ids of its
own. Version 1 hashes as configurations did before the rule was recorded (see ``semantics``). Version 2:
side calls (rule 4) and delivery (rule 5)."""

FIRST_CALL: Final = "first call"
SIDE_CALL: Final = "side call"
EDIT: Final = "edit"
TEMPLATE_BREAK: Final = "template break"
NEW_CONVERSATION: Final = "new conversation"
"""Why a lineage's root started: the episode's first call; a side call (rule 4, or marked not for training);
an earlier reply sent back changed in substance (``TurnCompleted.edit``); a continuation the chat template
could not prove (``prefix_break``); else a conversation of its own (a subagent, a compacted restart)."""


@dataclass(frozen=True, slots=True)
class TurnFacts:
    """What the rule reads of a recorded turn besides the tree."""

    turn_id: str
    index: int
    offers_tools: bool
    model: str | None
    train: bool | None
    edited: bool
    prefix_break: bool


def side_roots(facts: Sequence[TurnFacts], tree: Tree[str]) -> set[str]:
    """The roots of ``tree`` (the whole turn tree) that are side calls (rule 4)."""
    ordered = sorted(facts, key=lambda turn: turn.index)
    with_tools = [turn for turn in ordered if turn.offers_tools]
    if not ordered:
        return set()
    main_model = (with_tools or ordered)[0].model
    side = set()
    for turn in ordered:
        if tree[turn.turn_id] is not None or turn.train is True:
            continue
        other_model = turn.model is not None and main_model is not None and turn.model != main_model
        if (with_tools and not turn.offers_tools) or other_model:
            side.add(turn.turn_id)
    return side


def side_turns(facts: Sequence[TurnFacts], tree: Tree[str]) -> set[str]:
    """Every turn of a side lineage (rule 4) but those asked for training."""
    side = side_roots(facts, tree)
    if not side:
        return set()
    lineage = roots(tree)
    return {turn.turn_id for turn in facts if lineage[turn.turn_id] in side and turn.train is not True}


def root_reasons(facts: Sequence[TurnFacts], tree: Tree[str], side: Collection[str]) -> dict[str, str]:
    """Why each root of ``tree`` started (``FIRST_CALL`` ... ``NEW_CONVERSATION``), by its turn id. The first
    call is the episode's first root that is no side call (Claude Code's topic check may come before it)."""
    reasons = {}
    first = True
    for turn in sorted(facts, key=lambda turn: turn.index):
        if tree[turn.turn_id] is not None:
            continue
        if turn.turn_id in side or turn.train is False:
            reasons[turn.turn_id] = SIDE_CALL
            continue
        if turn.edited:
            reasons[turn.turn_id] = EDIT
        elif turn.prefix_break:
            reasons[turn.turn_id] = TEMPLATE_BREAK
        else:
            reasons[turn.turn_id] = FIRST_CALL if first else NEW_CONVERSATION
        first = False
    return reasons


def trained_tree(tree: Tree[Id], excluded: Collection[Id]) -> dict[Id, Id | None]:
    """The tree without the ``excluded`` turns; a turn whose parent is excluded becomes a root."""
    return {
        turn_id: parent if parent not in excluded else None
        for turn_id, parent in tree.items()
        if turn_id not in excluded
    }


def roots(tree: Tree[Id]) -> dict[Id, Id]:
    """Each turn's lineage: the id of the root above it (a root is its own)."""
    found: dict[Id, Id] = {}
    for turn_id in tree:
        chain = []
        node = turn_id
        while node not in found:
            parent = tree[node]
            if parent is None:
                found[node] = node
                break
            chain.append(node)
            node = parent
        for member in chain:
            found[member] = found[node]
    return found


def main_root(turns: Iterable[Node[Id]], lineage: Mapping[Id, Id]) -> Id | None:
    """The main lineage's root: the most turns, then the earliest root (rule 3); None without turns."""
    ordered = sorted(turns, key=lambda turn: turn.index)
    counts: dict[Id, int] = {}
    for turn in ordered:
        root = lineage[turn.turn_id]
        counts[root] = counts.get(root, 0) + 1
    first_index = {turn.turn_id: turn.index for turn in ordered}
    return min(counts, key=lambda root: (-counts[root], first_index[root]), default=None)


def episode_reward_targets(turns: Iterable[Node[Id]], lineage: Mapping[Id, Id]) -> list[Id]:
    """The turns the episode's reward goes to: the last turn of each lineage (rule 2), in turn order."""
    last: dict[Id, Node[Id]] = {}
    for turn in turns:
        root = lineage[turn.turn_id]
        if root not in last or turn.index > last[root].index:
            last[root] = turn
    return [turn.turn_id for turn in sorted(last.values(), key=lambda turn: turn.index)]


def peer_slot(depth: int, *, main: bool) -> int:
    """The ``slot`` a sample is compared in (rule 3): its depth on the main lineage, -1 - depth elsewhere."""
    return depth if main else -1 - depth
