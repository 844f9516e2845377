"""Runners: many episodes of one agent at once, over tasks from a file or the ``TASKS`` work queue.

Each task runs as a group of ``group_size`` episodes (GRPO-style groups share a ``group_id``). Slot ``k``
of a group is retried after an ``error`` up to ``retries`` times, each attempt a new episode linked to the
failed one (``retry_of``). Episode ids are derived from (group, slot, attempt), so a runner that takes over
a task from a dead runner finds what was already recorded: finished episodes count as they are, episodes
left open are closed ``aborted`` and run again.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from pipeline.episodes import (
    Agent,
    EpisodeOutcome,
    EpisodeSession,
    RewardFunction,
    episode_stream,
    run_episode,
    slot_episode_id,
)
from pipeline.errors import ConfigError, WrongExpectedVersion
from pipeline.inference import LLMClient
from pipeline.log import Store
from schemas import EpisodeFinished, Event, SamplingParams, new_uuid

log = logging.getLogger(__name__)

FAILED = frozenset({"error", "timeout"})
RUNNER_STOPPED = frozenset({"aborted", "cancelled"})


@dataclass(frozen=True, slots=True)
class TaskSpec:
    task: dict[str, Any]
    task_id: str
    line: int = 0


@dataclass(frozen=True, slots=True)
class TaskLineError:
    line: int
    message: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.message}"


def read_tasks(path: Path) -> Iterator[TaskSpec | TaskLineError]:
    """One task per line of a JSONL file: a JSON object (its ``id`` or ``task_id`` names it). Blank lines
    are skipped; a line that is not a JSON object yields a TaskLineError and the next line goes on."""
    try:
        handle = path.open(encoding="utf-8")
    except OSError as error:
        raise ConfigError(f"cannot read the task file {str(path)!r}: {error.strerror}") from None
    with handle:
        for number, text in enumerate(handle, start=1):
            if not text.strip():
                continue
            try:
                task = json.loads(text)
            except json.JSONDecodeError as error:
                yield TaskLineError(
                    number, f"not JSON ({error.msg} at column {error.colno}); fix or remove it"
                )
                continue
            if not isinstance(task, dict):
                yield TaskLineError(number, f"a task is a JSON object, got {type(task).__name__}")
                continue
            task_id = task.get("task_id", task.get("id", f"{path.stem}:{number}"))
            yield TaskSpec(task=task, task_id=str(task_id), line=number)


@dataclass
class RunStats:
    """Live counters for progress displays."""

    started_at: float = field(default_factory=time.monotonic)
    running: int = 0
    done: int = 0
    failed: int = 0
    retried: int = 0
    cancelled: int = 0
    turns: int = 0
    rewards: int = 0
    reward_sum: float = 0.0
    # the sum split by sign, each a total that never falls (what a Prometheus counter must be)
    reward_gained: float = 0.0
    reward_lost: float = 0.0
    task_errors: int = 0
    # failed episodes by cause: the last line of the error ("ExceptionType: message")
    causes: Counter[str] = field(default_factory=Counter)

    @property
    def mean_reward(self) -> float | None:
        return self.reward_sum / self.rewards if self.rewards else None

    @property
    def turns_per_second(self) -> float:
        return self.turns / max(time.monotonic() - self.started_at, 1e-9)

    def count(self, outcome: EpisodeOutcome) -> None:
        self.turns += outcome.turns
        if outcome.termination == "cancelled":
            self.cancelled += 1
        elif outcome.termination in FAILED:
            self.failed += 1
            cause = failure_cause(outcome.error)
            self.causes[cause] += 1
            if self.causes[cause] == 1:  # the first of its kind is logged; later ones are only counted
                kind = "infrastructure" if is_infrastructure_failure(cause) else "agent"
                log.warning("episode %s failed (%s): %s", outcome.episode_id, kind, cause)
        else:
            self.done += 1
        if outcome.reward is not None:
            self.rewards += 1
            self.reward_sum += outcome.reward
            if outcome.reward >= 0:
                self.reward_gained += outcome.reward
            else:
                self.reward_lost -= outcome.reward


# Failures that are not the agent's: no agent change fixes them, so a run that meets them exits non-zero.
INFRASTRUCTURE_FAILURES: Final = frozenset(
    {"NoInferenceConsumer", "InferenceTimeout", "InferenceError", "StoreUnavailable", "ConnectionError"}
)


def failure_cause(error: str | None) -> str:
    """The cause of a failed episode in one line: the last line of its traceback, at most 300 characters."""
    lines = [line for line in (error or "").splitlines() if line.strip()]
    return (lines[-1].strip() if lines else "no error recorded")[:300]


def is_infrastructure_failure(cause: str) -> bool:
    name = cause.partition(":")[0].rsplit(".", 1)[-1]
    return name in INFRASTRUCTURE_FAILURES


@dataclass(frozen=True)
class RunnerConfig:
    policy: str
    agent_name: str
    group_size: int = 1
    concurrency: int = 64
    max_turns: int | None = None
    retries: int = 1
    timeout: float | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    tags: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.group_size < 1:
            raise ConfigError(f"--group-size must be at least 1, got {self.group_size}")
        if self.concurrency < 1:
            raise ConfigError(f"--concurrency must be at least 1, got {self.concurrency}")
        if self.retries < 0:
            raise ConfigError(f"--retries must be 0 or more, got {self.retries}")
        if self.max_turns is not None and self.max_turns < 1:
            raise ConfigError(f"--max-turns must be at least 1, got {self.max_turns}")


class Runner:
    """Runs task groups with at most ``config.concurrency`` episodes in flight."""

    def __init__(
        self,
        agent: Agent,
        *,
        store: Store,
        llm: LLMClient,
        config: RunnerConfig,
        reward_fn: RewardFunction | None = None,
        runner_id: str | None = None,
        stats: RunStats | None = None,
        pace: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.agent = agent
        self.store = store
        self.llm = llm
        self.config = config
        self.reward_fn = reward_fn
        self.runner_id = runner_id
        self.stats = stats or RunStats()
        self.pace = pace
        """Awaited before each new group (``pipeline.training.TrainerBacklog``: paced to the learner)."""
        self._slots = asyncio.Semaphore(config.concurrency)
        self.open_episodes: set[str] = set()
        """Episodes started and not yet counted: when the run is cancelled, those it recorded cancelled
        (``count_cancelled``)."""

    async def run_group(
        self,
        spec: TaskSpec,
        group_id: str | None = None,
        group_size: int | None = None,
        *,
        resume: bool = False,
    ) -> list[EpisodeOutcome]:
        """Every slot of the group, to its last attempt. ``resume``: take over from an earlier runner."""
        group = group_id or new_uuid().hex
        size = group_size or self.config.group_size
        if size == 1:
            return [await self._run_slot(spec, group, 0, resume, size)]  # no gather: a task less an episode
        return list(
            await asyncio.gather(*(self._run_slot(spec, group, slot, resume, size) for slot in range(size)))
        )

    async def _run_slot(
        self, spec: TaskSpec, group_id: str, slot: int, resume: bool, size: int
    ) -> EpisodeOutcome:
        attempt, retries_left, retry_of = 0, self.config.retries, None
        if resume:
            while True:
                recorded = await self._recorded_attempt(group_id, slot, attempt)
                if recorded is None:
                    break
                if recorded.termination in RUNNER_STOPPED:
                    pass  # the runner stopped, not the agent: the attempt does not use up a retry
                elif recorded.termination not in FAILED or retries_left == 0:
                    self.stats.count(recorded)
                    return recorded
                else:
                    retries_left -= 1
                retry_of, attempt = recorded.episode_id, attempt + 1
        while True:
            session = EpisodeSession(
                self.store,
                self.llm,
                policy=self.config.policy,
                task=spec.task,
                task_id=spec.task_id,
                agent=self.config.agent_name,
                episode_id=slot_episode_id(group_id, slot, attempt),
                group_id=group_id,
                group_size=size,
                sampling=self.config.sampling,
                tags=self.config.tags,
                retry_of=retry_of,
                max_turns=self.config.max_turns,
                runner_id=self.runner_id,
            )
            async with self._slots:
                self.stats.running += 1
                self.open_episodes.add(session.episode_id)
                try:
                    outcome = await run_episode(
                        self.agent, session, reward_fn=self.reward_fn, timeout=self.config.timeout
                    )
                finally:
                    self.stats.running -= 1
                self.open_episodes.discard(session.episode_id)  # kept if cancelled: count_cancelled reads it
            if outcome.termination not in FAILED or retries_left == 0:
                self.stats.count(outcome)
                return outcome
            self.stats.retried += 1
            self.stats.turns += outcome.turns
            retries_left -= 1
            retry_of, attempt = outcome.episode_id, attempt + 1

    async def count_cancelled(self) -> int:
        """After a cancelled run: count in ``stats.cancelled`` the episodes open at the cancel that the log
        holds as ``cancelled`` (each cancelled episode ends with a CancelledError, never with an outcome, so
        only the log knows), and forget them. The number counted."""
        counted = 0
        for episode_id in sorted(self.open_episodes):
            recorded = await self.store.read_stream(episode_stream(episode_id))
            ends = [r.event for r in recorded if isinstance(r.event, EpisodeFinished)]
            if ends and ends[-1].termination == "cancelled":
                counted += 1
        self.stats.cancelled += counted
        self.open_episodes.clear()
        return counted

    async def _recorded_attempt(self, group_id: str, slot: int, attempt: int) -> EpisodeOutcome | None:
        """What an earlier runner recorded for this attempt; an open episode is closed ``aborted`` first."""
        episode_id = slot_episode_id(group_id, slot, attempt)
        recorded = await self.store.read_stream(episode_stream(episode_id))
        events: list[Event] = [r.event for r in recorded if r.event is not None]
        if not events:
            return None
        if not any(isinstance(event, EpisodeFinished) for event in events):
            aborted = EpisodeFinished(termination="aborted", error="its runner stopped before it finished")
            try:
                await self.store.append(episode_stream(episode_id), [aborted], recorded[-1].version)
            except WrongExpectedVersion:
                return await self._recorded_attempt(group_id, slot, attempt)
            events.append(aborted)
        return EpisodeOutcome.of_events(events)


async def run_tasks(
    runner: Runner,
    tasks: Iterator[TaskSpec | TaskLineError],
    *,
    on_task_error: Any = None,
) -> list[EpisodeOutcome]:
    """Run every task's group; a bad task line is reported (``on_task_error(error)``) and skipped.

    Groups are started only as slots free up, so a task file of any length holds little memory.
    Cancelling this coroutine cancels the open episodes, which are recorded as ``cancelled``.
    """
    limit = max(1, runner.config.concurrency // runner.config.group_size) + 1
    pending: set[asyncio.Task[list[EpisodeOutcome]]] = set()
    finished: deque[asyncio.Task[list[EpisodeOutcome]]] = deque()
    any_finished = asyncio.Event()
    outcomes: list[EpisodeOutcome] = []

    # Each group says when it is done (a callback of its own), rather than an asyncio.wait over every group
    # in flight each time one finishes: that put a callback on each of them and took it off again, a cost
    # per finished group that grew with the concurrency.
    def done(task: asyncio.Task[list[EpisodeOutcome]]) -> None:
        pending.discard(task)
        finished.append(task)
        any_finished.set()

    async def collect(until: int) -> None:
        """Take in finished groups' outcomes until at most ``until`` groups are in flight."""
        while True:
            while finished:
                outcomes.extend(finished.popleft().result())
            if len(pending) <= until:
                return
            any_finished.clear()
            await any_finished.wait()

    try:
        for item in tasks:
            if isinstance(item, TaskLineError):
                runner.stats.task_errors += 1
                if on_task_error is not None:
                    on_task_error(item)
                continue
            await collect(until=limit - 1)
            if runner.pace is not None:
                await runner.pace()
            task = asyncio.create_task(runner.run_group(item))
            pending.add(task)
            task.add_done_callback(done)
        await collect(until=0)
    except asyncio.CancelledError:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        raise
    return outcomes
