"""The one interface every sandbox backend implements (bubblewrap, Docker, Kubernetes, a bare process).

The harness (pipeline/harness) runs one agent CLI and then one verifier per rollout inside a sandbox. It only
ever talks to this interface: start a sandbox from a ``SandboxSpec``, run commands in it, copy files in and
out, stop it; and at start-up, ``sweep`` what a dead harness left behind. A backend owns everything else
(namespaces, containers, pods, how the gateway is reached from inside).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol


class SandboxError(Exception):
    """The sandbox itself failed (could not start, vanished, a copy failed): an infrastructure failure, never
    a reward. The message names the backend, what failed and what to do."""


@dataclass(frozen=True)
class SandboxSpec:
    """What a rollout's sandbox needs.

    ``workspace`` is a host directory the backend makes the sandbox's working directory (``/workspace``
    inside where the backend has its own file system). ``gateway`` is the host's ``host:port`` of the
    Turnstile gateway: the one address inside the sandbox may reach, as ``Sandbox.gateway_url``; with
    ``allow_internet`` false nothing else is reachable. ``mounts`` are host directories mounted read-only
    (the pre-built agent CLIs: never installed per sandbox), host path → path inside. ``environment`` is the
    task's ``environment/`` directory (a Dockerfile for image backends) or None. ``owner`` labels every
    resource the sandbox makes, so that ``sweep(owner)`` finds what a dead harness left."""

    workspace: Path
    gateway: str
    owner: str
    allow_internet: bool = False
    mounts: Mapping[Path, str] = field(default_factory=dict)
    environment: Path | None = None
    image: str | None = None
    memory_mib: int | None = None
    cpus: float | None = None


@dataclass(frozen=True)
class ExecResult:
    """A command's end: its exit code (None when it ran past its time limit and was killed) and output."""

    exit_code: int | None
    output: str
    seconds: float

    @property
    def timed_out(self) -> bool:
        return self.exit_code is None


class Sandbox(Protocol):
    """A started sandbox."""

    @property
    def gateway_url(self) -> str:
        """``http://host:port`` at which the gateway answers from inside this sandbox."""
        ...

    @property
    def workdir(self) -> str:
        """The working directory inside (where the workspace is)."""
        ...

    async def exec(
        self, argv: Sequence[str], *, env: Mapping[str, str], limit_s: float, cwd: str | None = None
    ) -> ExecResult:
        """Run ``argv`` inside with exactly ``env`` (nothing of the host's environment); after ``limit_s``
        seconds the sandbox kills it and every process it started."""
        ...

    async def copy_in(self, source: Path, target: str) -> None:
        """Copy a host file or directory to ``target`` inside."""
        ...

    async def copy_out(self, source: str, target: Path) -> None:
        """Copy ``source`` inside to a host path (a missing source raises ``FileNotFoundError``)."""
        ...

    async def stop(self) -> None:
        """Remove the sandbox and everything it made; safe to call twice."""
        ...


class SandboxBackend(Protocol):
    """A way to make sandboxes."""

    name: str

    async def start(self, spec: SandboxSpec) -> Sandbox:
        """A started sandbox, or ``SandboxError`` naming why not."""
        ...

    async def sweep(self, owner: str) -> int:
        """Remove every sandbox labelled ``owner`` whose harness is gone; how many were removed."""
        ...
