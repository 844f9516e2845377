"""The harness for real: a ``turnstile serve gateway`` process, real PostgreSQL and NATS, the tiny model
answering with a scripted policy (tests/support/harness.script.json), the command agent
(examples/harness_shell_agent.py, the openai SDK) in sandboxes of each backend in ``SANDBOXES``, and the
example tasks' real verifiers. Failures of the infrastructure must end episodes ``error`` without a reward
and be retried as new episodes; nothing may be left behind, not even by a harness killed with SIGKILL."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.aio.client import Client as NatsConnection
from rich.console import Console

from consumers.harness import HarnessQueue, serve_harness
from pipeline.harness import HarnessStats, HarnessTask, backend, load_tasks, run_harness
from pipeline.harness.backends.process import sandboxes_root
from pipeline.log import EventStore
from pipeline.runners import TaskSpec, submit_tasks, task_stream, task_subject
from pipeline.settings import jetstream
from schemas import EpisodeFinished, EpisodeStarted, RewardAssigned
from tests.conftest import Servers
from tests.support.agent_gateway import AgentGateway, agent_gateway, episode_events
from tests.support.harness import (
    EXAMPLE_TASKS,
    SANDBOXES,
    SCRIPT,
    SHELL_AGENT,
    admin_key,
    harness_config,
    mount_options,
    owned_sandboxes,
)
from tests.support.processes import running
from tests.support.taskqueue import SilentTasks
from tests.support.waiting import wait_until

pytestmark = [pytest.mark.harness, pytest.mark.parametrize("sandbox", SANDBOXES)]


async def ending(store: EventStore, session_id: str) -> tuple[str, str | None, list[float]]:
    """The episode's termination, its error and the rewards it got."""
    events = await episode_events(store, session_id)
    finished = events[-1]
    assert isinstance(finished, EpisodeFinished), events
    return finished.termination, finished.error, [e.value for e in events if isinstance(e, RewardAssigned)]


async def open_sessions(gateway: AgentGateway) -> list[object]:
    listed = await gateway.admin.get("/admin/sessions")
    data: list[object] = listed.json()["data"]
    return data


async def test_a_task_the_agent_solves_gets_1_and_one_it_fails_gets_0_in_groups(
    sandbox: str, servers: Servers, database_url: str, store: EventStore, tiny_model_dir: Path, tmp_path: Path
) -> None:
    tasks = load_tasks(
        [EXAMPLE_TASKS / "write-greeting", EXAMPLE_TASKS / "fizzbuzz", EXAMPLE_TASKS / "tasks.jsonl"]
    )
    async with agent_gateway(servers.nats_url, database_url, tiny_model_dir, SCRIPT) as gateway:
        config = harness_config(gateway, tmp_path, group_size=2, concurrency=3)
        harness = await run_harness(config, tasks, backend(sandbox))
        assert await open_sessions(gateway) == []

    attempts = harness.stats.attempts
    assert sorted((a.task_id, a.outcome, a.reward) for a in attempts) == [
        ("fix-add", "failed", 0.0), ("fix-add", "failed", 0.0),
        ("fizzbuzz", "failed", 0.0), ("fizzbuzz", "failed", 0.0),
        ("uppercase-file", "failed", 0.0), ("uppercase-file", "failed", 0.0),
        ("write-greeting", "passed", 1.0), ("write-greeting", "passed", 1.0),
    ]  # fmt: skip
    assert all(a.turns == 2 and a.tokens > 0 for a in attempts)  # the command, then the answer
    for attempt in attempts:
        assert attempt.session_id is not None
        termination, error, rewards = await ending(store, attempt.session_id)
        assert (termination, error, rewards) == ("done", None, [attempt.reward])
        started = (await episode_events(store, attempt.session_id))[0]
        assert isinstance(started, EpisodeStarted)
        assert (started.task_id, started.group_id, started.group_size) == (
            attempt.task_id,
            attempt.group_id,
            2,
        )
        assert started.tags["harness"] == config.owner
    groups = {a.task_id: {b.group_id for b in attempts if b.task_id == a.task_id} for a in attempts}
    assert all(len(ids) == 1 for ids in groups.values())  # a task's episodes are one group
    assert owned_sandboxes(config.owner) == []


async def test_infrastructure_failures_end_in_error_without_a_reward_and_are_retried_as_new_episodes(
    sandbox: str, servers: Servers, database_url: str, store: EventStore, tiny_model_dir: Path, tmp_path: Path
) -> None:
    slow_verifier = HarnessTask(
        task_id="slow-verifier", instruction="Write greeting.txt.", verifier_command="sleep 600",
        verifier_timeout_s=1.0,
    )  # fmt: skip
    greeting = load_tasks([EXAMPLE_TASKS / "write-greeting"])
    async with agent_gateway(servers.nats_url, database_url, tiny_model_dir, SCRIPT) as gateway:
        unreachable = harness_config(gateway, tmp_path / "a", retries=1, sandbox_gateway="127.0.0.1:9")
        refused = harness_config(gateway, tmp_path / "b", retries=1, mounts={tmp_path / "missing": "/opt/x"})
        verifier = harness_config(gateway, tmp_path / "c", retries=2)
        runs = [
            (await run_harness(unreachable, greeting, backend(sandbox)), "without a single LLM call"),
            (await run_harness(refused, greeting, backend(sandbox)), "missing"),
            (await run_harness(verifier, [slow_verifier], backend(sandbox)), "ran past its limit of 1 s"),
        ]
        assert await open_sessions(gateway) == []

    for harness, cause in runs:
        attempts = harness.stats.attempts
        assert len(attempts) == harness.config.retries + 1, "retried, and no more than asked"
        assert {a.outcome for a in attempts} == {"error"}
        for previous, attempt in zip([None, *attempts], attempts, strict=False):
            assert attempt.session_id is not None
            assert cause in (attempt.cause or ""), attempt.cause
            termination, error, rewards = await ending(store, attempt.session_id)
            assert (termination, rewards) == ("error", []), "a failure of the infrastructure is not a reward"
            assert cause in (error or "")
            started = (await episode_events(store, attempt.session_id))[0]
            assert isinstance(started, EpisodeStarted)
            assert started.tags.get("retry_of") == (previous.session_id if previous else None)
        assert owned_sandboxes(harness.config.owner) == []


async def test_a_harness_killed_mid_run_leaves_nothing_after_the_next_run(
    sandbox: str, servers: Servers, database_url: str, store: EventStore, tiny_model_dir: Path, tmp_path: Path
) -> None:
    waiting = tmp_path / "waiting.jsonl"
    task = {"id": "wait", "instruction": "Wait a long time.", "verifier": "true"}
    waiting.write_text(json.dumps(task) + "\n")
    async with agent_gateway(servers.nats_url, database_url, tiny_model_dir, SCRIPT) as gateway:
        env = os.environ | {
            "TURNSTILE_ADMIN_KEY": admin_key(gateway),
            "TURNSTILE_DATA_DIR": str(tmp_path / "data"),
            "TMPDIR": str(tmp_path),
        }
        command = [
            sys.executable, "-m", "consumers.cli", "harness", "run", "--agent", "command",
            "--agent-command", SHELL_AGENT, "--sandbox", sandbox, "--gateway", gateway.url,
            "--policy", gateway.policy, "--owner", "killed", "--concurrency", "2", "--group-size", "2",
            *mount_options(),
        ]  # fmt: skip
        async with running(*command, str(waiting), env=env, stdout=asyncio.subprocess.DEVNULL) as harness:
            # both agents called the model and run `sleep 600` in their sandboxes
            await wait_until(lambda: len(owned_sandboxes("killed", tmp_path)) == 2, 120, "two sandboxes")
            await wait_until(lambda: sleeping(tmp_path) == 2, 120, "the agents' commands running")
            [first, second] = [s["session_id"] for s in await open_sessions(gateway)]  # type: ignore[index]
            harness.send_signal(signal.SIGKILL)
            await harness.wait()
        assert len(owned_sandboxes("killed", tmp_path)) == 2, "a killed harness cleans nothing"

        greeting = EXAMPLE_TASKS / "write-greeting"
        restart = [*command[:-2], "--group-size", "1", str(greeting)]
        async with running(*restart, env=env, stderr=asyncio.subprocess.PIPE) as again:
            _, stderr = await asyncio.wait_for(again.communicate(), 300)
        assert again.returncode == 0, stderr.decode()
        assert "removed 2 sandboxes and ended 2 sessions (aborted)" in " ".join(stderr.decode().split())
        assert owned_sandboxes("killed", tmp_path) == []
        assert sleeping(tmp_path) == 0, "what the dead harness's agents ran is gone too"
        assert await open_sessions(gateway) == []
    for session_id in (first, second):
        termination, error, rewards = await ending(store, session_id)
        assert (termination, rewards) == ("aborted", [])
        assert "'killed' that ran it stopped" in (error or "")


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM])
async def test_ctrl_c_or_sigterm_ends_open_sessions_cancelled_and_stops_every_sandbox(
    sandbox: str,
    stop: signal.Signals,
    servers: Servers,
    database_url: str,
    store: EventStore,
    tiny_model_dir: Path,
    tmp_path: Path,
) -> None:
    waiting = tmp_path / "waiting.jsonl"
    waiting.write_text(
        json.dumps({"id": "wait", "instruction": "Wait a long time.", "verifier": "true"}) + "\n"
    )
    async with agent_gateway(servers.nats_url, database_url, tiny_model_dir, SCRIPT) as gateway:
        env = os.environ | {"TURNSTILE_ADMIN_KEY": admin_key(gateway), "TMPDIR": str(tmp_path)}
        env["TURNSTILE_DATA_DIR"] = str(tmp_path / "data")
        command = [
            sys.executable, "-m", "consumers.cli", "harness", "run", "--agent", "command",
            "--agent-command", SHELL_AGENT, "--sandbox", sandbox, "--gateway", gateway.url,
            "--policy", gateway.policy, "--owner", "stopped", "--group-size", "2", *mount_options(),
            str(waiting),
        ]  # fmt: skip
        async with running(*command, env=env, stderr=asyncio.subprocess.PIPE) as harness:
            await wait_until(lambda: sleeping(tmp_path) == 2, 120, "the agents' commands running")
            sessions = [s["session_id"] for s in await open_sessions(gateway)]  # type: ignore[index]
            harness.send_signal(stop)
            _, stderr = await asyncio.wait_for(harness.communicate(), 120)
        assert harness.returncode == 130, stderr.decode()
        assert owned_sandboxes("stopped", tmp_path) == []
        assert sleeping(tmp_path) == 0
        assert await open_sessions(gateway) == []
    assert len(sessions) == 2
    for session_id in sessions:
        termination, error, rewards = await ending(store, session_id)
        assert (termination, rewards) == ("cancelled", [])
        assert "the harness was stopped" in (error or "")


def sleeping(tmp_path: Path) -> int:
    """How many ``sleep 600`` run with a working directory under ``tmp_path`` (the agents' commands), or in
    a sandbox's own ``/workspace`` (bwrap: /proc shows the path as the sandbox sees it)."""
    return len(sleepers(tmp_path))


def sleepers(root: Path) -> list[int]:
    """The pids of the ``sleep 600`` that ``sleeping`` counts."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and (entry / "cmdline").read_bytes() == b"sleep\x00600\x00":
                cwd = os.readlink(entry / "cwd")
                if cwd.startswith(str(root)) or cwd == "/workspace":
                    found.append(int(entry.name))
        except OSError:
            continue
    return found


async def test_a_task_delivered_again_to_the_harness_still_running_it_joins_that_run(
    sandbox: str,
    servers: Servers,
    database_url: str,
    store: EventStore,
    tiny_model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A harness whose notes of progress are lost (an outage of NATS longer than ``ack_wait``) is given its
    task again while it still runs it: each such delivery joins that run (one group of episodes, not a second
    one), and once the group ends the latest delivery is acked, so the task leaves the queue."""
    monkeypatch.setattr("consumers.harness.RunningTasks", SilentTasks)
    SilentTasks.instances.clear()
    waiting = {"instruction": "Wait a long time.", "verifier": "true"}  # the agents run `sleep 600`
    async with agent_gateway(servers.nats_url, database_url, tiny_model_dir, SCRIPT) as gateway:
        connection = await nats.connect(servers.nats_url)
        try:
            spec = TaskSpec(waiting, "wait")
            stats, stop, serving = await serve_one_task(
                connection, gateway, sandbox, servers.nats_url, tmp_path, spec, ack_wait=2.0
            )

            def joined_twice() -> bool:
                return serving.done() or bool(SilentTasks.instances and SilentTasks.instances[0].joined >= 2)

            await wait_until(joined_twice, 180, "the task delivered again, twice, while it runs")
            await wait_until(lambda: len(sleepers(sandboxes_root())) == 2 or serving.done(), 120, "2 agents")
            assert not serving.done(), serving.result()
            assert len(await open_sessions(gateway)) == 2  # one group: no delivery started another
            for pid in sleepers(sandboxes_root()):
                os.kill(pid, signal.SIGTERM)  # the agents' commands end: their episodes finish, verified
            await wait_until(lambda: len(stats.attempts) == 2 or serving.done(), 120, "the group's end")
            await wait_until(lambda: queue_empty(connection, gateway.policy), 60, "the latest delivery acked")
            stop.set()
            queue = await serving
            assert queue is not None
            assert (queue.tasks_done, queue.tasks_refused) == (1, 0)
            assert queue.running.joined >= 2
        finally:
            stop.set()
            await connection.drain()
    assert len(stats.attempts) == 2
    assert len({a.group_id for a in stats.attempts}) == 1
    assert {(a.outcome, a.reward) for a in stats.attempts} == {("passed", 1.0)}


async def serve_one_task(
    connection: NatsConnection,
    gateway: AgentGateway,
    sandbox: str,
    nats_url: str,
    tmp_path: Path,
    spec: TaskSpec,
    **options: Any,
) -> tuple[HarnessStats, asyncio.Event, asyncio.Task[HarnessQueue | None]]:
    """``spec`` on the harness queue as a group of 2, and ``turnstile serve harness`` taking it, in a task of
    its own; its figures and the event that stops it."""
    await submit_tasks(connection, gateway.policy, [spec], group_size=2, harness=True)
    stats, stop = HarnessStats(), asyncio.Event()
    serving = asyncio.create_task(
        serve_harness(
            harness_config(gateway, tmp_path), sandbox, nats_url, Console(stderr=True),
            stop=stop, stats=stats, **options,
        )
    )  # fmt: skip
    return stats, stop, serving


async def queue_empty(connection: NatsConnection, policy: str) -> bool:
    """Whether ``harness.tasks.<policy>`` holds no task (each one acked)."""
    subject = task_subject(policy, harness=True)
    left = await jetstream(connection).stream_info(task_stream(harness=True), subjects_filter=subject)
    return not left.state.subjects


async def test_serve_harness_runs_a_group_from_the_task_queue_and_acks_it(
    sandbox: str, servers: Servers, database_url: str, store: EventStore, tiny_model_dir: Path, tmp_path: Path
) -> None:
    greeting = {"path": str(EXAMPLE_TASKS / "write-greeting")}
    async with agent_gateway(servers.nats_url, database_url, tiny_model_dir, SCRIPT) as gateway:
        connection = await nats.connect(servers.nats_url)
        try:
            stats, stop, serving = await serve_one_task(
                connection, gateway, sandbox, servers.nats_url, tmp_path, TaskSpec(greeting, "write-greeting")
            )
            await wait_until(
                lambda: len(stats.attempts) == 2 or serving.done(), 300, "the group's 2 episodes"
            )
            stop.set()
            queue = await serving
            assert queue is not None
            assert (queue.tasks_done, queue.tasks_refused) == (1, 0)
            assert await queue_empty(connection, gateway.policy), "acked: gone from the work queue"
        finally:
            await connection.drain()
    assert {(a.outcome, a.reward, a.group_size) for a in stats.attempts} == {("passed", 1.0, 2)}
    assert len({a.group_id for a in stats.attempts}) == 1
    for attempt in stats.attempts:
        assert attempt.session_id is not None
        assert await ending(store, attempt.session_id) == ("done", None, [1.0])
