"""A sandbox's directory on the host, and the owner file that lets a later harness sweep it.

Backends that keep a sandbox's state in host directories (bubblewrap; Docker for its socket directory) make
one directory per sandbox under a root. It holds ``owner.json`` (the owner label, the harness's pid and that
process's start time, so a reused pid does not pass for the harness) and whatever the backend binds in.
``sweep`` removes the directories of an owner whose harness is gone, after killing any process still
running from them.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import posixpath
import shutil
import signal
import tarfile
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from pipeline.harness.sandbox import SandboxError

OWNER_FILE = "owner.json"


def default_root() -> Path:
    """Where sandbox directories go unless a backend is given a root: one folder under the system's temp."""
    return Path(tempfile.gettempdir()) / "turnstile-sandboxes"


def process_start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (``/proc/PID/stat`` field 22); None: it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # The command name (field 2) may hold spaces and parentheses: count fields after its last ')'.
    return int(stat.rsplit(")", 1)[1].split()[19])


@dataclass(frozen=True)
class Owner:
    label: str
    pid: int
    start_time: int | None

    @classmethod
    def current(cls, label: str) -> Owner:
        return cls(label, os.getpid(), process_start_time(os.getpid()))

    def alive(self) -> bool:
        """Whether the harness that made the directory still runs (the same process, not a reused pid)."""
        return self.start_time is not None and process_start_time(self.pid) == self.start_time


def check_sources(backend: str, spec_paths: list[Path]) -> None:
    """A ``SandboxError`` naming the first host path to bind (workspace, mounts) that does not exist."""
    for source in spec_paths:
        if not source.exists():
            raise SandboxError(f"{backend}: mount source {source} does not exist on the host")


@contextlib.contextmanager
def host_errors(backend: str, doing: str) -> Iterator[None]:
    """An ``OSError`` of the host while ``doing`` (a folder that cannot be made, a full disk, a socket that
    cannot listen) as a ``SandboxError``: an infrastructure failure of one episode, retried, not a crash of
    the harness with every other episode's sandbox."""
    try:
        yield
    except OSError as error:
        raise SandboxError(f"{backend}: {doing} failed: {error}") from error


def make_sandbox_dir(root: Path, owner: str) -> Path:
    """A new directory for one sandbox, its owner file written before anything else goes in."""
    root.mkdir(parents=True, exist_ok=True)
    directory = Path(tempfile.mkdtemp(prefix="sandbox-", dir=root))
    me = Owner.current(owner)
    (directory / OWNER_FILE).write_text(
        json.dumps({"owner": me.label, "pid": me.pid, "start": me.start_time})
    )
    return directory


def read_owner(directory: Path) -> Owner | None:
    """The directory's owner, or None when it has no readable owner file (not a sandbox of ours)."""
    try:
        data = json.loads((directory / OWNER_FILE).read_text())
        return Owner(str(data["owner"]), int(data["pid"]), data["start"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def processes_using(directory: Path) -> list[int]:
    """Pids whose command line names ``directory`` (a bwrap, a forwarder started for that sandbox)."""
    needle = os.fsencode(str(directory))
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if needle in (entry / "cmdline").read_bytes():
                pids.append(int(entry.name))
    return pids


def remove_sandbox_dir(directory: Path) -> None:
    """Kill what still runs from the directory, then remove it; files the sandbox made read-only included."""
    for pid in processes_using(directory):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)

    def writable_then_retry(function: object, path: str, _: object) -> None:
        with contextlib.suppress(OSError):
            os.chmod(os.path.dirname(path), 0o700)
            os.chmod(path, 0o700)
        if callable(function):
            with contextlib.suppress(FileNotFoundError):
                function(path)

    shutil.rmtree(directory, onerror=writable_then_retry)


def sweep_dirs(root: Path, owner: str) -> int:
    """Remove every sandbox directory under ``root`` of ``owner`` whose harness is gone; how many."""
    if not root.is_dir():
        return 0
    removed = 0
    for directory in root.iterdir():
        found = read_owner(directory)
        if found is None or found.label != owner or found.alive():
            continue
        remove_sandbox_dir(directory)
        removed += 1
    return removed


def tar_as(source: Path, inside: str) -> bytes:
    """A tar of ``source`` whose entries are named by the absolute path ``inside``, for extraction at / (the
    missing folders above it are made)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        tar.add(source, arcname=inside.lstrip("/"))
    return buffer.getvalue()


def extract_as(data: bytes, target: Path) -> None:
    """A tar with one top-level entry (what ``docker cp`` and ``tar -C parent name`` give) extracted as
    ``target``; the ``data`` filter keeps links and paths inside it."""
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        members = tar.getmembers()
        top = members[0].name.split("/", 1)[0]
        for member in members:
            member.name = posixpath.join(target.name, member.name[len(top) :].lstrip("/"))
        target.parent.mkdir(parents=True, exist_ok=True)
        tar.extractall(target.parent, members=members, filter="data")
