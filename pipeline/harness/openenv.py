"""An OpenEnv face for the harness, so that TRL's harness worker trains on rollouts Turnstile ran.

TRL's ``HarnessRolloutWorker`` (``trl.experimental.async_grpo``) takes a ``harness_session_factory``: called
with ``sampling=...``, it gives an OpenEnv ``ResourceSessionFactory``, whose ``create(task, seed,
episode_id)`` starts one rollout of an agent that owns its loop. The worker then calls the session's
``wait_for_completion()`` (the agent's exit status), ``fetch_training_trace()`` (OpenEnv's ``TrainingTrace``:
a ``TrainingTurn`` per engine call, with its exact token ids, logprobs and loss mask), ``verify(...)`` (the
task's reward) and ``close()``.

Here a rollout is one harness episode (``Harness.episode``: a gateway session, a sandbox, the agent CLI, the
task's verifier), and the trace is read back from the event log: every recorded turn of the episode, made
whole, with the engine's own ids (never re-tokenized). A failure of the infrastructure is raised from
``wait_for_completion`` (the worker scores such a rollout as unscorable and keeps it out of the group's
baseline: never a reward of 0), as the harness itself treats it.

The harness runs on an event loop in a thread of the factory's own (OpenEnv's sessions are synchronous and
TRL calls them from a pool of threads); ``close()`` on the factory stops it. Needs the ``openenv`` extra.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import threading
import uuid
from collections.abc import Coroutine, Mapping
from pathlib import Path
from typing import Any, TypeVar

from openenv.core.harness import (
    ResourceSession,
    ResourceSessionFactory,
    ToolResult,
    TrainingTrace,
    TrainingTurn,
    VerifyResult,
)

from pipeline.episodes import fold_episode
from pipeline.errors import ConfigError, TurnstileError
from pipeline.harness.report import Attempt
from pipeline.harness.run import Harness, HarnessConfig, opened_harness
from pipeline.harness.sandbox import SandboxBackend
from pipeline.harness.tasks import HarnessTask, load_tasks, queued_task
from pipeline.log import EventStore
from schemas import SamplingParams, TurnCompleted, TurnDelivered

T = TypeVar("T")


class RolloutFailed(TurnstileError):
    """The rollout ended without the verifier's verdict (an infrastructure failure, or it was cancelled):
    unscorable, never a reward of 0."""


class TurnstileSessionFactory(ResourceSessionFactory["TurnstileSession"]):
    """OpenEnv sessions that are harness episodes of ``config`` (its gateway, agent, owner) under ``backend``;
    their turns are read from the event log at ``database_url`` (a reader's login is enough)."""

    def __init__(
        self,
        config: HarnessConfig,
        backend: SandboxBackend,
        database_url: str,
        *,
        sampling: Mapping[str, Any] | None = None,
    ) -> None:
        if sampling:  # what TRL's worker samples with: the sessions' defaults, where the agent says nothing
            wanted = {k: v for k, v in sampling.items() if k in SamplingParams.model_fields}
            base = config.sampling.model_dump() if config.sampling else {}
            config = dataclasses.replace(config, sampling=SamplingParams.model_validate(base | wanted))
        self.config = config
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="turnstile-harness", daemon=True)
        self._thread.start()
        self._opened = opened_harness(config, backend)
        self._episodes: set[asyncio.Task[Attempt]] = set()
        try:
            self.harness, _ = self.run(self._opened.__aenter__())
            self.store = self.run(EventStore.connect(database_url))
        except BaseException:
            self._stop_loop()
            raise

    def run(self, work: Coroutine[Any, Any, T]) -> T:
        """``work`` on the harness's event loop, waited for from this thread."""
        return asyncio.run_coroutine_threadsafe(work, self._loop).result()

    def _start(self, episode: Coroutine[Any, Any, Attempt]) -> asyncio.Task[Attempt]:
        """``episode`` as a task of the harness's event loop, not waited for (``close`` cancels it)."""

        async def spawn() -> asyncio.Task[Attempt]:  # on the loop's thread, which alone touches the tasks
            task = asyncio.create_task(episode)
            self._episodes.add(task)
            task.add_done_callback(self._episodes.discard)
            return task

        return self.run(spawn())

    def create(self, task: Any, seed: int | None = None, episode_id: str | None = None) -> TurnstileSession:
        """Start one episode of ``task``: a ``HarnessTask``, a Harbor task directory (a path), or the JSONL
        form (a dict). Each is a group of its own for Turnstile (TRL makes its groups itself: the members of
        one share a ``seed``); the seed and TRL's rollout id are tags of the episode."""
        chosen = as_task(task)
        group_id = f"{chosen.task_id}-{uuid.uuid4().hex[:12]}"
        tags = {"openenv_rollout": episode_id or "", "openenv_seed": "" if seed is None else str(seed)}
        episode = self._start(_attempt(self.harness, chosen, group_id, tags))
        return TurnstileSession(self, chosen, episode, group_id)

    def close(self) -> None:
        """End every open episode (``cancelled``), release the owner's lock, stop the loop's thread."""
        try:
            self.run(self._cancel_all())
            self.run(self.store.close())
            self.run(self._opened.__aexit__(None, None, None))
        finally:
            self._stop_loop()

    async def _cancel_all(self) -> None:
        await _cancelled(*self._episodes)

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=60)
        self._loop.close()


class TurnstileSession(ResourceSession):
    """One harness episode as OpenEnv's loop-owning, trainable session (``TrainableSession``)."""

    def __init__(
        self,
        factory: TurnstileSessionFactory,
        task: HarnessTask,
        episode: asyncio.Task[Attempt],
        group_id: str,
    ) -> None:
        self.factory, self.task, self.group_id = factory, task, group_id
        self._episode = episode
        self._ended: Attempt | None = None

    @property
    def attempt(self) -> Attempt:
        """The finished episode (waited for)."""
        return self._ended or self._wait(None)

    def _wait(self, timeout_s: float | None) -> Attempt:
        try:
            self._ended = self.factory.run(_finished(self._episode, timeout_s))
        except concurrent.futures.CancelledError:
            raise RolloutFailed("the episode was cancelled before it began") from None
        return self._ended

    def wait_for_completion(self, timeout_s: float | None = None) -> int:
        """The agent's exit status once the episode (agent, verifier, reward, end) is over. ``TimeoutError``
        when the agent ran past its limit (the episode ends ``timeout``) or ``timeout_s`` passed (the
        episode goes on; ``close`` cancels it); ``RolloutFailed`` when the infrastructure failed."""
        attempt = self._wait(timeout_s)
        if attempt.outcome == "timeout":
            raise TimeoutError(attempt.cause)
        if attempt.outcome in ("error", "cancelled"):
            raise RolloutFailed(f"episode {attempt.session_id} ended {attempt.outcome}: {attempt.cause}")
        return attempt.exit_code if attempt.exit_code is not None else 0

    def fetch_training_trace(self) -> TrainingTrace:
        """The episode's recorded turns as OpenEnv's ``TrainingTurn``s, in the order they were recorded."""
        session_id = self.attempt.session_id
        if session_id is None:
            raise RolloutFailed(f"no episode was started: {self.attempt.cause}")
        recorded = self.factory.run(self.factory.store.read_stream(f"episode-{session_id}"))
        events = [r.event for r in recorded if r.event is not None]
        # a gateway records a turn before its reply reaches the agent, and says so with its next event
        handed = {i for event in events if isinstance(event, TurnDelivered) for i in event.turn_ids}
        return TrainingTrace(
            turns=[
                training_turn(turn, session_id, turn.delivered is not False or turn.turn_id in handed)
                for turn in fold_episode(events).turns
            ]
        )

    def verify(self, transcript: list[dict[str, Any]], final_state: Any | None = None) -> VerifyResult:
        """The verifier's reward, which the harness already posted (None: not verified, not 0)."""
        attempt = self.attempt
        metrics: dict[str, Any] = {
            "turns": attempt.turns, "tokens": attempt.tokens, "outcome": attempt.outcome,
            **{f"{phase}_seconds": seconds for phase, seconds in attempt.seconds.items()},
        }  # fmt: skip
        return VerifyResult(env_reward=attempt.reward, done=True, metrics=metrics)

    def initial_messages(self) -> list[dict[str, Any]]:
        return [{"role": "user", "content": self.task.instruction}]

    def list_tools(self) -> list[Any]:
        return []  # the agent brings its own tools, inside its sandbox

    def call_tool(self, name: str, arguments: dict[str, Any]) -> ToolResult:
        return ToolResult(error=f"{name}: the agent runs its own tools in its sandbox; none are served here")

    def close(self) -> None:
        """Cancel the episode if it still runs (it ends ``cancelled``, its sandbox removed); wait for it."""
        self.factory.run(_cancelled(self._episode))
        if self._ended is None:  # a cancelled episode returns nothing: its attempt is in the harness's record
            recorded = self.factory.harness.stats.attempts
            self._ended = next((a for a in recorded if a.group_id == self.group_id), None)


async def _finished(episode: asyncio.Task[Attempt], timeout_s: float | None) -> Attempt:
    """The episode's attempt once it ended; ``TimeoutError`` after ``timeout_s`` (it goes on running)."""
    return await asyncio.wait_for(asyncio.shield(episode), timeout_s)


async def _cancelled(*episodes: asyncio.Task[Attempt]) -> None:
    """Cancel the episodes that still run; wait until their sessions ended and their sandboxes are gone."""
    for episode in episodes:
        episode.cancel()
    await asyncio.gather(*episodes, return_exceptions=True)


async def _attempt(harness: Harness, task: HarnessTask, group_id: str, tags: dict[str, str]) -> Attempt:
    """One episode, a group of one, in one of the harness's slots; no retry (the trainer decides what to run
    again)."""
    async with harness.slots:
        return await harness.episode(task, group_id, 1, 0, tags)


def as_task(task: Any) -> HarnessTask:
    """A ``HarnessTask`` from what a trainer's dataset row holds: one, a task directory, or the JSONL form."""
    if isinstance(task, HarnessTask):
        return task
    if isinstance(task, str | Path) and Path(task).is_dir():
        (loaded,) = load_tasks([Path(task)])
        return loaded
    if isinstance(task, Mapping):
        return queued_task(dict(task), str(task.get("id", "")))
    raise ConfigError(
        f"a task is a HarnessTask, a Harbor task directory or a JSONL task object, got {task!r}"
    )


def training_turn(turn: TurnCompleted, session_id: str, delivered: bool) -> TrainingTurn:
    """A whole recorded turn as OpenEnv's ``TrainingTurn``: the engine's prompt and completion ids and
    logprobs as recorded; the loss mask 0 over the prompt and, over the completion, 1 unless the turn is not
    for training (a side call marked ``train: false``, or a reply that never reached the agent)."""
    trained = turn.train is not False and delivered
    mask = [0] * len(turn.prompt_token_ids) + [int(trained)] * len(turn.completion_token_ids)
    message: dict[str, Any] = {"role": "assistant", "content": turn.reply.text}
    if turn.reply.tool_calls:
        message["tool_calls"] = [call.model_dump(mode="json") for call in turn.reply.tool_calls]
    return TrainingTurn(
        node_id=str(turn.turn_id),
        prompt_token_ids=list(turn.prompt_token_ids),
        completion_token_ids=list(turn.completion_token_ids),
        per_token_logps=[float(logprob) for logprob in turn.completion_logprobs],
        loss_mask=mask,
        request={
            "messages": [m.model_dump(mode="json", exclude_none=True) for m in turn.request.messages],
            "tools": [tool.model_dump(mode="json") for tool in turn.request.tools] or None,
        },
        response={"choices": [{"message": message, "finish_reason": turn.reply.finish_reason}]},
        metadata={
            "episode_id": session_id,
            "parent_turn_id": str(turn.parent_turn_id) if turn.parent_turn_id else None,
            "policy_version": turn.policy_version,
            "engine_id": turn.engine_id,
            "sampling_params": turn.request.sampling.model_dump(mode="json"),
        },
    )
