"""``--sandbox none``: the environment exactly as given, a process group killed at the time limit, copies in
and out, and a sweep that kills what a dead harness's sandboxes still run and removes them."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from pipeline.errors import ConfigError
from pipeline.harness import SandboxError, SandboxSpec
from pipeline.harness.backends import backend
from pipeline.harness.backends.process import ProcessBackend
from tests.support.waiting import wait_until


def spec(tmp_path: Path, **settings: object) -> SandboxSpec:
    workspace = tmp_path / "workspace"
    workspace.mkdir(exist_ok=True)
    (workspace / "start.txt").write_text("begin")
    return SandboxSpec(workspace=workspace, gateway="127.0.0.1:8000", owner="o", **settings)  # type: ignore[arg-type]


async def test_commands_run_in_the_workspace_with_exactly_the_given_environment(tmp_path: Path) -> None:
    sandbox = await ProcessBackend(tmp_path / "root").start(
        spec(tmp_path, mounts={tmp_path / "workspace": "/opt/w"})
    )
    try:
        ran = await sandbox.exec(["/usr/bin/env"], env={"ONLY": "this"}, limit_s=30)
        assert (ran.exit_code, ran.output) == (0, "ONLY=this\n")
        ran = await sandbox.exec(["/bin/cat", "start.txt"], env={}, limit_s=30)
        assert ran.output == "begin"
        assert sandbox.gateway_url == "http://127.0.0.1:8000"
        root = str(Path(sandbox.workdir).parent)
        assert (Path(root) / "opt" / "w" / "start.txt").read_text() == "begin"  # a mount: its target, inside
        await sandbox.copy_in(tmp_path / "workspace", f"{root}/tests")
        await sandbox.copy_out(f"{root}/tests/start.txt", tmp_path / "out.txt")
        assert (tmp_path / "out.txt").read_text() == "begin"
        with pytest.raises(FileNotFoundError):
            await sandbox.copy_out(f"{root}/nothing", tmp_path / "x")
        ran = await sandbox.exec(["/nonexistent/agent"], env={}, limit_s=30)
        assert ran.exit_code == 127
        assert "cannot run" in ran.output
    finally:
        await sandbox.stop()
    assert gone(sandbox.workdir)


async def test_the_time_limit_kills_the_command_and_what_it_started(tmp_path: Path) -> None:
    sandbox = await ProcessBackend(tmp_path / "root").start(spec(tmp_path))
    try:
        script = "sleep 300 & echo $! > child.pid; echo started; wait"
        ran = await sandbox.exec(["/bin/sh", "-c", script], env={}, limit_s=1)
        assert ran.timed_out
        assert ran.output == "started\n"
        child = int((Path(sandbox.workdir) / "child.pid").read_text())
        await wait_until(lambda: not alive(child), 30, "the background child killed with its group")
    finally:
        await sandbox.stop()


async def test_a_sweep_removes_every_sandbox_of_the_owner_and_kills_what_runs_there(tmp_path: Path) -> None:
    root = tmp_path / "root"
    sandbox = await ProcessBackend(root).start(spec(tmp_path))
    running = asyncio.create_task(sandbox.exec(["/bin/sleep", "300"], env={}, limit_s=300))
    pids: list[int] = []
    await wait_until(lambda: bool(pids.extend(sleepers(sandbox.workdir)) or pids), 30, "sleep started")
    # as if the harness were gone: a new backend (the next run) sweeps the owner
    assert await ProcessBackend(root).sweep("o") == 1
    await wait_until(lambda: not alive(pids[0]), 30, "the sandbox's process killed")
    assert (await running).exit_code == -9
    assert gone(sandbox.workdir)
    assert await ProcessBackend(root).sweep("o") == 0


async def test_a_missing_mount_source_is_a_sandbox_error_and_an_unknown_backend_a_config_error(
    tmp_path: Path,
) -> None:
    with pytest.raises(SandboxError, match=r"mount source .* is not a directory"):
        await ProcessBackend(tmp_path).start(spec(tmp_path, mounts={tmp_path / "nope": "/opt/x"}))
    known = "bwrap, docker, kubernetes, none"
    with pytest.raises(ConfigError, match=f"unknown sandbox backend 'lxc': choose one of {known}"):
        backend("lxc")
    assert backend("none").name == "none"


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def sleepers(workdir: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if (
                entry.name.isdigit()
                and os.readlink(entry / "cwd") == workdir
                and (entry / "cmdline").read_bytes().startswith(b"/bin/sleep")
            ):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def gone(path: str) -> bool:
    return not Path(path).exists()
