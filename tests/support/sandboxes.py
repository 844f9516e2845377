"""The sandbox contract: the assertions every backend of ``pipeline.harness.sandbox`` must pass.

Subclass ``SandboxContract`` once per backend and give it the fixtures ``backend_at`` (the backend keeping
its host state under a given folder), ``backend`` (that backend at ``sandbox_root``) and ``spec_for`` (a
``SandboxSpec`` for that backend from a workspace, the gateway's ``host:port`` and an owner: its image, its
mounts). ``sandbox_gateway`` and ``sandbox_root`` come from tests/integration/conftest.py; the sweep test
makes the same backend in another process with ``tests/support/sandbox_child.py``. The gateway is a real
``turnstile serve gateway``; what must stay unreachable is a real listener on the host's loopback, the
system PostgreSQL's port and an outside address.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from pipeline.harness.sandbox import Sandbox, SandboxBackend, SandboxError, SandboxSpec
from tests.support.waiting import wait_until

PROBE = """
import socket, sys, urllib.request
print("gateway", urllib.request.urlopen(sys.argv[1] + "/health", timeout=30).status)
for target in sys.argv[2:]:
    host, port = target.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=3).close()
        print("reached", target)
    except OSError as error:
        print("unreachable", target, type(error).__name__)
"""
"""Run inside: GET the gateway's /health, then try each ``host:port`` given."""

SpecFor = Callable[..., SandboxSpec]
BackendAt = Callable[[Path], SandboxBackend]


@contextlib.asynccontextmanager
async def host_listener() -> AsyncIterator[int]:
    """A TCP server on the host's loopback: what a sandbox must not reach."""
    server = await asyncio.start_server(lambda _reader, writer: writer.close(), "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()


def processes_with(marker: str) -> list[int]:
    """Host pids whose command line holds ``marker`` (a sandbox's processes run on the host's kernel)."""
    needle = marker.encode()
    found = []
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            if entry.name.isdigit() and needle in (entry / "cmdline").read_bytes().replace(b"\0", b" "):
                found.append(int(entry.name))
    return found


@contextlib.asynccontextmanager
async def started(backend: SandboxBackend, spec: SandboxSpec) -> AsyncIterator[Sandbox]:
    sandbox = await backend.start(spec)
    try:
        yield sandbox
    finally:
        await sandbox.stop()


class SandboxContract:
    async def test_a_command_runs_in_the_workspace_with_exactly_its_environment(
        self, backend: SandboxBackend, spec_for: SpecFor, tmp_path: Path, sandbox_gateway: str
    ) -> None:
        (tmp_path / "given.txt").write_text("from the host")
        async with started(backend, spec_for(tmp_path, sandbox_gateway, "contract")) as sandbox:
            result = await sandbox.exec(
                ["sh", "-c", "cat given.txt; echo; pwd; env; echo made > made.txt; exit 3"],
                env={"ONLY": "this"}, limit_s=120,
            )  # fmt: skip
            assert result.exit_code == 3, result.output
            lines = result.output.splitlines()
            assert lines[:2] == ["from the host", sandbox.workdir]
            names = {line.split("=", 1)[0] for line in lines[2:] if "=" in line}
            assert "ONLY=this" in lines
            assert names <= {"ONLY", "HOME", "PATH", "PWD", "SHLVL", "_", "HOSTNAME"}, names
            assert (tmp_path / "made.txt").read_text() == "made\n"

    async def test_the_gateway_answers_inside_and_nothing_else_does(
        self, backend: SandboxBackend, spec_for: SpecFor, tmp_path: Path, sandbox_gateway: str
    ) -> None:
        async with (
            host_listener() as port,
            started(backend, spec_for(tmp_path, sandbox_gateway, "contract")) as sandbox,
        ):
            targets = [f"127.0.0.1:{port}", "127.0.0.1:5432", "1.1.1.1:443", sandbox_gateway]
            result = await sandbox.exec(
                ["python3", "-c", PROBE, sandbox.gateway_url, *targets], env={}, limit_s=120
            )
        assert result.exit_code == 0, result.output
        assert "gateway 200" in result.output
        for target in targets:
            if target != sandbox.gateway_url.removeprefix("http://"):
                assert f"unreachable {target}" in result.output, result.output

    async def test_the_time_limit_ends_every_process_the_command_started(
        self, backend: SandboxBackend, spec_for: SpecFor, tmp_path: Path, sandbox_gateway: str
    ) -> None:
        marker = f"{4000 + uuid.uuid4().int % 1000}.{uuid.uuid4().int % 1000}"  # a sleep nobody else runs
        async with started(backend, spec_for(tmp_path, sandbox_gateway, "contract")) as sandbox:
            script = f"sleep {marker} & (setsid sleep {marker} &); echo started; sleep {marker}"
            result = await sandbox.exec(["sh", "-c", script], env={}, limit_s=3)
            assert result.timed_out
            assert "started" in result.output
            await wait_until(lambda: not processes_with(f"sleep {marker}"), 60, "the sandbox's sleeps to end")
            after = await sandbox.exec(["sh", "-c", "echo still usable"], env={}, limit_s=120)
            assert after.output.strip() == "still usable"

    async def test_files_copy_in_and_out(
        self, backend: SandboxBackend, spec_for: SpecFor, tmp_path: Path, sandbox_gateway: str
    ) -> None:
        workspace, host = tmp_path / "workspace", tmp_path / "host"
        workspace.mkdir()
        (host / "tests").mkdir(parents=True)
        (host / "tests" / "test.sh").write_text(
            "mkdir -p /logs/verifier && echo 1 > /logs/verifier/reward.txt\n"
        )
        async with started(backend, spec_for(workspace, sandbox_gateway, "contract")) as sandbox:
            await sandbox.copy_in(host / "tests", "/tests")
            result = await sandbox.exec(["sh", "/tests/test.sh"], env={}, limit_s=120)
            assert result.exit_code == 0, result.output
            await sandbox.copy_out("/logs/verifier/reward.txt", host / "reward.txt")
            assert (host / "reward.txt").read_text() == "1\n"
            with pytest.raises(FileNotFoundError):
                await sandbox.copy_out("/logs/verifier/reward.json", host / "reward.json")

    async def test_a_sandbox_that_cannot_start_is_a_sandbox_error_naming_why(
        self, backend: SandboxBackend, spec_for: SpecFor, tmp_path: Path, sandbox_gateway: str
    ) -> None:
        missing = tmp_path / "no-such-cli"
        spec = spec_for(tmp_path, sandbox_gateway, "contract", mounts={missing: "/opt/cli"})
        with pytest.raises(SandboxError, match=str(missing)):
            await backend.start(spec)

    async def test_a_host_failure_at_start_is_a_sandbox_error_naming_the_folder(
        self, backend_at: BackendAt, spec_for: SpecFor, tmp_path: Path, sandbox_gateway: str
    ) -> None:
        """Not an ``OSError`` that would end the harness and every other episode with it."""
        not_a_folder = tmp_path / "a-file"
        not_a_folder.write_text("")
        with pytest.raises(SandboxError, match=str(not_a_folder)):
            await backend_at(not_a_folder).start(spec_for(tmp_path, sandbox_gateway, "contract"))

    async def test_a_sandbox_under_a_deep_folder_reaches_the_gateway(
        self, backend_at: BackendAt, spec_for: SpecFor, tmp_path: Path, sandbox_gateway: str
    ) -> None:
        """The gateway's Unix socket lies in the sandbox's host folder, and a socket's path holds at most
        107 bytes: a ``TMPDIR`` as deep as pytest's ``tmp_path`` passed that under the harness's CLI."""
        deep = tmp_path / ("deep-folder-" * 8)
        assert len(str(deep / "sandbox-12345678/run/gateway.sock")) > 107
        async with started(backend_at(deep), spec_for(tmp_path, sandbox_gateway, "contract")) as sandbox:
            result = await sandbox.exec(["python3", "-c", PROBE, sandbox.gateway_url], env={}, limit_s=120)
        assert result.exit_code == 0, result.output
        assert "gateway 200" in result.output

    async def test_stop_removes_the_sandbox_and_may_be_called_twice(
        self, backend: SandboxBackend, spec_for: SpecFor, tmp_path: Path, sandbox_gateway: str
    ) -> None:
        sandbox = await backend.start(spec_for(tmp_path, sandbox_gateway, "contract"))
        await sandbox.stop()
        await sandbox.stop()
        with pytest.raises(SandboxError):
            await sandbox.exec(["true"], env={}, limit_s=60)

    async def test_sweep_removes_what_a_killed_harness_left_and_nothing_alive(
        self,
        backend: SandboxBackend,
        spec_for: SpecFor,
        tmp_path: Path,
        sandbox_gateway: str,
        sandbox_root: Path,
    ) -> None:
        owner = f"sweep-{uuid.uuid4().hex[:8]}"
        mine = await backend.start(
            spec_for(tmp_path, sandbox_gateway, owner)
        )  # same owner, live harness: kept
        child = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tests.support.sandbox_child", backend.name, str(sandbox_root), owner,
            str(tmp_path), sandbox_gateway, stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        try:
            assert child.stdout is not None
            line = await asyncio.wait_for(child.stdout.readline(), 300)
            assert line.startswith(b"ready"), line
            marker = f"sleep {line.split()[1].decode()}"
            await wait_until(lambda: len(processes_with(marker)) >= 2, 120, "both sandboxes' commands to run")
            os.kill(child.pid, signal.SIGKILL)
            await child.wait()
            assert await backend.sweep(owner) == 2
            await wait_until(lambda: not processes_with(marker), 60, "the killed harness's commands to end")
            assert await backend.sweep(owner) == 0
            still = await mine.exec(["echo", "alive"], env={}, limit_s=120)
            assert still.output.strip() == "alive"
        finally:
            with contextlib.suppress(ProcessLookupError):
                child.kill()
            await mine.stop()
