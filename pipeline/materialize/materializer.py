"""The materializer: folds the log into read models (episodes, turns, samples), training batches and the
batch outbox, exactly once.

Each step reads the next events after the checkpoint (positions are gapless and in commit order, so
``position > checkpoint`` never skips one), folds them, and writes everything it produced, the new
checkpoint included, in ONE transaction: a crash anywhere leaves either all of a step or none of it, and
the restart folds the same events again to the same result. Everything is a deterministic function of
the log and the configuration (no wall clock: group timeouts use the events' own ``recorded_at``), so a
rebuild with the same configuration gives byte-identical batch ids and payloads.

Memory is bounded by what is still open: the events of running episodes, the samples of groups still
waiting for members, and samples not yet in a batch. All of it is also in the read models, so a restart
rebuilds it from the tables.

Events are read as raw rows (JSON data, packed tokens), not validated models: this is the hot loop of a
rebuild over millions of turns, and the log was validated when it was written.
"""

from __future__ import annotations

import asyncio
import contextlib
import copyreg
import hashlib
import heapq
import io
import itertools
import json
import logging
import math
import multiprocessing
import os
import pickle
import re
import resource
import signal
import traceback
import uuid
from array import array
from collections import OrderedDict, deque
from collections.abc import Awaitable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from multiprocessing.connection import Connection
from typing import Any, Final, Literal, NamedTuple

import psycopg
from psycopg import sql

from pipeline.batches.format import BATCHES_CHANNEL, encode_packed
from pipeline.errors import ConfigError
from pipeline.log.store import JsonText, JsonTextBinaryDumper
from pipeline.materialize import lineages, packed
from pipeline.materialize.lineages import episode_reward_targets, main_root, peer_slot, roots, trained_tree
from pipeline.materialize.packed import PackedTurn, floats, token_bytes
from pipeline.materialize.trajectory import depths, discounted_rewards, group_advantages, tree_peers
from pipeline.settings import libpq_url

log = logging.getLogger(__name__)

USABLE: Final = frozenset({"done", "max_turns", "truncated"})
"""Terminations whose episodes become samples; error, timeout, cancelled and aborted ones do not."""
READ_MODEL_TABLES: Final = (
    "episodes", "turn_rows", "sample_rows", "batches", "batch_outbox", "skipped_events",
)  # fmt: skip
"""The tables the materializer writes (``turns`` and ``samples`` are views over ``turn_rows`` and
``sample_rows``: migration 0013)."""
INT4_MAX: Final = 2**31 - 1
_NAME = re.compile(r"^[a-z][a-z0-9_]{0,40}$")
_UUID_TEXT = re.compile(r"[0-9a-fA-F]{8}-(?:[0-9a-fA-F]{4}-){3}[0-9a-fA-F]{12}\Z")
"""A uuid as PostgreSQL's ``::uuid`` and Python's ``uuid.UUID`` both read it (the view ``turns`` casts it)."""
_ON_TABLE = re.compile(r" ON (?:public\.)?(?P<table>[a-z_]+) USING ")


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
        materializers cannot be told apart from those made before the rule existed: rebuild those)."""
        fields = asdict(self)
        del fields["name"], fields["step_events"]
        if fields["advantage_peers"] == "slot":
            del fields["advantage_peers"]
        if lineages.RULE != 1:
            fields["lineage_rule"] = lineages.RULE
        return fields

    def config_hash(self) -> str:
        canonical = json.dumps(self.semantics(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def rebuild_schema(name: str) -> str:
    """The schema of the rebuild ``name`` (``turnstile rematerialize --name``): ``rm_<name>``."""
    return f"rm_{name}"


async def drop_rebuild(database_url: str, name: str) -> None:
    """Drop the rebuild ``name``: its schema, its recorded configuration and its checkpoint."""
    if name == "main":
        raise ConfigError("the live materializer 'main' is not a rebuild; it cannot be replaced")
    connection = await psycopg.AsyncConnection.connect(libpq_url(database_url), autocommit=True)
    async with connection, connection.transaction():
        await connection.execute(
            sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(rebuild_schema(name)))
        )
        await connection.execute("DELETE FROM materializers WHERE name = %s", (name,))
        await connection.execute("DELETE FROM checkpoints WHERE name = %s", (f"materializer:{name}",))


def batch_id_for(config_hash: str, sample_ids: Sequence[str]) -> str:
    digest = hashlib.sha256(config_hash.encode())
    for sample_id in sample_ids:
        digest.update(b"\n" + sample_id.encode())
    return digest.hexdigest()[:32]


@dataclass(frozen=True, slots=True)
class LogRow:
    """An event as the fold reads it."""

    position: int
    stream: str
    type: str
    data: dict[str, Any]
    tokens: bytes | None
    recorded_at: datetime


UNFOLDED_FIELDS: Final = ("request", "task", "sampling", "metrics", "event_id", "schema_version", "type")
"""Fields of ``events.data`` the fold never reads (nor ``reply.text``): ``Materializer._read`` leaves them in
PostgreSQL. A turn's request is most of its data; what is left is a few hundred bytes of JSON."""
_FOLDED_DATA: Final = (
    "(CASE WHEN jsonb_typeof(data) <> 'object' THEN data "
    "WHEN jsonb_typeof(data -> 'reply') = 'object' THEN data - %(unfolded)s::text[] #- '{reply,text}' "
    "ELSE data - %(unfolded)s::text[] END)::text"
)


@dataclass(slots=True)
class ReadySample:
    """A sample waiting for its group, or for a batch."""

    sample_id: str
    episode_id: str
    group_id: str
    policy: str
    turn_ids: tuple[str, ...]
    policy_version: int
    tokens: int
    reward: float
    arrays: bytes
    position: int
    slot: int = 0
    advantage: float | None = None

    @property
    def key(self) -> str:
        """The sample's own turn (its last: a concat sample's leaf), which keys its ``sample_rows`` row."""
        return self.turn_ids[-1]


class NewSample(NamedTuple):
    """A sample as an episode's end makes it (``trajectory.Sample`` less its sequences, arrays packed)."""

    sample_id: str
    turns: tuple[PackedTurn, ...]
    policy_version: int
    reward: float
    tokens: int
    model_tokens: int
    arrays: bytes


class Finished(NamedTuple):
    """What an episode's end gives the group half of the fold (``Fold.take``)."""

    policy: str
    version: int | None
    """The newest policy version of its turns (None: it has none)."""
    group_id: str | None
    """None: it makes no samples (not usable)."""
    size: int
    episode_id: str
    samples: list[tuple[ReadySample, list[Any]]]
    """Its samples, each with its new ``sample_rows`` row."""


class Published(NamedTuple):
    """A ``PolicyVersionPublished`` as the group half takes it."""

    policy: str
    version: int


Outcome = Finished | Published


@dataclass(slots=True)
class PendingGroup:
    policy: str
    group_id: str
    size: int
    last_time: datetime
    episodes: set[str] = field(default_factory=set)
    samples: list[ReadySample] = field(default_factory=list)


@dataclass
class Writes:
    """What one step produced, written in one transaction. Rows are lists so a later event of the same
    step can still change them (an episode that starts and finishes in one step is one INSERT)."""

    episodes: dict[str, list[Any]] = field(default_factory=dict)
    """New episodes rows by stream (not by episode id: two streams that claim one episode id must both reach
    the table, whose primary key refuses the second; see ``Materializer._fold_one_at_a_time``)."""
    finished: list[tuple[Any, ...]] = field(default_factory=list)
    turns: list[tuple[Any, ...]] = field(default_factory=list)
    samples: dict[str, list[Any]] = field(default_factory=dict)
    ready: list[tuple[Any, ...]] = field(default_factory=list)
    batched: list[tuple[Any, ...]] = field(default_factory=list)
    batches: list[tuple[Any, ...]] = field(default_factory=list)
    """``BATCH_COLUMNS`` rows whose last value is the payload itself: the writer hashes it (in its thread:
    hashlib lets go of the GIL while it hashes a payload, so the fold goes on meanwhile)."""
    outbox: list[tuple[Any, ...]] = field(default_factory=list)
    skipped: list[tuple[Any, ...]] = field(default_factory=list)


EPISODE_COLUMNS: Final = (
    "episode_id", "stream", "policy", "agent", "task_id", "group_id", "group_size", "retry_of", "tags",
    "status", "termination", "error", "reward", "turns", "prompt_tokens", "completion_tokens",
    "min_policy_version", "max_policy_version", "started_at", "finished_at", "duration_s",
    "started_position", "finished_position",
)  # fmt: skip
TURN_COLUMNS: Final = (
    "turn_id", "episode", "position", "mean_logprob", "reward", "discounted_return", "turn_index",
    "prompt_tokens", "completion_tokens", "policy_version", "parent_turn_id", "prefix_break", "render_drift",
)  # fmt: skip
"""``turn_rows``: what the fold derives; the view ``turns`` reads the rest from the event at ``position``."""
SAMPLE_COLUMNS: Final = (
    "turn_id", "ready_position", "advantage", "reward", "slot", "policy_version", "tokens", "model_tokens",
    "stale", "path", "batch_id", "turn_ids", "arrays",
)  # fmt: skip
"""``sample_rows``, keyed by the sample's own turn (a concat sample's leaf); a value equal to that turn's is
NULL (the view ``samples`` reads it from the turn), and so are ``turn_ids`` when they are just that turn."""
BATCH_COLUMNS: Final = (
    "batch_id", "policy", "samples", "groups", "tokens", "stale_samples", "min_policy_version",
    "max_policy_version", "newest_version", "config_hash", "position", "created_at", "payload_bytes",
    "payload_sha256",
)  # fmt: skip
FINISHED_COLUMNS: Final = (
    "status", "termination", "error", "reward", "turns", "prompt_tokens", "completion_tokens",
    "min_policy_version", "max_policy_version", "finished_at", "duration_s", "finished_position",
)  # fmt: skip


class CopyColumns(NamedTuple):
    """A table's columns as the materializer COPYs them, and their PostgreSQL types (binary COPY)."""

    names: tuple[str, ...]
    types: tuple[str, ...]


EPISODE_COPY: Final = CopyColumns(EPISODE_COLUMNS, (
    "text", "text", "text", "text", "text", "text", "int4", "text", "jsonb", "text", "text", "text", "float8",
    "int4", "int8", "int8", "int4", "int4", "timestamptz", "timestamptz", "float8", "int8", "int8",
))  # fmt: skip
TURN_COPY: Final = CopyColumns(TURN_COLUMNS, (
    "uuid", "int8", "int8", "float8", "float8", "float8", "int4", "int4", "int4", "int4", "uuid", "bool",
    "bool",
))  # fmt: skip
SAMPLE_COPY: Final = CopyColumns(SAMPLE_COLUMNS, (
    "uuid", "int8", "float8", "float8", "int4", "int4", "int4", "int4", "bool", "bool", "text", "uuid[]",
    "bytea",
))  # fmt: skip
BATCH_COPY: Final = CopyColumns(BATCH_COLUMNS, (
    "text", "text", "int4", "int4", "int8", "int4", "int4", "int4", "int4", "text", "int8", "timestamptz",
    "int4", "bytea",
))  # fmt: skip
OUTBOX_COPY: Final = CopyColumns(
    ("batch_id", "subject", "payload", "created_at"), ("text", "text", "bytea", "timestamptz")
)
SKIPPED_COPY: Final = CopyColumns(
    ("position", "stream", "type", "episode_id", "reason"), ("int8", "text", "text", "text", "text")
)
_FINISHED_INDEXES: Final = tuple(EPISODE_COLUMNS.index(c) for c in FINISHED_COLUMNS)
_S_ADVANTAGE, _S_STALE, _S_READY, _S_BATCH, _S_ARRAYS = (
    SAMPLE_COLUMNS.index(column) for column in ("advantage", "stale", "ready_position", "batch_id", "arrays")
)


class Unfoldable(Exception):
    """A recorded event the fold cannot use (``row``), and why; the fold skips it and goes on."""

    def __init__(self, row: LogRow, reason: str) -> None:
        super().__init__(reason)
        self.row = row
        self.reason = reason


def _culprit(error: BaseException, row: LogRow) -> tuple[LogRow, str]:
    """The event to skip for ``error`` (raised while folding ``row``), and why."""
    if isinstance(error, Unfoldable):
        return error.row, error.reason
    return row, f"{type(error).__name__}: {error}"


UNFOLDABLE: Final = (Unfoldable, KeyError, ValueError, TypeError, IndexError, AttributeError, OverflowError)
"""What reading a malformed event raises (a missing field, a wrong type, torn token arrays): the fold skips
that event, never stops on it. Every event is validated when appended, so this is for what slipped past."""


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
            self.skip(*_culprit(error, row), closing=row)
            return None

    def take(self, outcome: Outcome, row: LogRow) -> None:
        """The group half of ``apply`` for an event whose episode half gave ``outcome``."""
        try:
            if isinstance(outcome, Published):
                self.newest[outcome.policy] = max(self.newest.get(outcome.policy, 0), outcome.version)
                return
            self._take_finished(outcome, row)
        except UNFOLDABLE as error:  # its episode is closed already: only the skip is recorded
            self.skip(*_culprit(error, row), closing=row)

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
        elif row.type in ("TurnCompleted", "RewardAssigned"):
            events = self.open.get(row.stream)
            if events is not None:
                events.append(row)
        elif row.type == "EpisodeFinished":
            return self._finished(row)
        elif row.type == "PolicyVersionPublished":
            return Published(_text(row, "policy"), _count(row, row.data["version"], "version"))
        return None

    def _started(self, row: LogRow) -> None:
        data = row.data
        episode_id = _text(row, "episode_id")
        values = [
            episode_id, row.stream, _text(row, "policy"), _text(row, "agent", ""), _text(row, "task_id", ""),
            _text(row, "group_id", None), _count(row, data.get("group_size", 1), "group_size", least=1),
            _text(row, "retry_of", None), JsonText(json.dumps(data.get("tags", {}), sort_keys=True)),
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
        termination = _text(row, "termination")
        error = _text(row, "error", None)
        rewards = [_reward(e) for e in events if e.type == "RewardAssigned"]
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
            own.uuid, None, None, _unless(ready.reward, values[own.turn_id]), slot,
            _unless(ready.policy_version, own.policy_version), _unless(ready.tokens, own.length),
            _unless(sample.model_tokens, len(own.completion) >> 2), False, path, None,
            packed.turn_ids(sample.turns) if len(sample.turns) > 1 else None, ready.arrays,
        ]  # fmt: skip

    def _record_finished(self, stream: str, episode_id: str, finished: list[Any]) -> None:
        inserted = self.writes.episodes.get(stream)
        if inserted is not None:
            for index, value in zip(_FINISHED_INDEXES, finished, strict=True):
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
        for event in events:
            if event.type == "RewardAssigned":
                target = event.data.get("turn_id")
                if target is None:
                    outcome = _reward(event) + (outcome or 0.0)  # the episode's: see Trained.of
                elif target in own:
                    own[target] += _reward(event)
        whole: dict[str, PackedTurn] = {}
        turns = [self._turn(episode_id, index, event, own, whole) for index, event in enumerate(completed)]
        view = Trained.of(turns, completed, outcome, self.config.discount)
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
            _check_event_fields(event)
            turn_uuid = _uuid(data["turn_id"])
            turn = PackedTurn(
                turn_id=str(turn_uuid),
                uuid=turn_uuid,
                episode_id=episode_id,
                index=index,
                prompt=prompt,
                completion=completion,
                logprobs=logprobs,
                policy_version=_count(event, data["policy_version"], "policy_version"),
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
                    self._update_sample(sample, {_S_ADVANTAGE: advantage, _S_READY: row.position})
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
            self._update_sample(sample, {_S_STALE: stale, _S_BATCH: batch_id})
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
            if _S_BATCH in changes:
                inserted[_S_ARRAYS] = None  # batched in the step that made it: its payload holds the arrays
        elif _S_ADVANTAGE in changes:
            self.writes.ready.append((changes[_S_ADVANTAGE], changes[_S_READY], sample.key))
        else:
            self.writes.batched.append((changes[_S_STALE], changes[_S_BATCH], sample.key))


REFUSED_WRITES: Final = (psycopg.errors.DataError, psycopg.errors.IntegrityError)
"""What the read models answer to a value they cannot hold: out of a column's range, text with NUL, a
duplicate key. The transaction is rolled back; ``Materializer.step`` then finds and skips the event."""


def _first_line(error: BaseException) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


def _check_event_fields(event: LogRow) -> None:
    """The fields the view ``turns`` reads from the event itself (``events.data``) must be what its casts
    take: a turn whose fields would break them is not folded (it never reaches ``turn_rows``)."""
    data = event.data
    recorded_parent = data.get("parent_turn_id")
    if recorded_parent is not None and (
        not isinstance(recorded_parent, str) or _UUID_TEXT.match(recorded_parent) is None
    ):
        raise ValueError(f"its parent_turn_id {recorded_parent!r} is not a uuid")
    timings = data.get("timings", {})
    for name in ("queued_ms", "first_token_ms", "total_ms"):
        value = timings.get(name, 0.0)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"its timings.{name} is {value!r}, not a number")
    tool_calls = data["reply"].get("tool_calls")
    if tool_calls is not None and not isinstance(tool_calls, list):
        raise ValueError(f"its reply.tool_calls is {tool_calls!r}, not a list")
    _text(event, "chat_template", None)


def _unless(value: Any, same: Any) -> Any:
    """``value``, or None where it equals ``same`` (a column the view then reads from elsewhere)."""
    return None if value == same else value


def _uuid(value: Any) -> uuid.UUID:
    return value if isinstance(value, uuid.UUID) else uuid.UUID(str(value))


_REQUIRED: Final = object()


def _text(row: LogRow, name: str, default: Any = _REQUIRED) -> Any:
    """The string field ``name`` of ``row`` (or ``default`` when absent or null), or ``Unfoldable``."""
    value = row.data.get(name)
    if value is None and default is not _REQUIRED:
        return default
    if not isinstance(value, str):
        raise Unfoldable(row, f"its {name} is {value!r}, not a string")
    return value


def _count(row: LogRow, value: Any, name: str, *, least: int = 0) -> int:
    """An integer field that must fit the read models' integer columns, or ``Unfoldable``."""
    if isinstance(value, bool) or not isinstance(value, int) or not least <= value <= INT4_MAX:
        raise Unfoldable(row, f"its {name} is {value!r}, not an integer in [{least}, {INT4_MAX}]")
    return value


def _reward(row: LogRow) -> float:
    value = row.data.get("value")
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise Unfoldable(row, f"its value is {value!r}, not a finite number")
    return float(value)


FOLD_WORKER_BACKLOG: Final = 20_000
"""A ``catch_up`` this many events behind or more runs the fold's episode half in worker processes."""
FOLD_WORKERS: Final = 2
"""Worker processes of such a catch-up, each with half of the episodes."""
FOLD_WORKER_CPUS: Final = 2
"""Cores a machine needs for the workers by default. They cost CPU (the pages cross a pipe: ~40% more
Python than one process), which pays where the workers, this process (groups, batches, the writes) and
PostgreSQL find the cores idle: on two quiet cores a rebuild took 5.7-5.9 s with them and 7.6-7.7 s
without; on two cores busy with other work it did no better than one process (``bench/materialize.py``)."""


@dataclass(slots=True)
class FoldedPage:
    """A page of the log as a worker's episode half folded it (``_episode_worker``)."""

    span: tuple[int, int]
    """The positions it covers: (after, last]."""
    positions: array[int]
    """Each event's position, in log order."""
    micros: array[int]
    """Each event's recorded_at, microseconds since the Unix epoch: the group half's clock."""
    outcomes: list[tuple[int, str, str, Outcome]]
    """The events that gave the group half something: index in ``positions``, stream, type, outcome."""
    writes: Writes
    """The episode half's writes: episodes, finished, turns, skipped."""
    skipped: int
    """Events skipped in this page."""


_UNIX_EPOCH: Final = datetime(1970, 1, 1, tzinfo=UTC)
_MICROSECOND: Final = timedelta(microseconds=1)


def _micros(moment: datetime) -> int:
    return (moment - _UNIX_EPOCH) // _MICROSECOND


def _moment(micros: int) -> datetime:
    """The instant ``micros`` (in UTC: only instants reach the tables and the group timeouts)."""
    return _UNIX_EPOCH + timedelta(microseconds=micros)


def _ready_fields(s: ReadySample) -> tuple[Any, ...]:
    """A ``ReadySample``'s fields in order: what its constructor takes."""
    return (
        s.sample_id, s.episode_id, s.group_id, s.policy, s.turn_ids, s.policy_version, s.tokens, s.reward,
        s.arrays, s.position, s.slot, s.advantage,
    )  # fmt: skip


def _reduce_datetime(value: datetime) -> Any:
    if value.tzinfo is None:
        return value.__reduce_ex__(pickle.HIGHEST_PROTOCOL)
    return _moment, (_micros(value),)


_WIRE: Final = {
    **copyreg.dispatch_table,
    uuid.UUID: lambda value: (uuid.UUID, (None, None, None, None, value.int)),
    datetime: _reduce_datetime,
    JsonText: lambda value: (JsonText, (str(value),)),
    ReadySample: lambda sample: (ReadySample, _ready_fields(sample)),
    Finished: lambda value: (Finished, tuple(value)),
}
"""How the worker's pages cross the pipe: ``uuid.UUID`` by its int, an aware ``datetime`` by its instant, a
``ReadySample`` by its fields in order (pickle's own way restores each through ``__setstate__``, a
``SafeUUID``, a time zone or ``copyreg``: together they cost more than folding the episodes)."""


def _dumps(message: Any) -> memoryview:
    buffer = io.BytesIO()
    pickler = pickle.Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL)
    pickler.dispatch_table = _WIRE
    pickler.dump(message)
    return buffer.getbuffer()


@dataclass(slots=True)
class WorkerDone:
    """The worker reached its target: the episodes still open, for this process to go on with."""

    open: dict[str, list[LogRow]]
    peak_rss_kb: int


_SHARD: Final = "(hashtext(stream) & 2147483647) %% %(shards)s = %(shard)s"
"""The streams of one worker of ``shards`` (an episode's events are all in its stream)."""


def _episode_worker(
    pipe: Connection,
    database_url: str,
    config: MaterializerConfig,
    shard: tuple[int, int],
    position: int,
    target: int,
    open_episodes: dict[str, list[LogRow]],
) -> None:
    """A forked process: the episode half of the fold (``Fold.fold_event``) over the events of the streams
    of ``shard`` (this worker's number, and how many there are) after ``position`` until ``target``, page by
    page, read on its own connection (the next page while one folds). A page is a range of positions, the
    same for every worker; each goes to ``pipe`` as it is folded (a send waits while the page before is still
    unread: at most one page ahead of the parent). Ends with ``WorkerDone``, or the traceback of what
    failed."""
    with contextlib.suppress(ValueError):
        signal.set_wakeup_fd(-1)  # the parent's event loop's, not this process's
    try:
        fold = Fold(config)
        fold.position = position
        number, shards = shard
        params: dict[str, Any] = {"shard": number, "shards": shards}
        where = "position > %(after)s AND position <= %(last)s" + (f" AND {_SHARD}" if shards > 1 else "")
        with (
            psycopg.Connection.connect(database_url, autocommit=True) as connection,
            ThreadPoolExecutor(1) as reader,
        ):
            if shards > 1 and open_episodes:
                mine = connection.execute(
                    f"SELECT stream FROM unnest(%(streams)s::text[]) AS stream WHERE {_SHARD}",
                    {**params, "streams": list(open_episodes)},
                ).fetchall()
                open_episodes = {stream: open_episodes[stream] for (stream,) in mine}
            fold.open = open_episodes

            def read(after: int, last: int) -> list[tuple[Any, ...]]:
                # the rows only: they are parsed by the thread that folds them (one thread at a time holds the
                # GIL, and handing it back and forth costs)
                with connection.cursor(binary=True) as cursor:
                    query = _read_query(where, {**params, "after": after, "last": last}, None)
                    return cursor.execute(*query).fetchall()

            # The first pages are smaller, so that the processes get going sooner: 1/8 of a step, then twice
            # as many each page up to a step.
            size = max(1, config.step_events // 8)
            last = min(target, position + size)
            ahead = reader.submit(read, position, last) if position < target else None
            while ahead is not None:
                raw = ahead.result()
                after, position = position, last
                # the next page is read (PostgreSQL's work; psycopg waits without the GIL) while this folds
                size = min(config.step_events, 2 * size)
                last = min(target, position + size)
                ahead = reader.submit(read, position, last) if position < target else None
                rows = _log_rows(raw)
                skipped = fold.skipped
                outcomes = []
                for index, row in enumerate(rows):
                    outcome = fold.fold_event(row)
                    if outcome is not None:
                        outcomes.append((index, row.stream, row.type, outcome))
                writes, fold.writes = fold.writes, Writes()
                positions = array("q", [row.position for row in rows])
                micros = array("q", [_micros(row.recorded_at) for row in rows])
                page = FoldedPage(
                    (after, position), positions, micros, outcomes, writes, fold.skipped - skipped
                )
                pipe.send_bytes(_dumps(page))
        pipe.send_bytes(_dumps(WorkerDone(fold.open, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)))
    except BaseException:
        with contextlib.suppress(Exception):
            pipe.send_bytes(_dumps(traceback.format_exc()))
    finally:
        pipe.close()


def _receive_bytes(pipes: list[Connection]) -> list[bytes]:
    return [pipe.recv_bytes() for pipe in pipes]


def _read_query(where: str, params: dict[str, Any], limit: int | None) -> tuple[str, dict[str, Any]]:
    query = (
        f"SELECT position, stream, type, {_FOLDED_DATA}, tokens, recorded_at FROM events "
        f"WHERE {where} ORDER BY position"
    )
    if limit is not None:
        query += f" LIMIT {int(limit)}"
    return query, {**params, "unfolded": list(UNFOLDED_FIELDS)}


def _log_rows(rows: Sequence[tuple[Any, ...]]) -> list[LogRow]:
    data = json.loads(f"[{','.join([r[3] for r in rows])}]")
    return [LogRow(r[0], r[1], r[2], d, r[4], r[5]) for r, d in zip(rows, data, strict=True)]


class Materializer:
    """Runs a ``Fold`` on PostgreSQL: ``await m.open()``, then ``step()``, ``catch_up()`` or ``run()``."""

    def __init__(self, database_url: str, config: MaterializerConfig) -> None:
        self.database_url = libpq_url(database_url)
        self.config = config
        self.fold = Fold(config)
        self.steps = 0
        self._connection: psycopg.AsyncConnection[Any] | None = None
        """Reads the log and the tables (autocommit)."""
        self._writer: psycopg.Connection[Any] | None = None
        """Writes each step in one transaction, from a worker thread (``_commit``)."""
        self._indexes_built = False
        self.fold_worker: bool | None = None
        """Run the fold's episode half in worker processes during ``catch_up``: None (the default) when the
        log is at least ``FOLD_WORKER_BACKLOG`` events ahead and the machine has ``FOLD_WORKER_CPUS``."""
        self.fold_workers = FOLD_WORKERS
        """How many: each folds the episodes of its share of the streams."""
        self.worker_peak_rss_kb: int | None = None
        """The last worker's peak resident memory (it starts as a fork of this process: it counts the
        pages it shares with it)."""

    @property
    def position(self) -> int:
        return self.fold.position

    @property
    def skipped(self) -> int:
        """Events this process skipped (see ``Fold.skip``); ``skipped_events`` holds all of them."""
        return self.fold.skipped

    def _table(self, name: str) -> sql.Composed:
        return sql.SQL("{}.{}").format(sql.Identifier(self.config.schema), sql.Identifier(name))

    async def open(self, *, create: bool = False) -> None:
        """Connect, register (or check) the configuration, and load the state from the read models.
        ``create``: make the rebuild schema ``rm_<name>`` (refused when it exists)."""
        # autocommit: each read is its own statement; every write goes in an explicit transaction() block
        self._connection = await psycopg.AsyncConnection.connect(self.database_url, autocommit=True)
        connection = self._connection
        async with connection.transaction():
            await connection.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (self.config.checkpoint,))
            row = await (
                await connection.execute(
                    "SELECT config, config_hash FROM materializers WHERE name = %s", (self.config.name,)
                )
            ).fetchone()
            if row is None:
                if self.config.schema != "public":
                    await self._create_schema(connection, create)
                await connection.execute(
                    "INSERT INTO materializers (name, schema_name, config, config_hash) "
                    "VALUES (%s, %s, %s, %s)",
                    (self.config.name, self.config.schema, json.dumps(self.config.semantics()),
                     self.fold.config_hash),
                )  # fmt: skip
            elif row[1] != self.fold.config_hash:
                older = "advantage_peers" not in row[0] and self.config.advantage_peers != "slot"
                hint = (
                    " It was made before --advantage-peers existed, when samples were compared by slot: "
                    "--advantage-peers slot goes on with it."
                    if older
                    else ""
                )
                raise ConfigError(
                    f"materializer {self.config.name!r} was built with {json.dumps(row[0], sort_keys=True)}; "
                    f"it cannot go on with {json.dumps(self.config.semantics(), sort_keys=True)} (its "
                    "batches would mix two configurations). Rebuild under a new name: "
                    f"turnstile rematerialize --name NEW.{hint}"
                )
            elif create:
                raise ConfigError(
                    f"a rebuild named {self.config.name!r} exists already (schema {self.config.schema}); "
                    "choose another --name, or drop it with --replace"
                )
        await self._load()
        self._writer = await asyncio.to_thread(psycopg.Connection.connect, self.database_url, autocommit=True)

    async def _create_schema(self, connection: psycopg.AsyncConnection[Any], create: bool) -> None:
        if not create:
            raise ConfigError(
                f"no materializer named {self.config.name!r}; build one with `turnstile rematerialize --name "
                f"{self.config.name}`"
            )
        await connection.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(self.config.schema)))
        for table in READ_MODEL_TABLES:
            await connection.execute(
                sql.SQL("CREATE TABLE {} (LIKE public.{} INCLUDING ALL EXCLUDING INDEXES)").format(
                    self._table(table), sql.Identifier(table)
                )
            )
        # Only the unique indexes now (the keys that updates and the views join on); the others are built once
        # the rebuild has caught up (build_deferred_indexes): one sort each instead of an insert per row.
        for _, unique, definition in await self._index_definitions(connection):
            if unique:
                await connection.execute(definition)
        await connection.execute("SELECT turnstile_read_model_views(%s)", (self.config.schema,))

    async def _index_definitions(
        self, connection: psycopg.AsyncConnection[Any]
    ) -> list[tuple[str, bool, str]]:
        """The indexes of the live read models (schema public) as statements for this rebuild's schema:
        (name, unique, CREATE INDEX ...)."""
        rows = await (
            await connection.execute(
                "SELECT i.relname, x.indisunique, pg_get_indexdef(x.indexrelid) FROM pg_index x "
                "JOIN pg_class i ON i.oid = x.indexrelid JOIN pg_class t ON t.oid = x.indrelid "
                "JOIN pg_namespace n ON n.oid = t.relnamespace "
                "WHERE n.nspname = 'public' AND t.relname = ANY(%s) ORDER BY i.relname",
                (list(READ_MODEL_TABLES),),
            )
        ).fetchall()
        target = self.config.schema  # rm_<name>: letters, digits and _ (MaterializerConfig checks the name)
        return [
            (name, unique, _ON_TABLE.sub(rf" ON {target}.\g<table> USING ", definition, count=1))
            for name, unique, definition in rows
        ]

    async def build_deferred_indexes(self) -> int:
        """A rebuild's schema gets the live read models' other indexes once it has caught up (see
        ``_create_schema``); also after a restart, when a rebuild stopped before that. The indexes built."""
        if self.config.schema == "public" or self._indexes_built:
            return 0
        connection = self._require()
        existing = await (
            await connection.execute(
                "SELECT count(*) FROM pg_index x JOIN pg_class t ON t.oid = x.indrelid "
                "JOIN pg_namespace n ON n.oid = t.relnamespace "
                "WHERE n.nspname = %s AND t.relname = ANY(%s) AND NOT x.indisunique",
                (self.config.schema, list(READ_MODEL_TABLES)),
            )
        ).fetchone()
        built = 0
        if existing is not None and existing[0] == 0:  # a rebuild made before this rule has its indexes
            definitions = [d for _, unique, d in await self._index_definitions(connection) if not unique]
            # Two at a time, on this connection and one more: each build is one sort on one core (and two
            # builds on one table take SHARE locks, which do not conflict).
            other = await psycopg.AsyncConnection.connect(self.database_url, autocommit=True)
            async with other:

                async def build(on: psycopg.AsyncConnection[Any], statements: list[str]) -> None:
                    for statement in statements:
                        await on.execute(statement)

                failed = await asyncio.gather(
                    build(connection, definitions[0::2]),
                    build(other, definitions[1::2]),
                    return_exceptions=True,
                )
            for error in failed:
                if isinstance(error, BaseException):
                    raise error
            built = len(definitions)
        self._indexes_built = True
        return built

    async def close(self) -> None:
        if self._connection is not None:
            await self._connection.close()
            self._connection = None
        if self._writer is not None:
            await asyncio.to_thread(self._writer.close)
            self._writer = None

    async def _load(self) -> None:
        connection = self._require()
        fold = self.fold
        row = await (
            await connection.execute(
                "SELECT position FROM checkpoints WHERE name = %s", (self.config.checkpoint,)
            )
        ).fetchone()
        fold.position = int(row[0]) if row else 0
        running = await (
            await connection.execute(
                sql.SQL("SELECT stream FROM {} WHERE status = 'running'").format(self._table("episodes"))
            )
        ).fetchall()
        if running:
            for log_row in await self._read(
                "stream = ANY(%(streams)s) AND position <= %(position)s",
                {"streams": [r[0] for r in running], "position": fold.position},
            ):
                fold.open.setdefault(log_row.stream, []).append(log_row)
        versions = await (
            await connection.execute(
                "SELECT data->>'policy', max((data->>'version')::int) FROM events "
                "WHERE type = 'PolicyVersionPublished' AND position <= %s GROUP BY 1",
                (fold.position,),
            )
        ).fetchall()
        seen = await (
            await connection.execute(
                sql.SQL(
                    "SELECT policy, max(max_policy_version) FROM {} WHERE status = 'finished' GROUP BY 1"
                ).format(self._table("episodes"))
            )
        ).fetchall()
        for policy, version in [*versions, *seen]:
            if version is not None:
                fold.newest[policy] = max(fold.newest.get(policy, 0), int(version))
        await self._load_samples(connection)

    async def _load_samples(self, connection: psycopg.AsyncConnection[Any]) -> None:
        query = sql.SQL(
            "SELECT s.sample_id, s.episode_id, s.group_id, s.policy, s.turn_ids, s.policy_version, s.tokens, "
            "s.reward, s.arrays, s.position, s.advantage, s.ready_position, e.group_size, e.finished_at, "
            "s.slot "
            "FROM {} s JOIN {} e USING (episode_id) WHERE s.batch_id IS NULL "
            "ORDER BY s.ready_position NULLS LAST, s.group_id, s.position, s.sample_id"
        ).format(self._table("samples"), self._table("episodes"))
        rows = await (await connection.execute(query)).fetchall()
        ready: dict[tuple[str, int, str], list[ReadySample]] = {}
        pending: list[tuple[datetime, str, PendingGroup]] = []
        groups: dict[tuple[str, str], PendingGroup] = {}
        for r in rows:
            sample = ReadySample(
                sample_id=r[0], episode_id=r[1], group_id=r[2], policy=r[3],
                turn_ids=tuple(str(t) for t in r[4]), policy_version=r[5], tokens=r[6], reward=r[7],
                arrays=bytes(r[8]), position=r[9], advantage=r[10], slot=r[14],
            )  # fmt: skip
            if r[11] is not None:
                ready.setdefault((r[3], r[11], r[2]), []).append(sample)
                continue
            size = int(r[12]) if r[2] != r[1] else 1
            group = groups.get((r[3], r[2]))
            if group is None:
                group = groups[(r[3], r[2])] = PendingGroup(r[3], r[2], size, r[13])
                pending.append((r[13], r[2], group))
            group.last_time = max(group.last_time, r[13])
            group.episodes.add(r[1])
            group.samples.append(sample)
        for (policy, _, _), members in sorted(ready.items(), key=lambda item: (item[0][1], item[0][2])):
            self.fold.queues.setdefault(policy, deque()).append(members)
        for _, _, group in sorted(
            pending, key=lambda item: (max(s.position for s in item[2].samples), item[1])
        ):
            self.fold.pending[(group.policy, group.group_id)] = group

    def _require(self) -> psycopg.AsyncConnection[Any]:
        if self._connection is None:
            raise ConfigError("the materializer is not open: call open() first")
        return self._connection

    def _require_writer(self) -> psycopg.Connection[Any]:
        if self._writer is None:
            raise ConfigError("the materializer is not open: call open() first")
        return self._writer

    async def _read(self, where: str, params: dict[str, Any], limit: int | None = None) -> list[LogRow]:
        """The events ``where`` selects, in log order. Only what the fold reads of ``data`` comes (see
        ``UNFOLDED_FIELDS``), in binary (token arrays as bytes, not hex), and a page's JSON is parsed in one
        call: reading the log was a third of a rebuild's Python."""
        cursor = self._require().cursor(binary=True)
        rows = await (await cursor.execute(*_read_query(where, params, limit))).fetchall()
        return _log_rows(rows)

    def _read_after(self, connection: psycopg.Connection[Any], position: int) -> list[tuple[Any, ...]]:
        """``_read``'s next page after ``position``, on ``connection``, unparsed (blocking: ``catch_up``'s
        prefetch runs it in a worker thread, and the rows are parsed by the thread that folds them)."""
        with connection.cursor(binary=True) as cursor:
            return cursor.execute(
                *_read_query("position > %(position)s", {"position": position}, self.config.step_events)
            ).fetchall()

    async def step(self) -> int:
        """Fold the next events after the checkpoint and commit what they produced; the events folded."""
        rows = await self._read(
            "position > %(position)s", {"position": self.fold.position}, self.config.step_events
        )
        if not rows:
            return 0
        skipped, writes = self._fold(rows)
        await self._settle(self._commit(writes, self.fold.position), rows, skipped)
        return len(rows)

    def _fold(self, rows: list[LogRow]) -> tuple[int, Writes]:
        """Fold ``rows``; the skips counted before them, and what they produced."""
        skipped = self.fold.skipped
        for row in rows:
            self.fold.apply(row)
        writes, self.fold.writes = self.fold.writes, Writes()
        return skipped, writes

    async def _settle(
        self, commit: Awaitable[None], rows: list[LogRow] | tuple[int, int], skipped: int
    ) -> bool:
        """Wait for the commit of the step that folded ``rows`` (or the events in (after, last], which a
        worker folded). When the read models refused it, go back to the checkpoint and commit the step's
        events one at a time, skipping the culprit; False then."""
        try:
            await commit
            return True
        except REFUSED_WRITES as error:
            after = rows[0] if isinstance(rows, tuple) else rows[0].position - 1
            log.warning(
                "materializer %s: the read models refused the step after position %d (%s); folding its "
                "events one at a time to find the one to skip",
                self.config.name, after, _first_line(error),
            )  # fmt: skip
            await self._reload(skipped)
            if isinstance(rows, tuple):
                rows = await self._read(
                    "position > %(after)s AND position <= %(last)s", {"after": after, "last": rows[1]}
                )
            await self._fold_one_at_a_time(rows)
            return False

    async def _fold_one_at_a_time(self, rows: list[LogRow]) -> None:
        """The safety net behind the fold's own checks: a value the tables cannot hold (out of an integer
        column's range, a duplicate key) made a step's transaction fail. Back to the checkpoint, commit the
        step's events one by one; the one whose commit fails again is skipped (recorded with the database's
        reason) and the rest go on."""
        for row in rows:
            if row.position <= self.fold.position:
                continue
            skipped = self.fold.skipped
            self.fold.apply(row)
            writes, self.fold.writes = self.fold.writes, Writes()
            try:
                await self._commit(writes, row.position)
            except REFUSED_WRITES as error:
                await self._reload(skipped)
                self.fold.position = row.position
                self.fold.skip(row, f"the read models refused it: {_first_line(error)}")
                writes, self.fold.writes = self.fold.writes, Writes()
                await self._commit(writes, row.position)

    async def _reload(self, skipped: int) -> None:
        """Forget the in-memory state and load it again from the tables as of the checkpoint."""
        self.fold = Fold(self.config)
        self.fold.skipped = skipped
        await self._load()

    async def _commit(self, writes: Writes, position: int) -> None:
        """Write one step's output and its checkpoint, on the writer connection in a worker thread (see
        ``catch_up``: the next step is read and folded meanwhile)."""
        await asyncio.to_thread(self._commit_now, writes, position)
        self.fold.position = max(self.fold.position, position)
        self.steps += 1

    def _commit_now(self, writes: Writes, position: int) -> None:
        # One transaction: the read models, the batches, the outbox and the checkpoint commit together.
        connection = self._require_writer()
        with connection.transaction():
            self._write(connection, writes)
            connection.execute(
                "INSERT INTO checkpoints (name, position) VALUES (%s, %s) ON CONFLICT (name) DO UPDATE "
                "SET position = excluded.position, updated_at = now()",
                (self.config.checkpoint, position),
            )
            if writes.outbox:
                connection.execute(sql.SQL("NOTIFY {}").format(sql.Identifier(BATCHES_CHANNEL)))

    def _copy(
        self,
        connection: psycopg.Connection[Any],
        table: str,
        columns: CopyColumns,
        rows: Iterable[Sequence[Any]],
    ) -> None:
        """Binary COPY: PostgreSQL takes the values as they are stored, without parsing text."""
        statement = sql.SQL("COPY {} ({}) FROM STDIN (FORMAT BINARY)").format(
            self._table(table), sql.SQL(", ").join(map(sql.Identifier, columns.names))
        )
        with connection.cursor() as cursor:
            cursor.adapters.register_dumper(JsonText, JsonTextBinaryDumper)
            with cursor.copy(statement) as out:
                out.set_types(list(columns.types))
                for row in rows:
                    out.write_row(row)

    def _write(self, connection: psycopg.Connection[Any], writes: Writes) -> None:
        if writes.episodes:
            self._copy(connection, "episodes", EPISODE_COPY, writes.episodes.values())
        if writes.turns:
            self._copy(connection, "turn_rows", TURN_COPY, writes.turns)
        if writes.samples:
            self._copy(connection, "sample_rows", SAMPLE_COPY, writes.samples.values())
        if writes.finished:
            self._update(connection, "episodes", "episode_id", FINISHED_COLUMNS, writes.finished)
        if writes.ready or writes.batched:
            # one table for both kinds: a sample made ready and batched in this step has both changes
            merged: dict[str, list[Any]] = {}
            for advantage, ready_position, key in writes.ready:
                merged.setdefault(key, [None, None, None, None])[0:2] = [advantage, ready_position]
            for stale, batch_id, key in writes.batched:
                merged.setdefault(key, [None, None, None, None])[2:4] = [stale, batch_id]
            # A batched sample's arrays live in its batch's payload (and in the log): the row keeps the rest,
            # in the same UPDATE. (Samples batched in the step that made them were written without them.)
            self._update(
                connection,
                "sample_rows",
                "turn_id",
                ("advantage", "ready_position", "stale", "batch_id"),
                [(*values, key) for key, values in merged.items()],
                also=sql.SQL("arrays = CASE WHEN c.batch_id IS NULL THEN t.arrays END"),
            )
        if writes.batches:
            hashed = [
                (*row[:-1], hashlib.sha256(row[-1]).digest() if row[-1] else None) for row in writes.batches
            ]
            self._copy(connection, "batches", BATCH_COPY, hashed)
        if writes.outbox:
            self._copy(connection, "batch_outbox", OUTBOX_COPY, writes.outbox)
        if writes.skipped:
            self._copy(connection, "skipped_events", SKIPPED_COPY, writes.skipped)

    def _update(
        self,
        connection: psycopg.Connection[Any],
        table: str,
        key: str,
        columns: Sequence[str],
        rows: list[tuple[Any, ...]],
        also: sql.Composable | None = None,
    ) -> None:
        """Rows inserted by earlier steps change through one set-based UPDATE per table: the changes are
        COPYed into a temporary table (dropped at commit) and joined, instead of one UPDATE per row. A NULL
        in a change means "unchanged" (coalesce): no change ever sets a column back to NULL."""
        changes = sql.Identifier(f"changed_{table}")
        connection.execute(
            sql.SQL("CREATE TEMP TABLE {} ON COMMIT DROP AS SELECT {} FROM {} LIMIT 0").format(
                changes, sql.SQL(", ").join(map(sql.Identifier, [*columns, key])), self._table(table)
            )
        )
        with connection.cursor() as cursor, cursor.copy(sql.SQL("COPY {} FROM STDIN").format(changes)) as out:
            for row in rows:
                out.write_row(row)
        assignments = sql.SQL(", ").join(
            [
                *(
                    sql.SQL("{} = coalesce(c.{}, t.{})").format(
                        sql.Identifier(c), sql.Identifier(c), sql.Identifier(c)
                    )
                    for c in columns
                ),
                *([also] if also is not None else []),
            ]
        )
        connection.execute(
            sql.SQL("UPDATE {} t SET {} FROM {} c WHERE t.{} = c.{}").format(
                self._table(table), assignments, changes, sql.Identifier(key), sql.Identifier(key)
            )
        )

    async def head(self) -> int:
        connection = self._require()
        row = await (await connection.execute("SELECT coalesce(max(position), 0) FROM events")).fetchone()
        return int(row[0]) if row else 0

    async def catch_up(self) -> int:
        """Fold until the checkpoint reaches the head of the log as it was when called; events folded. Far
        behind (``fold_worker``), the episode half of the fold runs in worker processes."""
        target, total = await self.head(), 0
        while True:
            if self._wants_worker(target):
                done, folded = await self._catch_up_with_workers(target)
            else:
                done, folded = await self._catch_up_here(target)
            total += folded
            if done:
                break
        await self.build_deferred_indexes()
        return total

    def _wants_worker(self, target: int) -> bool:
        if self.fold_worker is None:
            wanted = (
                target - self.fold.position >= FOLD_WORKER_BACKLOG
                and (os.cpu_count() or 1) >= FOLD_WORKER_CPUS
            )
        else:
            wanted = self.fold_worker and self.fold.position < target
        return wanted and "fork" in multiprocessing.get_all_start_methods()

    async def _catch_up_here(self, target: int) -> tuple[bool, int]:
        """``catch_up`` in this process; (True, events folded), or (False, ...) after a refused step (the
        caller goes on from the checkpoint)."""
        # Pipelined: each step is read and folded while the step before it commits (on the writer connection,
        # in a worker thread), so PostgreSQL's work on the writes overlaps the fold; and the page after a step
        # is read (on a reader connection, in another worker thread) while that step folds. Commits still go
        # one at a time and in order, each with its checkpoint; at most two steps' output and one page read
        # ahead are in memory. When a commit is refused, the step folded meanwhile was folded on a state that
        # is gone: it is read again, and the page read ahead of it is dropped.
        total = 0
        pending: tuple[asyncio.Future[None], list[LogRow], int] | None = None
        reader: psycopg.Connection[Any] = await asyncio.to_thread(
            psycopg.Connection.connect, self.database_url, autocommit=True
        )
        ahead: tuple[int, asyncio.Future[list[tuple[Any, ...]]]] | None = None
        loop = asyncio.get_running_loop()
        try:
            while True:
                rows: list[LogRow] = []
                if self.fold.position < target:
                    if ahead is not None and ahead[0] == self.fold.position:
                        rows = _log_rows(await ahead[1])
                    else:
                        if ahead is not None:
                            await ahead[1]  # read after a position the fold went back from: dropped
                        rows = await self._read(
                            "position > %(position)s",
                            {"position": self.fold.position},
                            self.config.step_events,
                        )
                    ahead = None
                    if rows and rows[-1].position < target:
                        # submitted now, not when the event loop next runs: it reads while this step folds
                        after = rows[-1].position
                        ahead = (after, loop.run_in_executor(None, self._read_after, reader, after))
                folded = self._fold(rows) if rows else None
                if pending is not None:
                    committed, pending = await self._settle(*pending), None
                    if not committed:
                        return False, total
                if folded is None:
                    break
                skipped, writes = folded
                pending = (asyncio.ensure_future(self._commit(writes, self.fold.position)), rows, skipped)
                await asyncio.sleep(0)  # the commit's thread starts now, not after the next page has folded
                total += len(rows)
        finally:
            if ahead is not None:
                with contextlib.suppress(Exception):
                    await ahead[1]
            if pending is not None:  # something failed while a commit was in flight: let it finish first
                with contextlib.suppress(Exception):
                    await pending[0]
            await asyncio.to_thread(reader.close)
        return True, total

    async def _catch_up_with_workers(self, target: int) -> tuple[bool, int]:
        """``_catch_up_here`` with the fold's episode half in forked worker processes (``_episode_worker``),
        ``fold_workers`` of them, each with its share of the streams: each reads the log itself and sends
        each page folded; this process folds the group half of each page, its workers' events merged in log
        order (``_take_pages``), and commits it, pipelined as ``_catch_up_here`` does. The workers hold the
        open episodes meanwhile, and hand them back when they are done. After a refused step the workers are
        stopped (they are ahead, on a state that is gone)."""
        loop = asyncio.get_running_loop()
        context = multiprocessing.get_context("fork")  # nothing to import or pickle at start
        handed, self.fold.open = self.fold.open, {}
        shards = max(1, self.fold_workers)
        pipes: list[Connection] = []
        workers: list[multiprocessing.process.BaseProcess] = []
        for number in range(shards):
            ours, theirs = context.Pipe(duplex=False)
            worker = context.Process(
                target=_episode_worker,
                args=(
                    theirs,
                    self.database_url,
                    self.config,
                    (number, shards),
                    self.fold.position,
                    target,
                    handed,
                ),
                name=f"materializer-{self.config.name}-episodes-{number}",
                daemon=True,
            )
            worker.start()
            theirs.close()
            pipes.append(ours)
            workers.append(worker)

        total = 0
        pending: tuple[asyncio.Future[None], tuple[int, int], int] | None = None
        # The pages' bytes arrive in a thread (without the GIL); they are unpickled here, by the thread that
        # folds them.
        incoming: asyncio.Future[list[bytes]] | None = loop.run_in_executor(None, _receive_bytes, pipes)
        try:
            while True:
                assert incoming is not None
                messages, incoming = [pickle.loads(data) for data in await incoming], None
                page: tuple[Writes, tuple[int, int], int, int] | None = None
                failed = [message for message in messages if isinstance(message, str)]
                if failed:
                    raise RuntimeError(f"the materializer's episode worker failed:\n{failed[0]}")
                if all(isinstance(message, FoldedPage) for message in messages):
                    incoming = loop.run_in_executor(None, _receive_bytes, pipes)  # the next, while these fold
                    after, skipped = self.fold.position, self.fold.skipped
                    events = sum(len(message.positions) for message in messages)
                    page = (self._take_pages(messages), (after, self.fold.position), skipped, events)
                elif all(isinstance(message, WorkerDone) for message in messages):
                    self.fold.open = {stream: e for message in messages for stream, e in message.open.items()}
                    self.worker_peak_rss_kb = max(message.peak_rss_kb for message in messages)
                else:
                    raise RuntimeError("the materializer's episode workers fell out of step")
                if pending is not None:
                    committed, pending = await self._settle(*pending), None
                    if not committed:
                        return False, total
                if page is None:
                    return True, total
                writes, span, skipped, events = page
                pending = (asyncio.ensure_future(self._commit(writes, span[1])), span, skipped)
                await asyncio.sleep(0)  # the commit's thread starts now, not after the next page has folded
                total += events
        finally:
            if pending is not None:  # something failed while a commit was in flight: let it finish first
                with contextlib.suppress(Exception):
                    await pending[0]
            for process in workers:
                if process.is_alive():
                    process.terminate()
            for process in workers:
                await asyncio.to_thread(process.join)
            if incoming is not None:  # their pipes are closed now: it ends
                with contextlib.suppress(BaseException):
                    await incoming
            for pipe in pipes:
                pipe.close()

    def _take_pages(self, pages: list[FoldedPage]) -> Writes:
        """The group half of the fold over one page of each worker (the same positions), their events in
        log order; the step's writes, both halves'."""
        if len({page.span for page in pages}) != 1:
            raise RuntimeError(f"the episode workers sent different pages: {[page.span for page in pages]}")
        fold = self.fold
        pending, timeout = fold.pending, self.config.group_timeout_s
        outcomes = [iter(page.outcomes) for page in pages]
        upcoming = [next(each, None) for each in outcomes]
        shares = [
            zip(p.positions, p.micros, itertools.repeat(n), itertools.count()) for n, p in enumerate(pages)
        ]
        for position, micros, shard, index in heapq.merge(*shares) if len(shares) > 1 else shares[0]:
            fold.position = position
            next_outcome = upcoming[shard]
            if next_outcome is not None and next_outcome[0] == index:
                _, stream, kind, outcome = next_outcome
                row = LogRow(position, stream, kind, {}, None, _moment(micros))
                fold._expire_groups(row)
                fold.take(outcome, row)
                upcoming[shard] = next(outcomes[shard], None)
            elif pending:
                # _expire_groups' own test on the oldest group, in integers: most events expire nothing
                oldest = next(iter(pending.values()))
                if (micros - _micros(oldest.last_time)) / 10**6 > timeout:
                    fold._expire_groups(LogRow(position, "", "", {}, None, _moment(micros)))
        fold.skipped += sum(page.skipped for page in pages)
        writes, fold.writes = fold.writes, Writes()
        for page in pages:
            theirs = page.writes
            writes.episodes.update(theirs.episodes)
            writes.finished += theirs.finished
            writes.turns += theirs.turns
        writes.skipped = [row for page in pages for row in page.writes.skipped] + writes.skipped
        return writes

    async def run(self, stop: asyncio.Event, *, poll_interval: float = 5.0) -> None:
        """Fold new events as they are appended (woken by the log's NOTIFY) until ``stop`` is set."""
        listener = await psycopg.AsyncConnection.connect(self.database_url, autocommit=True)
        try:
            await listener.execute("LISTEN turnstile_events")
            while not stop.is_set():
                if await self.step():
                    continue
                await self.build_deferred_indexes()  # caught up: a rebuild's other indexes, once
                with contextlib.suppress(TimeoutError):
                    async for _ in listener.notifies(timeout=poll_interval, stop_after=1):
                        pass
        finally:
            await listener.close()


@dataclass(frozen=True)
class Trained:
    """What training makes of an episode's turns (the rule is ``pipeline.materialize.lineages``'s)."""

    whole_tree: dict[str, str | None]
    """Every turn's parent, as recorded (the turns read model)."""
    turns: list[PackedTurn]
    """The trained turns, each with its reward (the episode's added to each lineage's last turn)."""
    tree: dict[str, str | None]
    """The trained tree: untrained and never-delivered turns taken out."""
    lineage: dict[str, str]
    main: str | None
    values: dict[str, float]
    rewards: dict[str, float]

    @classmethod
    def of(
        cls, turns: list[PackedTurn], completed: list[LogRow], outcome: float | None, discount: float
    ) -> Trained:
        """``turns``: the episode's, made from ``completed`` (its ``TurnCompleted`` events, in order)."""
        whole_tree = packed.parents(turns)
        untrained = {t.turn_id for t, e in zip(turns, completed, strict=True) if e.data.get("train") is False}
        tree = trained_tree(whole_tree, _never_delivered(turns, completed, whole_tree) | untrained)
        lineage = roots(tree)
        kept = [turn for turn in turns if turn.turn_id in tree]
        if outcome is not None:
            targets = set(episode_reward_targets(kept, lineage))
            kept = [t.rewarded(t.reward + outcome) if t.turn_id in targets else t for t in kept]
        values = discounted_rewards(kept, tree, discount)
        rewards = {turn.turn_id: turn.reward for turn in kept}
        return cls(whole_tree, kept, tree, lineage, main_root(kept, lineage), values, rewards)


def _never_delivered(
    turns: list[PackedTurn], completed: list[LogRow], tree: dict[str, str | None]
) -> set[str]:
    """Turns recorded as never delivered (``TurnCompleted.delivered`` False: the client disconnected) that
    no later turn continues: the agent never saw them, so they are no training samples. A marked turn that
    has a child was seen after all (a retry was answered with it)."""
    marked = {t.turn_id for t, e in zip(turns, completed, strict=True) if e.data.get("delivered") is False}
    return marked - set(tree.values()) if marked else marked
