"""The fold: the log's events made into episodes, turns, samples, groups and batches, one by one (no I/O)."""

from __future__ import annotations

import json
import logging
import math
from collections import OrderedDict, deque
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Any

from pipeline.batches.format import encode_packed
from pipeline.log.json_text import JsonText
from pipeline.materialize import lineages, packed
from pipeline.materialize.columns import FINISHED_INDEXES, S_ADVANTAGE, S_ARRAYS, S_BATCH, S_READY, S_STALE
from pipeline.materialize.config import MaterializerConfig, batch_id_for
from pipeline.materialize.fields import (
    UNFOLDABLE,
    Unfoldable,
    check_event_fields,
    count_of,
    culprit,
    reward_of,
    text_of,
    to_uuid,
    unless,
)
from pipeline.materialize.lineages import (
    TurnFacts,
    episode_reward_targets,
    main_root,
    peer_slot,
    root_reasons,
    roots,
    side_roots,
    side_turns,
    trained_tree,
)
from pipeline.materialize.packed import PackedTurn, floats, token_bytes
from pipeline.materialize.records import (
    USABLE,
    Finished,
    LogRow,
    NewSample,
    Outcome,
    PendingGroup,
    Published,
    ReadySample,
    Writes,
)
from pipeline.materialize.trajectory import depths, discounted_rewards, group_advantages, tree_peers

log = logging.getLogger(__name__)


class Fold:
    """The materializer's state and what it does with each event; no I/O (see ``Materializer``).

    An event the fold cannot use (see ``UNFOLDABLE``) is skipped: recorded in ``skipped_events`` with the
    reason and logged; its episode, if it has one, is recorded as finished with that reason in ``error`` and
    yields no samples. Each handler checks before it changes any state, so a skip leaves the fold as it was.
    """

    def __init__(self, config: MaterializerConfig) -> None:
        self.config = config
        self.config_hash = config.config_hash()
        self.position = 0
        self.open: dict[str, list[LogRow]] = {}
        self.pending: OrderedDict[tuple[str, str], PendingGroup] = OrderedDict()
        self.queues: dict[str, deque[list[ReadySample]]] = {}
        self.newest: dict[str, int] = {}
        self.writes = Writes()
        self.skipped = 0
        self.searches = config.schema == "public"
        """Collect the turns of open episodes for search (``Writes.searched``): the live read models only,
        whose ``turn_search`` the browser reads; a rebuild's schema has none."""

    # -- events --

    def apply(self, row: LogRow) -> None:
        if row.position <= self.position:
            return  # delivered again: already folded
        self.position = row.position
        self._expire_groups(row)
        outcome = self.fold_event(row)
        if outcome is not None:
            self.take(outcome, row)

    # The fold has two halves. The episode half (``fold_event``: open episodes, their turns and samples, the
    # episodes and turn_rows rows, skips) needs nothing from the other; the group half (``_expire_groups``
    # and ``take``: groups, advantages, batches, the policies' newest versions) takes what the episode half
    # made of each event, in the log's order. ``apply`` runs both; a rebuild may run the episode half in
    # worker processes (``Materializer._catch_up_with_workers``) and the group half here, on the same events.

    def fold_event(self, row: LogRow) -> Outcome | None:
        """The episode half of ``apply``: what ``row`` gives the group half, if anything. An event it cannot
        use is skipped here (see ``skip``)."""
        try:
            return self._dispatch(row)
        except UNFOLDABLE as error:
            self.skip(*culprit(error, row), closing=row)
            return None

    def take(self, outcome: Outcome, row: LogRow) -> None:
        """The group half of ``apply`` for an event whose episode half gave ``outcome``."""
        try:
            if isinstance(outcome, Published):
                self.newest[outcome.policy] = max(self.newest.get(outcome.policy, 0), outcome.version)
                return
            self._take_finished(outcome, row)
        except UNFOLDABLE as error:  # its episode is closed already: only the skip is recorded
            self.skip(*culprit(error, row), closing=row)

    def skip(self, row: LogRow, reason: str, *, closing: LogRow | None = None) -> None:
        """Record ``row`` as skipped; if ``closing`` finishes an open episode, that episode is recorded as
        finished, not materialized, with the reason."""
        closing = closing or row
        self.skipped += 1
        reason = reason.replace("\x00", "\\0")
        episode = self.open.get(closing.stream)
        episode_id = str(episode[0].data.get("episode_id")) if episode else None
        log.warning(
            "materializer %s: skipped the event at position %d (%s, %s): %s",
            self.config.name, row.position, row.type, row.stream, reason,
        )  # fmt: skip
        self.writes.skipped.append((row.position, row.stream, row.type, episode_id, reason))
        if episode is not None and closing.type == "EpisodeFinished":
            del self.open[closing.stream]
            self._record_finished(
                closing.stream, episode_id or "", ["finished", None,
                f"not materialized: the event at position {row.position} ({row.type}) was skipped: {reason}",
                None, None, None, None, None, None, closing.recorded_at,
                (closing.recorded_at - episode[0].recorded_at).total_seconds(), closing.position],
            )  # fmt: skip

    def _dispatch(self, row: LogRow) -> Outcome | None:
        if row.type == "EpisodeStarted":
            self._started(row)
        elif row.type in ("TurnCompleted", "RewardAssigned", "TurnDelivered"):
            events = self.open.get(row.stream)
            if events is not None:
                events.append(row)
                if self.searches and row.type == "TurnCompleted":
                    self.writes.searched.append(row.position)
        elif row.type == "EpisodeFinished":
            return self._finished(row)
        elif row.type == "PolicyVersionPublished":
            return Published(text_of(row, "policy"), count_of(row, row.data["version"], "version"))
        return None

    def _started(self, row: LogRow) -> None:
        data = row.data
        episode_id = text_of(row, "episode_id")
        values = [
            episode_id, row.stream, text_of(row, "policy"), text_of(row, "agent", ""),
            text_of(row, "task_id", ""), text_of(row, "group_id", None),
            count_of(row, data.get("group_size", 1), "group_size", least=1),
            text_of(row, "retry_of", None), JsonText(json.dumps(data.get("tags", {}), sort_keys=True)),
            "running", None, None, None, None, None, None, None, None, row.recorded_at, None, None,
            row.position, None,
        ]  # fmt: skip
        self.open[row.stream] = [row]
        self.writes.episodes[row.stream] = values

    def _finished(self, row: LogRow) -> Finished | None:
        events = self.open.get(row.stream)
        if events is None:
            return None  # its start is not in this log (or was folded by an older reader): nothing to close
        # Everything that can fail on a malformed event is computed before any state changes.
        started = events[0].data
        episode_id: str = started["episode_id"]
        turns, turn_rows, view = self._turns(episode_id, events)
        termination = text_of(row, "termination")
        error = text_of(row, "error", None)
        rewards = [reward_of(e) for e in events if e.type == "RewardAssigned"]
        versions = [turn.policy_version for turn in turns]
        finished = [
            "finished", termination, error, sum(rewards) if rewards else None, len(turns),
            sum(len(t.prompt) >> 2 for t in turns), sum(len(t.completion) >> 2 for t in turns),
            min(versions, default=None), max(versions, default=None), row.recorded_at,
            (row.recorded_at - events[0].recorded_at).total_seconds(), row.position,
        ]  # fmt: skip
        usable = termination in USABLE and bool(turns)
        samples = self._samples(view) if usable else []
        del self.open[row.stream]
        self._record_finished(row.stream, episode_id, finished)
        self.writes.turns.extend(turn_rows)
        policy = started["policy"]
        version = max(versions) if versions else None
        if not usable:
            return Finished(policy, version, None, 1, episode_id, [])
        group_id = started.get("group_id") or episode_id
        size = int(started.get("group_size", 1)) if started.get("group_id") else 1
        if self.config.advantage_peers == "depth":
            depth_of = depths(view.tree)
            slots = [
                peer_slot(
                    0 if self.config.style == "concat" else depth_of[s.turns[0].turn_id],
                    main=view.lineage[s.turns[0].turn_id] == view.main,
                )
                for s in samples
            ]
        else:
            slots = list(range(len(samples)))
        by_id = {turn.turn_id: turn for turn in turns}
        made = []
        for slot, sample in zip(slots, samples, strict=True):
            ready = ReadySample(
                sample_id=sample.sample_id,
                episode_id=episode_id,
                group_id=group_id,
                policy=policy,
                turn_ids=(
                    (sample.sample_id,)  # an individual sample's id is its turn's
                    if self.config.style == "individual"
                    else tuple(t.turn_id for t in sample.turns)
                ),
                policy_version=sample.policy_version,
                tokens=sample.tokens,
                reward=sample.reward,
                arrays=sample.arrays,
                position=row.position,
                slot=slot,
            )
            made.append((ready, self._sample_row(ready, sample, by_id, view.values, slot)))
        return Finished(policy, version, group_id, size, episode_id, made)

    def _take_finished(self, outcome: Finished, row: LogRow) -> None:
        policy = outcome.policy
        if outcome.version is not None:
            self.newest[policy] = max(self.newest.get(policy, 0), outcome.version)
        if outcome.group_id is None:
            return  # not usable: no samples
        key = (policy, outcome.group_id)
        group = self.pending.get(key) or PendingGroup(policy, outcome.group_id, outcome.size, row.recorded_at)
        self.pending[key] = group
        self.pending.move_to_end(key)
        group.last_time = row.recorded_at
        group.episodes.add(outcome.episode_id)
        for ready, sample_row in outcome.samples:
            group.samples.append(ready)
            self.writes.samples[ready.sample_id] = sample_row
        if len(group.episodes) >= group.size:
            self._make_ready([group], row)

    def _samples(self, view: Trained) -> list[NewSample]:
        """The episode's samples (``trajectory.concat_samples`` or ``individual_samples``) with their arrays
        packed (``pipeline.materialize.packed``: the bytes ``pack_arrays`` gives for them)."""
        if self.config.style == "concat":
            return [
                NewSample(f"{s.path[-1].turn_id}:path", s.path, s.policy_version, s.reward, s.tokens,
                          s.model_tokens, s.arrays)
                for s in packed.concat_samples(view.turns, view.tree, view.values)
            ]  # fmt: skip
        values = view.values
        return [
            NewSample(t.turn_id, (t,), t.policy_version, values[t.turn_id], t.length, len(t.completion) >> 2,
                      packed.individual_arrays(t))
            for t in view.turns
        ]  # fmt: skip

    @staticmethod
    def _sample_row(
        ready: ReadySample,
        sample: NewSample,
        by_id: dict[str, PackedTurn],
        values: dict[str, float],
        slot: int,
    ) -> list[Any]:
        """The ``sample_rows`` row of a new sample: what equals its own turn's is left NULL (see
        ``SAMPLE_COLUMNS``), and its id is its turn's (``:path`` for a concat sample)."""
        own = by_id[sample.turns[-1].turn_id]
        path = sample.sample_id != ready.key
        if path and sample.sample_id != f"{ready.key}:path":
            raise AssertionError(f"sample id {sample.sample_id!r} is neither its turn's id nor '<turn>:path'")
        return [
            own.uuid, None, None, unless(ready.reward, values[own.turn_id]), slot,
            unless(ready.policy_version, own.policy_version), unless(ready.tokens, own.length),
            unless(sample.model_tokens, len(own.completion) >> 2), False, path, None,
            packed.turn_ids(sample.turns) if len(sample.turns) > 1 else None, ready.arrays,
        ]  # fmt: skip

    def _record_finished(self, stream: str, episode_id: str, finished: list[Any]) -> None:
        inserted = self.writes.episodes.get(stream)
        if inserted is not None:
            for index, value in zip(FINISHED_INDEXES, finished, strict=True):
                inserted[index] = value
        else:
            self.writes.finished.append((*finished, episode_id))

    def _turns(
        self, episode_id: str, events: list[LogRow]
    ) -> tuple[list[PackedTurn], list[tuple[Any, ...]], Trained]:
        """The episode's turns (each with its own reward), their read-model rows, and what training makes of
        them (``Trained``: the lineage rule of ``pipeline.materialize.lineages``)."""
        completed = [e for e in events if e.type == "TurnCompleted"]
        own = {str(e.data["turn_id"]): 0.0 for e in completed}
        outcome: float | None = None
        delivered: set[str] = set()
        for event in events:
            if event.type == "TurnDelivered":
                delivered.update(map(str, event.data.get("turn_ids") or ()))
            elif event.type == "RewardAssigned":
                target = event.data.get("turn_id")
                if target is None:
                    outcome = reward_of(event) + (outcome or 0.0)  # the episode's: see Trained.of
                elif target in own:
                    own[target] += reward_of(event)
        whole: dict[str, PackedTurn] = {}
        turns = [self._turn(episode_id, index, event, own, whole) for index, event in enumerate(completed)]
        view = Trained.of(
            turns,
            completed,
            outcome,
            self.config.discount,
            delivered=delivered,
            side_calls=self.config.side_calls,
        )
        rows = []
        started = events[0].position  # episodes.started_position: how turn_rows name their episode
        uuids = {turn.turn_id: turn.uuid for turn in turns}
        for turn, event in zip(turns, completed, strict=True):
            data = event.data
            lps = floats(turn.logprobs)
            reward = view.rewards.get(turn.turn_id, turn.reward)
            parent = view.whole_tree[turn.turn_id]
            rows.append(
                (
                    turn.uuid, started, event.position, sum(lps) / len(lps) if lps else None, reward,
                    view.values.get(turn.turn_id, reward), turn.index, len(turn.prompt) >> 2,
                    len(turn.completion) >> 2, turn.policy_version, None if parent is None else uuids[parent],
                    bool(data.get("prefix_break", False)),
                    data.get("render_drift") if isinstance(data.get("render_drift"), bool) else None,
                    turn.turn_id not in view.undelivered, turn.turn_id in view.tree,
                    uuids[view.whole_lineage[turn.turn_id]], view.reasons.get(turn.turn_id),
                )
            )  # fmt: skip
        return turns, rows, view

    @staticmethod
    def _turn(
        episode_id: str, index: int, event: LogRow, own: dict[str, float], whole: dict[str, PackedTurn]
    ) -> PackedTurn:
        """One recorded turn made whole (``whole``: the episode's earlier turns, by id; this one is added),
        or ``Unfoldable`` naming it when its fields or token arrays are not usable."""
        try:
            if event.tokens is None:
                raise ValueError("it has no token arrays")
            prompt, completion, logprobs = token_bytes(event.tokens)
            taken, extends = event.data.get("prefix_tokens", 0), None
            if taken:  # a turn records the prompt ids after its parent's prompt + completion
                parent = whole.get(str(event.data.get("parent_turn_id")))
                if parent is None or not isinstance(taken, int) or not 0 < taken <= parent.length:
                    raise ValueError(
                        f"it takes {taken!r} prompt ids from its parent turn "
                        f"{event.data.get('parent_turn_id')}, not an earlier turn of its episode that long"
                    )
                cut = len(parent.prompt) >> 2
                inherited = (
                    parent.prompt[: 4 * taken]
                    if taken <= cut
                    else parent.prompt + parent.completion[: 4 * (taken - cut)]
                )
                prompt = inherited + prompt
                if taken == parent.length:
                    extends = parent.turn_id
            if len(logprobs) != len(completion):
                raise ValueError(
                    f"it has {len(logprobs) >> 2} logprobs for {len(completion) >> 2} completion tokens"
                )
            # max() finds one above 0 (or +inf); the sum is NaN with a NaN and -inf with a -inf: C loops
            lps = floats(logprobs)
            if lps and not (max(lps) <= 0.0 and -math.inf < sum(lps)):
                raise ValueError("a logprob is not a finite number <= 0")
            data = event.data
            if not isinstance(data["reply"]["finish_reason"], str) or not isinstance(data["engine_id"], str):
                raise ValueError("its finish_reason or engine_id is not a string")
            check_event_fields(event)
            turn_uuid = to_uuid(data["turn_id"])
            turn = PackedTurn(
                turn_id=str(turn_uuid),
                uuid=turn_uuid,
                episode_id=episode_id,
                index=index,
                prompt=prompt,
                completion=completion,
                logprobs=logprobs,
                policy_version=count_of(event, data["policy_version"], "policy_version"),
                reward=own[str(data["turn_id"])],
                extends=extends,
            )
            whole[turn.turn_id] = turn
            return turn
        except UNFOLDABLE as error:
            if isinstance(error, Unfoldable):
                raise
            raise Unfoldable(event, f"{type(error).__name__}: {error}") from None

    # -- groups and batches --

    def _expire_groups(self, row: LogRow) -> None:
        expired = []
        for group in self.pending.values():
            if (row.recorded_at - group.last_time).total_seconds() <= self.config.group_timeout_s:
                break  # ordered by last activity: the rest are younger
            expired.append(group)
        if expired:
            self._make_ready(expired, row)

    def _make_ready(self, groups: Iterable[PendingGroup], row: LogRow) -> None:
        for group in sorted(groups, key=lambda g: g.group_id):
            del self.pending[(group.policy, group.group_id)]
            members = sorted(group.samples, key=lambda s: (s.position, s.sample_id))
            # Group-relative within each slot (a depth of the turn trees, or the k-th sample: see
            # MaterializerConfig.advantage_peers): a turn is not judged against turns facing other requests.
            # With depth, each episode weighs 1 at each depth and a depth holding fewer than two episodes
            # has nothing to compare with.
            weights = tree_peers([(s.episode_id, s.slot) for s in members])[1]
            for slot in sorted({s.slot for s in members}):
                chosen = [i for i, s in enumerate(members) if s.slot == slot]
                peers = [members[i] for i in chosen]
                rewards = [s.reward for s in peers]
                if self.config.advantage == "none":
                    advantages = rewards
                elif self.config.advantage_peers == "slot":
                    advantages = group_advantages(rewards, mode=self.config.advantage)
                elif len({s.episode_id for s in peers}) < 2:
                    advantages = [0.0] * len(peers)
                else:
                    advantages = group_advantages(
                        rewards, mode=self.config.advantage, weights=[weights[i] for i in chosen]
                    )
                for sample, advantage in zip(peers, advantages, strict=True):
                    sample.advantage = advantage
                    self._update_sample(sample, {S_ADVANTAGE: advantage, S_READY: row.position})
            self.queues.setdefault(group.policy, deque()).append(members)
        for policy in sorted({g.policy for g in groups}):
            self._form_batches(policy, row)

    def _form_batches(self, policy: str, row: LogRow) -> None:
        queue = self.queues.get(policy)
        limit_tokens = self.config.batch_tokens
        while queue:
            size = (
                sum(len(g) for g in queue)
                if limit_tokens is None
                else sum(s.tokens for g in queue for s in g)
            )
            if size < (limit_tokens or self.config.batch_samples):
                return
            taken: list[list[ReadySample]] = [queue.popleft()]
            used = self._measure(taken[0])
            while queue and used + self._measure(queue[0]) <= (limit_tokens or self.config.batch_samples):
                used += self._measure(queue[0])
                taken.append(queue.popleft())
            self._emit_batch(policy, taken, row)

    def _measure(self, group: list[ReadySample]) -> int:
        return len(group) if self.config.batch_tokens is None else sum(s.tokens for s in group)

    def _emit_batch(self, policy: str, groups: list[list[ReadySample]], row: LogRow) -> None:
        members = [s for group in groups for s in group]
        batch_id = batch_id_for(self.config_hash, [s.sample_id for s in members])
        newest = self.newest.get(policy, 0)
        bound = None if self.config.max_staleness is None else newest - self.config.max_staleness
        kept: list[ReadySample] = []
        headers: list[dict[str, Any]] = []
        stale_count = 0
        for sample in members:
            stale = bound is not None and sample.policy_version < bound
            stale_count += stale
            self._update_sample(sample, {S_STALE: stale, S_BATCH: batch_id})
            if stale and self.config.stale == "drop":
                continue
            kept.append(sample)
            # the same header as BatchSample.header(); the arrays are already packed (pack_arrays)
            headers.append(
                {
                    "sample_id": sample.sample_id,
                    "episode_id": sample.episode_id,
                    "group_id": sample.group_id,
                    "turn_ids": list(sample.turn_ids),
                    "policy_version": sample.policy_version,
                    "reward": sample.reward,
                    "advantage": sample.advantage if sample.advantage is not None else 0.0,
                    "stale": stale,
                    "tokens": sample.tokens,
                }
            )
        versions = [s.policy_version for s in members]
        payload = (
            encode_packed(batch_id, policy, self.config_hash, newest, headers, [s.arrays for s in kept])
            if kept
            else None
        )
        self.writes.batches.append(
            (
                batch_id, policy, len(kept), len(groups), sum(s.tokens for s in kept), stale_count,
                min(versions), max(versions), newest, self.config_hash, row.position, row.recorded_at,
                len(payload) if payload else None, payload,
            )
        )  # fmt: skip
        if payload:
            self.writes.outbox.append((batch_id, f"batches.{policy}", payload, row.recorded_at))

    def _update_sample(self, sample: ReadySample, changes: dict[int, Any]) -> None:
        inserted = self.writes.samples.get(sample.sample_id)
        if inserted is not None:
            for index, value in changes.items():
                inserted[index] = value
            if S_BATCH in changes:
                inserted[S_ARRAYS] = None  # batched in the step that made it: its payload holds the arrays
        elif S_ADVANTAGE in changes:
            self.writes.ready.append((changes[S_ADVANTAGE], changes[S_READY], sample.key))
        else:
            self.writes.batched.append((changes[S_STALE], changes[S_BATCH], sample.key))


@dataclass(frozen=True)
class Trained:
    """What training makes of an episode's turns (the rule is ``pipeline.materialize.lineages``'s)."""

    whole_tree: dict[str, str | None]
    """Every turn's parent, as recorded (the turns read model)."""
    turns: list[PackedTurn]
    """The trained turns, each with its reward (the episode's added to each lineage's last turn)."""
    tree: dict[str, str | None]
    """The trained tree: untrained, side-call and never-delivered turns taken out."""
    undelivered: set[str]
    """Turns whose reply reached no client (``lineages`` rule 5)."""
    whole_lineage: dict[str, str]
    """Each turn's root in the whole tree."""
    reasons: dict[str, str]
    """Why each root of the whole tree started (``lineages.root_reasons``)."""
    lineage: dict[str, str]
    main: str | None
    values: dict[str, float]
    rewards: dict[str, float]

    @classmethod
    def of(
        cls,
        turns: list[PackedTurn],
        completed: list[LogRow],
        outcome: float | None,
        discount: float,
        *,
        delivered: Collection[str] = (),
        side_calls: str = "skip",
    ) -> Trained:
        """``turns``: the episode's, made from ``completed`` (its ``TurnCompleted`` events, in order);
        ``delivered``: the turns a ``TurnDelivered`` names."""
        whole_tree = packed.parents(turns)
        untrained = {t.turn_id for t, e in zip(turns, completed, strict=True) if e.data.get("train") is False}
        facts = [turn_facts(t, e) for t, e in zip(turns, completed, strict=True)]
        side = side_turns(facts, whole_tree) if side_calls == "skip" else set()
        undelivered = _never_delivered(turns, completed, whole_tree, delivered)
        tree = trained_tree(whole_tree, undelivered | untrained | side)
        lineage = roots(tree)
        kept = [turn for turn in turns if turn.turn_id in tree]
        if outcome is not None:
            targets = set(episode_reward_targets(kept, lineage))
            kept = [t.rewarded(t.reward + outcome) if t.turn_id in targets else t for t in kept]
        values = discounted_rewards(kept, tree, discount)
        rewards = {turn.turn_id: turn.reward for turn in kept}
        reasons = root_reasons(
            facts, whole_tree, side_roots(facts, whole_tree) if side_calls == "skip" else ()
        )
        return cls(
            whole_tree, kept, tree, undelivered, roots(whole_tree), reasons, lineage,
            main_root(kept, lineage), values, rewards,
        )  # fmt: skip


def turn_facts(turn: PackedTurn, event: LogRow) -> TurnFacts:
    """What the lineage rule reads of a turn's event (fields at their defaults are not stored)."""
    data = event.data
    request = data.get("request") or {}
    train = data.get("train")
    model = data.get("model")
    return TurnFacts(
        turn_id=turn.turn_id,
        index=turn.index,
        offers_tools=bool(request.get("tools"))
        or data.get("offers_tools") is True  # the request left in PostgreSQL: records.FOLDED_DATA
        or data.get("tools_from_parent") is True,
        model=model if isinstance(model, str) else None,
        train=train if isinstance(train, bool) else None,
        edited=isinstance(data.get("edit"), dict),
        prefix_break=data.get("prefix_break") is True,
    )


def _never_delivered(
    turns: list[PackedTurn], completed: list[LogRow], tree: dict[str, str | None], delivered: Collection[str]
) -> set[str]:
    """Turns recorded as not delivered (``TurnCompleted.delivered`` False) that no ``TurnDelivered`` names
    and no later turn continues: the agent never saw them, so they are no training samples. A marked turn
    that has a child was seen after all."""
    marked = {t.turn_id for t, e in zip(turns, completed, strict=True) if e.data.get("delivered") is False}
    return marked - set(tree.values()) - set(delivered) if marked else marked


@dataclass(frozen=True)
class TurnLineage:
    """One turn of an episode as the lineage rule sees it (``episode_lineages``)."""

    index: int
    turn_id: str
    parent_turn_id: str | None
    lineage: str
    """The id of the root of its conversation (its lineage) in the whole turn tree."""
    root_reason: str | None
    """On a root: why it started (``lineages.FIRST_CALL`` ... ``lineages.NEW_CONVERSATION``)."""
    trained: bool
    why_not: str | None
    """Why it makes no sample: ``marked`` (train false), ``side call``, ``not delivered``."""
    delivered: bool
    model: str | None
    edit: list[str]
    """What changed, on a turn that sent back an earlier reply changed in substance."""


def episode_lineages(events: list[LogRow], config: MaterializerConfig) -> list[TurnLineage]:
    """Each turn of an episode (its events, ``EpisodeStarted`` first) with its lineage, why that lineage
    started and whether it is trained, by the materializer's own rule (``turnstile episodes --lineages``).
    ``Unfoldable`` when a turn cannot be folded."""
    fold = Fold(config)
    episode_id = str(events[0].data.get("episode_id", ""))
    turns, _, view = fold._turns(episode_id, events)
    completed = [e for e in events if e.type == "TurnCompleted"]
    facts = [turn_facts(t, e) for t, e in zip(turns, completed, strict=True)]
    side = side_turns(facts, view.whole_tree) if config.side_calls == "skip" else set()
    report = []
    for turn, event, fact in zip(turns, completed, facts, strict=True):
        trained = turn.turn_id in view.tree
        why_not = None
        if not trained:
            if fact.train is False:
                why_not = "marked"
            elif turn.turn_id in side:
                why_not = lineages.SIDE_CALL
            else:
                why_not = "not delivered"
        edit = event.data.get("edit")
        changes = edit.get("changes") if isinstance(edit, dict) else None
        report.append(
            TurnLineage(
                index=turn.index,
                turn_id=turn.turn_id,
                parent_turn_id=view.whole_tree[turn.turn_id],
                lineage=view.whole_lineage[turn.turn_id],
                root_reason=view.reasons.get(turn.turn_id),
                trained=trained,
                why_not=why_not,
                delivered=turn.turn_id not in view.undelivered,
                model=fact.model,
                edit=[str(change) for change in changes] if isinstance(changes, list) else [],
            )
        )
    return report
