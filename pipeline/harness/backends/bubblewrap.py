"""Sandboxes with Debian's ``bwrap`` (bubblewrap): namespaces, no daemon, no image.

Each command runs in a fresh ``bwrap`` with the same binds, so the sandbox's state is its host directories:

- ``/usr`` (and ``/bin``, ``/lib*``, ``/sbin`` as on the host), ``/etc`` (copies of the few host entries
  programs need, one folder: ``sandbox_etc``), the pre-built agent CLIs (``spec.mounts``): read-only;
- ``/workspace``: the task's workspace, read-write; ``/tmp``, ``/home/sandbox`` (HOME), ``/logs`` and any
  other top-level folder ``copy_in`` makes: folders of the sandbox's own host directory, read-write;
- every namespace unshared (pid, ipc, uts, cgroup, user, net), ``--die-with-parent``, ``--new-session``.

Network: with ``allow_internet`` false the sandbox has only its own loopback. The gateway answers there at
``127.0.0.1:<gateway port>`` through ``forwarder`` (see there: Debian's socat inside where installed,
else a Python script); nothing else on the host or outside is reachable. With ``allow_internet`` the
sandbox shares the host's network (and so also the host's loopback services: PostgreSQL, NATS) and
reaches the gateway at its own address.

Time limit: SIGKILL to the outer ``bwrap`` ends the sandbox's pid namespace (``--die-with-parent`` kills its
init, and the kernel every process under it). Memory and CPUs: ``systemd-run --user --scope`` where a user
systemd manager answers, else not enforced (logged once). ``sweep`` removes what a dead harness left (see
``hostdirs``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import posixpath
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path

from pipeline.harness.backends import forwarder, hostdirs, hostroot
from pipeline.harness.backends.commands import kill_process, run_limited
from pipeline.harness.backends.sandbox_etc import prepared_etc
from pipeline.harness.sandbox import ExecResult, SandboxError, SandboxSpec

log = logging.getLogger(__name__)

WORKDIR = "/workspace"
HOME = "/home/sandbox"
RUN = "/run/turnstile"
"""Inside: the gateway's Unix socket and the forwarder script (read-only)."""
STATE_FOLDERS = ("tmp", "home", "logs")
"""Top-level folders every sandbox has, kept in its host directory under ``root/``."""
RESERVED = {"etc", "proc", "dev", "run", "workspace"} | {p[1:] for p in hostroot.SYSTEM}


def _system_binds() -> list[str]:
    args: list[str] = []
    for path, target in hostroot.system_layout():
        args += ["--symlink", target, path] if target else ["--ro-bind", path, path]
    return args


_scope_works: bool | None = None


async def _limits_prefix(spec: SandboxSpec) -> list[str]:
    """``systemd-run --user --scope`` with the spec's memory and CPU limits, when asked for and available."""
    global _scope_works
    if spec.memory_mib is None and spec.cpus is None:
        return []
    if _scope_works is None:
        _scope_works = await _probe_scope()
        if not _scope_works:
            log.warning("bubblewrap: no user systemd manager answers: memory and CPU limits are NOT enforced")
    if not _scope_works:
        return []
    prefix = ["systemd-run", "--user", "--scope", "--quiet", "--collect"]
    if spec.memory_mib is not None:
        prefix += ["-p", f"MemoryMax={spec.memory_mib}M", "-p", "MemorySwapMax=0"]
    if spec.cpus is not None:
        prefix += ["-p", f"CPUQuota={round(spec.cpus * 100)}%"]
    return [*prefix, "--"]


async def _probe_scope() -> bool:
    if shutil.which("systemd-run") is None:
        return False
    probe = await asyncio.create_subprocess_exec(
        "systemd-run", "--user", "--scope", "--quiet", "true",
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    return await probe.wait() == 0


def _split_gateway(gateway: str) -> tuple[str, int]:
    host, _, port = gateway.rpartition(":")
    if not host or not port.isdigit():
        raise SandboxError(f"bubblewrap: gateway {gateway!r} is not host:port (e.g. 127.0.0.1:8000)")
    return host.strip("[]"), int(port)


class BubblewrapSandbox:
    """One started sandbox: its host directory, its gateway socket, the commands running in it."""

    def __init__(self, spec: SandboxSpec, directory: Path, limits: list[str], socat: bool, etc: Path) -> None:
        self.spec = spec
        self.socat = socat
        self.etc = etc
        self.directory = directory
        self.limits = limits
        self.host, self.port = _split_gateway(spec.gateway)
        self.server: asyncio.Server | None = None
        self.running: set[asyncio.subprocess.Process] = set()
        self.stopped = False

    @property
    def gateway_url(self) -> str:
        return f"http://{self.spec.gateway}" if self.spec.allow_internet else f"http://127.0.0.1:{self.port}"

    @property
    def workdir(self) -> str:
        return WORKDIR

    @property
    def socket_dir(self) -> Path:
        return self.directory / "run"

    async def open(self) -> None:
        """Lay out the host directory and listen for the gateway."""
        for folder in STATE_FOLDERS:
            (self.directory / "root" / folder).mkdir(parents=True)
        (self.directory / "root" / HOME.lstrip("/")).mkdir()
        forwarder.install(self.socket_dir)
        if not self.spec.allow_internet:
            socket_path = self.socket_dir / forwarder.SOCKET
            self.server = await forwarder.serve_gateway_socket(socket_path, self.host, self.port)

    def _binds(self) -> list[str]:
        args = [*_system_binds(), "--proc", "/proc", "--dev", "/dev", "--ro-bind", str(self.etc), "/etc"]
        if self.spec.allow_internet:
            args += ["--ro-bind-try", "/etc/resolv.conf", "/etc/resolv.conf"]
        args += ["--bind", str(self.spec.workspace), WORKDIR, "--ro-bind", str(self.socket_dir), RUN]
        for folder in sorted((self.directory / "root").iterdir()):
            args += ["--bind", str(folder), f"/{folder.name}"]  # /home too: HOME and any other user's
        for source, target in self.spec.mounts.items():
            args += ["--ro-bind", str(source), target]
        return args

    def _argv(
        self, argv: Sequence[str], env: Mapping[str, str], cwd: str | None, fds: tuple[int, int]
    ) -> list[str]:
        """bwrap's command line; the environment goes through ``fds[0]`` (``--args``), not the command line,
        where every user of the host could read the session's key."""
        network = ["--share-net"] if self.spec.allow_internet else []
        command = list(argv)
        if not self.spec.allow_internet and self.socat:
            command = forwarder.socat_command(RUN, self.port, command)
        elif not self.spec.allow_internet:
            keys = list({"HOME": "", "PATH": "", **env})
            command = forwarder.inside_command(hostroot.interpreter(), RUN, self.port, keys, command)
        return [
            *self.limits,
            "bwrap", "--unshare-all", *network, "--die-with-parent", "--new-session",
            "--hostname", "sandbox", "--json-status-fd", str(fds[1]), "--args", str(fds[0]),
            *self._binds(), "--chdir", cwd or WORKDIR, "--",  *command,
        ]  # fmt: skip

    async def exec(
        self, argv: Sequence[str], *, env: Mapping[str, str], limit_s: float, cwd: str | None = None
    ) -> ExecResult:
        if self.stopped:
            raise SandboxError("bubblewrap: exec on a stopped sandbox")
        # bwrap writes {"child-pid": N} to this pipe once the sandbox is set up: without it, bwrap itself
        # failed (a missing mount source, no user namespaces): the output is bwrap's error, not the command's.
        status_read, status_write = os.pipe()
        environment = _environment_fd(env)
        try:
            result = await run_limited(
                self._argv(argv, env, cwd, (environment, status_write)),
                limit_s=limit_s,
                on_timeout=kill_process,
                pass_fds=(environment, status_write),
            )
        finally:
            os.close(environment)
            os.close(status_write)
            with os.fdopen(status_read, "rb") as status:
                started = b"child-pid" in status.read()
        if not started:
            raise SandboxError(f"bubblewrap could not start the sandbox: {result.output.strip()}")
        return result

    def host_path(self, inside: str) -> Path:
        """The host file behind a path inside; a read-only or unknown place is a ``SandboxError``."""
        path = posixpath.normpath(posixpath.join(WORKDIR, inside))
        parts = path.strip("/").split("/", 1)
        rest = parts[1] if len(parts) > 1 else ""
        if parts[0] == "workspace":
            return self.spec.workspace / rest
        read_only = [
            t for t in self.spec.mounts.values() if path == t or path.startswith(t.rstrip("/") + "/")
        ]
        if parts[0] == "home" and rest and not read_only:  # /home is the sandbox's own (HOME is in it)
            return self.directory / "root" / "home" / rest
        if not parts[0] or parts[0] in RESERVED or parts[0] == "home" or read_only:
            raise SandboxError(
                f"bubblewrap: {inside!r} is read-only inside the sandbox; copy under /workspace"
            )
        return self.directory / "root" / path.strip("/")

    async def copy_in(self, source: Path, target: str) -> None:
        await asyncio.to_thread(_copy, source, self.host_path(target))

    async def copy_out(self, source: str, target: Path) -> None:
        host = self.host_path(source)
        if not host.exists() and not host.is_symlink():
            raise FileNotFoundError(f"{source} does not exist inside the sandbox")
        await asyncio.to_thread(_copy, host, target)

    async def stop(self) -> None:
        if self.stopped:
            return
        self.stopped = True
        if self.server is not None:
            self.server.close()
        await asyncio.to_thread(hostdirs.remove_sandbox_dir, self.directory)


def _environment_fd(env: Mapping[str, str]) -> int:
    """A memory file of bwrap arguments (NUL-separated): exactly ``env``, plus HOME and PATH if unset."""
    environment = {"HOME": HOME, "PATH": "/usr/local/bin:/usr/bin:/bin", **env}
    args = ["--clearenv", *[arg for key, value in environment.items() for arg in ("--setenv", key, value)]]
    fd = os.memfd_create("bwrap-args")
    os.write(fd, b"".join(os.fsencode(arg) + b"\0" for arg in args))
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _copy(source: Path, target: Path) -> None:
    """A file or a tree; symlinks copied as links, never followed (one could point anywhere on the host)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    if source.is_dir() and not source.is_symlink():
        shutil.copytree(source, target, symlinks=True, dirs_exist_ok=True)
    else:
        shutil.copy2(source, target, follow_symlinks=False)


class BubblewrapBackend:
    """Sandboxes under ``root`` (one host directory each); see the module's docstring."""

    name = "bubblewrap"

    def __init__(self, root: Path | None = None, *, socat: bool | None = None) -> None:
        """``socat``: the inside forwarder is Debian's socat (True), the Python script (False), or socat
        where it is installed (None)."""
        self.root = root or hostdirs.default_root()
        self.socat = shutil.which("socat") is not None if socat is None else socat
        self.proven = False
        self.etc: Path | None = None
        """The folder bound as every sandbox's /etc (``sandbox_etc``), made at the first start."""

    async def _prove(self, sandbox: BubblewrapSandbox) -> None:
        """One command in the backend's first sandbox: where bwrap cannot work at all (no user namespaces,
        a seccomp policy), the first start says so rather than the first agent. Not repeated per sandbox: a
        second bwrap would double every start; a later failure is still a ``SandboxError`` from ``exec``."""
        probe = await sandbox.exec(["true"], env={}, limit_s=60)
        if probe.exit_code != 0:
            raise SandboxError(f"bubblewrap: the sandbox's first command failed: {probe.output.strip()}")
        self.proven = True

    async def start(self, spec: SandboxSpec) -> BubblewrapSandbox:
        if shutil.which("bwrap") is None:
            raise SandboxError(
                "bubblewrap: `bwrap` is not on PATH: install it (Debian: apt-get install bubblewrap)"
            )
        hostdirs.check_sources(self.name, [spec.workspace, *spec.mounts])
        if self.etc is None:
            with hostdirs.host_errors(self.name, f"copying what sandboxes need of /etc under {self.root}"):
                self.etc = await asyncio.to_thread(prepared_etc, self.root)
        with hostdirs.host_errors(self.name, f"making the sandbox's directory under {self.root}"):
            directory = hostdirs.make_sandbox_dir(self.root, spec.owner)
        sandbox = BubblewrapSandbox(spec, directory, await _limits_prefix(spec), self.socat, self.etc)
        try:
            with hostdirs.host_errors(self.name, f"preparing the sandbox in {directory}"):
                await sandbox.open()
            if not self.proven:
                await self._prove(sandbox)
        except BaseException:
            await sandbox.stop()
            raise
        return sandbox

    async def sweep(self, owner: str) -> int:
        return await asyncio.to_thread(hostdirs.sweep_dirs, self.root, owner)
