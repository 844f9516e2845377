"""``--sandbox none``: a temporary directory and a process group per command. It isolates NOTHING.

The agent and the verifier run as the harness's own user, on the host's file system and network, with the
host's gateway URL. What it does give: a fresh directory per rollout (``workspace/``, ``home/``, ``tests/``,
``logs/`` under one temp directory), the environment exactly as given (nothing of the harness's), every
command in a process group of its own that is killed at its time limit and when it ends, and a ``sweep`` that
kills what a dead harness left running and removes its directories. For tests, benchmarks and trusted agents
on your own machine; use ``bwrap``, ``docker`` or ``kubernetes`` for anything else.

Paths inside this sandbox are host paths: the sandbox's root is its temp directory, so what another backend
has at ``/tests`` is ``<root>/tests`` here, and a read-only mount's target ``/opt/x`` is a symlink
``<root>/opt/x`` to the host directory.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from pipeline.harness.sandbox import ExecResult, SandboxError, SandboxSpec

OUTPUT_LIMIT = 256 * 1024
"""Bytes of a command's output kept (its end: where the error is)."""


def sandboxes_root() -> Path:
    """Where the sandboxes live: ``$TMPDIR/turnstile-sandboxes`` (one directory per owner below it)."""
    return Path(tempfile.gettempdir()) / "turnstile-sandboxes"


class ProcessSandbox:
    """A started process sandbox: its directory, and the process groups of commands running in it."""

    def __init__(self, root: Path, gateway: str) -> None:
        self.root = root
        self._gateway = gateway

    @property
    def gateway_url(self) -> str:
        return f"http://{self._gateway}"

    @property
    def workdir(self) -> str:
        return str(self.root / "workspace")

    async def exec(
        self, argv: Sequence[str], *, env: Mapping[str, str], limit_s: float, cwd: str | None = None
    ) -> ExecResult:
        started = time.monotonic()
        try:
            process = await asyncio.create_subprocess_exec(
                *argv, cwd=cwd or self.workdir, env=dict(env), start_new_session=True,
                stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
            )  # fmt: skip
        except OSError as error:
            return ExecResult(127, f"cannot run {argv[0]!r}: {error.strerror}", time.monotonic() - started)
        assert process.stdout is not None
        reading = asyncio.ensure_future(process.stdout.read())
        timed_out = False
        try:
            await asyncio.wait_for(process.wait(), limit_s)
        except TimeoutError:
            timed_out = True
        except BaseException:  # cancelled (Ctrl-C): nothing of it may outlive the harness's wait
            _kill_group(process.pid)
            reading.cancel()
            raise
        _kill_group(process.pid)  # what it left running in the background, or all of it at the limit
        code = await process.wait()
        output = (await reading)[-OUTPUT_LIMIT:].decode(errors="replace")
        return ExecResult(None if timed_out else code, output, time.monotonic() - started)

    async def copy_in(self, source: Path, target: str) -> None:
        await asyncio.to_thread(_copy, source, Path(target))

    async def copy_out(self, source: str, target: Path) -> None:
        await asyncio.to_thread(_copy, Path(source), target)

    async def stop(self) -> None:
        await asyncio.to_thread(_remove, self.root)


class ProcessBackend:
    """Sandboxes as temp directories under ``sandboxes_root()/<owner>/``."""

    name = "none"

    def __init__(self, root: Path | None = None) -> None:
        self.root = root or sandboxes_root()

    async def start(self, spec: SandboxSpec) -> ProcessSandbox:
        for host in spec.mounts:
            if not host.is_dir():
                raise SandboxError(f"sandbox 'none': the mount source {host} is not a directory")
        try:
            owned = self.root / spec.owner
            owned.mkdir(parents=True, exist_ok=True)
            root = Path(tempfile.mkdtemp(dir=owned))
            shutil.copytree(spec.workspace, root / "workspace")
            for host, inside in spec.mounts.items():
                link = root / inside.lstrip("/")
                link.parent.mkdir(parents=True, exist_ok=True)
                link.symlink_to(host.resolve(), target_is_directory=True)
        except OSError as error:
            raise SandboxError(
                f"sandbox 'none' could not make its directory under {self.root}: {error} "
                "(is TMPDIR writable and not full?)"
            ) from None
        return ProcessSandbox(root, spec.gateway)

    async def sweep(self, owner: str) -> int:
        """Every sandbox of ``owner``: the caller holds the owner's lock, so their harness is gone."""
        owned = self.root / owner
        left = sorted(owned.iterdir()) if owned.is_dir() else []
        for directory in left:
            _remove(directory)
        return len(left)


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _processes_in(directory: Path) -> Iterator[int]:
    """Ids of this user's processes whose working directory is in ``directory`` (what a command started
    there, and what it left running, even after its harness died)."""
    inside = str(directory.resolve()) + os.sep
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if (os.readlink(entry / "cwd") + os.sep).startswith(inside):
                    yield int(entry.name)


def _remove(root: Path) -> None:
    """Kill the process groups still working in ``root``, then remove it."""
    for pid in list(_processes_in(root)):
        with contextlib.suppress(ProcessLookupError):
            group = os.getpgid(pid)
            if group != os.getpgrp():
                _kill_group(group)
    shutil.rmtree(root, ignore_errors=True)


def _copy(source: Path, target: Path) -> None:
    if not source.exists():
        raise FileNotFoundError(source)
    target.parent.mkdir(parents=True, exist_ok=True)
    if source.is_dir():
        shutil.copytree(source, target, dirs_exist_ok=True, symlinks=True)
    else:
        shutil.copy2(source, target)
