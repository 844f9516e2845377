"""The harness: for each task x group_size, one episode at a time per slot (``concurrency`` slots):

1. open a gateway session (``POST /admin/sessions``: task, task_id, group_id, group_size, agent), journalled;
2. start a sandbox with the task's workspace and the agent's config files in its HOME;
3. run the agent under the task's agent time limit, the session's key in its environment only;
4. copy the task's tests in (only now: the agent never sees them), run the verifier under its own limit,
   with the task's ``[verifier] env`` and nothing of the agent's (never the key);
5. post the verifier's reward; end the session; stop the sandbox, whatever happened (try/finally).

Failures are not rewards: a sandbox that does not start, an agent that exits without a single LLM call (it
could not reach the gateway), a verifier that crashes, runs past its limit or writes no reward: the session
ends ``error`` with the cause, no reward is posted, and the member is run again as a new episode (same group,
``retry_of`` tag) up to ``retries`` times. An agent that ran past its own limit ends ``timeout`` (neither a
sample nor retried). Cancelled (Ctrl-C): open sessions end ``cancelled`` and every sandbox is stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlsplit

from pipeline.errors import ConfigError
from pipeline.harness.admin import AdminClient, GatewayUnavailable, Journal
from pipeline.harness.agents import (
    CLIS_INSIDE,
    DEFAULT_CLIS,
    EXAMPLES_INSIDE,
    REPOSITORY,
    AgentSpec,
    base_env,
)
from pipeline.harness.agents import host_values as agent_host_values
from pipeline.harness.report import Attempt, HarnessStats
from pipeline.harness.sandbox import ExecResult, Sandbox, SandboxBackend, SandboxError, SandboxSpec
from pipeline.harness.tasks import HarnessTask

log = logging.getLogger(__name__)
OUTPUT_TAIL = 600
"""Characters of a failed command's output quoted in the cause."""


@dataclass(frozen=True)
class HarnessConfig:
    gateway: str
    """The gateway's URL as the harness reaches it (``http://host:port``, no ``/v1``)."""
    admin_key: str
    agent: AgentSpec
    owner: str
    """This harness's name: its sandboxes' label, its state directory; one live harness per owner."""
    state_dir: Path
    group_size: int = 1
    concurrency: int = 4
    retries: int = 1
    policy: str | None = None
    clis: Path = DEFAULT_CLIS
    sandbox_gateway: str | None = None
    """``host:port`` at which sandboxes reach the gateway [default: the host and port of ``gateway``]."""
    tags: dict[str, str] = field(default_factory=dict)
    mounts: dict[Path, str] = field(default_factory=dict)
    """More host directories mounted read-only in every sandbox (host -> inside), e.g. a command's venv."""

    def check(self) -> None:
        for name, value, least in (
            ("--group-size", self.group_size, 1), ("--concurrency", self.concurrency, 1),
            ("--retries", self.retries, 0),
        ):  # fmt: skip
            if value < least:
                raise ConfigError(f"{name} must be at least {least}, got {value}")
        if urlsplit(self.gateway).scheme not in ("http", "https") or not urlsplit(self.gateway).port:
            raise ConfigError(f"--gateway must be http://host:port, got {self.gateway!r}")
        if self.agent.uses_clis and not (self.clis / "node_modules" / ".bin").is_dir():
            raise ConfigError(
                f"agent {self.agent.name!r} runs from pre-built CLIs and {self.clis}/node_modules/.bin is "
                f"missing: run `npm ci --prefix {self.clis}` (or give --clis DIR)"
            )


class InfrastructureFailure(Exception):
    """Not the agent's doing: the episode ends ``error`` with this cause, gets no reward, and is retried."""


@dataclass(frozen=True)
class Recovered:
    sandboxes: int
    sessions: int


def tail(text: str) -> str:
    text = text.strip()
    return text if len(text) <= OUTPUT_TAIL else "..." + text[-OUTPUT_TAIL:]


class Harness:
    """Runs tasks: sessions through ``admin``, sandboxes from ``backend``."""

    def __init__(
        self,
        config: HarnessConfig,
        backend: SandboxBackend,
        admin: AdminClient,
        stats: HarnessStats | None = None,
    ) -> None:
        self.config = config
        self.backend = backend
        self.admin = admin
        self.journal = Journal(config.state_dir / "owners" / config.owner)
        self.stats = stats if stats is not None else HarnessStats()
        self.slots = asyncio.Semaphore(config.concurrency)
        self.sandbox_gateway = config.sandbox_gateway or urlsplit(config.gateway).netloc

    async def recover(self) -> Recovered:
        """What a dead harness of this owner left: its sandboxes removed, its open sessions ended ``aborted``
        (the caller holds the owner's lock, so that harness is gone)."""
        sandboxes = await self.backend.sweep(self.config.owner)
        sessions = 0
        for session_id, gateway in list(self.journal.left_open()):
            admin = self.admin if gateway == self.admin.url else None
            if admin is None:
                log.warning("session %s was opened on another gateway (%s): left as is", session_id, gateway)
                continue
            cause = f"the harness {self.config.owner!r} that ran it stopped; ended by its next run"
            sessions += await admin.end(session_id, "aborted", cause, {})
            self.journal.remove(session_id)
        return Recovered(sandboxes, sessions)

    async def run(self, tasks: list[HarnessTask]) -> list[Attempt]:
        """Every task x group_size; returns every attempt (retries included)."""
        async with asyncio.TaskGroup() as group:
            for task in tasks:
                group.create_task(self.run_group(task))
        return self.stats.attempts

    async def run_group(self, task: HarnessTask, group_size: int | None = None) -> None:
        """``group_size`` (default: the config's) episodes of ``task``, one group, in the ``concurrency``
        slots every group of this harness shares."""
        size = group_size or self.config.group_size
        group_id = f"{task.task_id}-{uuid.uuid4().hex[:12]}"
        async with asyncio.TaskGroup() as group:
            for _ in range(size):
                group.create_task(self._member(task, group_id, size))

    async def _member(self, task: HarnessTask, group_id: str, group_size: int) -> None:
        retry_of: str | None = None
        for number in range(self.config.retries + 1):
            async with self.slots:
                attempt = await self.episode(task, group_id, group_size, number, retry_of)
            if attempt.outcome != "error":
                return
            retry_of = attempt.session_id

    async def episode(
        self, task: HarnessTask, group_id: str, group_size: int, number: int, retry_of: str | None
    ) -> Attempt:
        """One attempt: never raises but for cancellation; its outcome says what happened."""
        attempt = Attempt(task.task_id, group_id, group_size, number)
        self.stats.running += 1
        try:
            await self._episode(task, attempt, retry_of)
        finally:
            self.stats.running -= 1
            self.stats.add(attempt)
        return attempt

    async def _episode(self, task: HarnessTask, attempt: Attempt, retry_of: str | None) -> None:
        try:
            session = await self.admin.open_session(self._session_spec(task, attempt, retry_of))
        except GatewayUnavailable as error:
            attempt.cause = str(error)
            return
        attempt.session_id = session["session_id"]
        self.journal.add(attempt.session_id, self.admin.url)
        termination: str | None = None
        try:
            async with self._sandbox(task, attempt) as sandbox:
                termination = await self._agent_and_verifier(task, attempt, sandbox, session["api_key"])
        except (InfrastructureFailure, SandboxError, GatewayUnavailable) as error:
            attempt.outcome, attempt.cause, termination = "error", str(error), "error"
        except asyncio.CancelledError:
            attempt.outcome, termination = "cancelled", "cancelled"
            attempt.cause = "the harness was stopped (Ctrl-C or SIGTERM)"
            raise
        finally:
            await self._end(attempt, termination)

    async def _agent_and_verifier(
        self, task: HarnessTask, attempt: Attempt, sandbox: Sandbox, api_key: str
    ) -> str | None:
        """Run the agent, then the verifier; post the reward. The session's termination (None: done)."""
        assert attempt.session_id is not None
        with self._timed(attempt, "agent"):
            ran = await self._run_agent(task, sandbox, api_key)
        described = await self.admin.describe(attempt.session_id)
        attempt.turns = int(described.get("turns", 0))
        attempt.tokens = int(described.get("prompt_tokens", 0)) + int(described.get("completion_tokens", 0))
        if ran.timed_out:
            attempt.outcome, attempt.cause = (
                "timeout",
                f"the agent ran past its limit of {task.agent_timeout_s:g} s",
            )
            return "timeout"
        if ran.exit_code != 0 and attempt.turns == 0:
            raise InfrastructureFailure(
                f"the agent exited {ran.exit_code} without a single LLM call: could it reach the gateway at "
                f"{sandbox.gateway_url}? Its output ends: {tail(ran.output)}"
            )
        with self._timed(attempt, "verify"):
            reward = await self._verify(task, sandbox)
        await self.admin.reward(attempt.session_id, reward)
        attempt.reward = reward
        attempt.outcome = "passed" if reward >= 1.0 else "failed"
        return None

    def _session_spec(self, task: HarnessTask, attempt: Attempt, retry_of: str | None) -> dict[str, Any]:
        tags = {**self.config.tags, "harness": self.config.owner, "attempt": str(attempt.number)}
        if retry_of:
            tags["retry_of"] = retry_of
        spec: dict[str, Any] = {
            "task": {"instruction": task.instruction},
            "task_id": task.task_id,
            "group_id": attempt.group_id,
            "group_size": attempt.group_size,
            "agent": self.config.agent.name,
            "tags": tags,
            "untrained_models": list(self.config.agent.untrained_models),
        }
        if self.config.policy:
            spec["policy"] = self.config.policy
        return spec

    @contextlib.contextmanager
    def _timed(self, attempt: Attempt, phase: str) -> Any:
        started = time.monotonic()
        try:
            yield
        finally:
            attempt.seconds[phase] = time.monotonic() - started

    @contextlib.asynccontextmanager
    async def _sandbox(self, task: HarnessTask, attempt: Attempt) -> AsyncIterator[Sandbox]:
        """A started sandbox with the task's files in its workspace, stopped on the way out."""
        with tempfile.TemporaryDirectory(prefix="turnstile-harness-") as staging:
            workspace = Path(staging) / "workspace"
            workspace.mkdir()
            for name, text in task.files.items():
                (workspace / name).parent.mkdir(parents=True, exist_ok=True)
                (workspace / name).write_text(text)
            mounts = {REPOSITORY / "examples": self._examples_inside(), **self.config.mounts}
            if self.config.agent.uses_clis:
                mounts[self.config.clis] = CLIS_INSIDE
            spec = SandboxSpec(
                workspace=workspace, gateway=self.sandbox_gateway, owner=self.config.owner,
                allow_internet=task.allow_internet, mounts=mounts, environment=task.environment,
                image=task.image, memory_mib=task.memory_mib, cpus=task.cpus,
            )  # fmt: skip
            with self._timed(attempt, "start"):
                sandbox = await self.backend.start(spec)
            try:
                yield sandbox
            finally:
                await sandbox.stop()

    def _examples_inside(self) -> str:
        """Where the repository's examples are inside a sandbox: /opt/turnstile/examples, unless a ``--mount``
        of that directory puts them elsewhere (mounts are keyed by host path, so it replaces ours)."""
        return self.config.mounts.get(REPOSITORY / "examples", EXAMPLES_INSIDE)

    async def _run_agent(self, task: HarnessTask, sandbox: Sandbox, api_key: str) -> ExecResult:
        root = sandbox_root(sandbox)
        home = f"{root}/home/agent"
        values = {
            "gateway_url": sandbox.gateway_url,
            "base_url": f"{sandbox.gateway_url}/v1",
            "api_key": api_key,
            "instruction": task.instruction,
            "home": home,
            "clis": f"{root}{CLIS_INSIDE}",
            "examples": f"{root}{self._examples_inside()}",
            **agent_host_values(),
        }
        rendered = self.config.agent.render(values)
        with tempfile.TemporaryDirectory(prefix="turnstile-home-") as staging:
            for name, text in rendered.files.items():
                (Path(staging) / name).parent.mkdir(parents=True, exist_ok=True)
                (Path(staging) / name).write_text(text)
            await sandbox.copy_in(Path(staging), home)
        env = base_env(home, urlsplit(sandbox.gateway_url).hostname or "") | rendered.env
        return await sandbox.exec(rendered.argv, env=env, limit_s=task.agent_timeout_s)

    async def _verify(self, task: HarnessTask, sandbox: Sandbox) -> float:
        """The verifier's reward; ``InfrastructureFailure`` if it gave none."""
        root = sandbox_root(sandbox)
        with tempfile.TemporaryDirectory(prefix="turnstile-verifier-") as staging:
            await sandbox.copy_in(Path(staging), f"{root}/logs/verifier")
            await sandbox.copy_in(Path(staging), f"{root}/home/verifier")
            if task.tests is not None:
                await sandbox.copy_in(task.tests, f"{root}/tests")
            argv = (
                ["bash", "-c", task.verifier_command]
                if task.verifier_command
                else ["bash", f"{root}/tests/test.sh"]
            )
            env = {
                "PATH": "/usr/local/bin:/usr/bin:/bin",
                "HOME": f"{root}/home/verifier",
                "LANG": "C.UTF-8",
                "TURNSTILE_SANDBOX_ROOT": root,
                **task.verifier_env,
            }
            ran = await sandbox.exec(argv, env=env, limit_s=task.verifier_timeout_s)
            if ran.timed_out:
                raise InfrastructureFailure(
                    f"the verifier ran past its limit of {task.verifier_timeout_s:g} s: {tail(ran.output)}"
                )
            if task.verifier_command:
                return 1.0 if ran.exit_code == 0 else 0.0
            logs = Path(staging) / "out"
            await sandbox.copy_out(f"{root}/logs/verifier", logs)
            return read_reward(logs, ran)

    async def _end(self, attempt: Attempt, termination: str | None) -> None:
        """End the session; one that could not be ended stays journalled, for the next run of this owner."""
        if attempt.session_id is None:
            return
        metrics = {f"{phase}_seconds": seconds for phase, seconds in attempt.seconds.items()}
        try:
            await self.admin.end(attempt.session_id, termination, attempt.cause, metrics)
        except GatewayUnavailable as error:
            log.warning("session %s could not be ended (the next run ends it): %s", attempt.session_id, error)
            return
        self.journal.remove(attempt.session_id)


def sandbox_root(sandbox: Sandbox) -> str:
    """The sandbox's root as a prefix of absolute paths inside: "" where the sandbox has a file system of
    its own (workdir ``/workspace``: ``/tests`` is ``/tests``), the temp directory of a process sandbox."""
    parent = str(PurePosixPath(sandbox.workdir).parent)
    return "" if parent == "/" else parent


def read_reward(logs: Path, ran: ExecResult) -> float:
    """Harbor's verdict: ``reward.txt`` (a number) or ``reward.json`` (``{"reward": x}``, or one key)."""
    text_file, json_file = logs / "reward.txt", logs / "reward.json"
    try:
        if text_file.is_file():
            return float(text_file.read_text().strip())
        if json_file.is_file():
            rewards = json.loads(json_file.read_text())
            if isinstance(rewards, dict) and "reward" not in rewards and len(rewards) == 1:
                rewards = {"reward": next(iter(rewards.values()))}
            return float(rewards["reward"] if isinstance(rewards, dict) else rewards)
    except (ValueError, KeyError, TypeError) as error:
        raise InfrastructureFailure(f"the verifier wrote a reward that is not a number: {error}") from None
    raise InfrastructureFailure(
        f"the verifier exited {ran.exit_code} and wrote no /logs/verifier/reward.txt or reward.json; its "
        f"output ends: {tail(ran.output)}"
    )


async def run_harness(
    config: HarnessConfig,
    tasks: list[HarnessTask],
    backend: SandboxBackend,
    *,
    stats: HarnessStats | None = None,
    on_start: Callable[[Harness, Recovered], None] | None = None,
) -> Harness:
    """Take the owner's lock, clean up what a dead harness of this owner left, run every task."""
    config.check()
    admin = AdminClient(config.gateway, config.admin_key)
    harness = Harness(config, backend, admin, stats)
    harness.journal.acquire(config.owner)
    try:
        recovered = await harness.recover()
        if on_start is not None:
            on_start(harness, recovered)
        await harness.run(tasks)
    finally:
        harness.journal.release()
        await admin.close()
    return harness
