"""Sandboxes as Docker containers, driven through the ``docker`` CLI.

Why the CLI and not the ``docker`` PyPI package: every call here is a subprocess the harness awaits
(asyncio, no thread pool around a blocking client), ``docker cp`` and ``docker build`` already do the tar
and builder work, it is the tool users debug with, and it adds no dependency.

A sandbox is two containers, both labelled ``turnstile.owner=<owner>`` (and the harness's pid):

- the *network* container runs ``forwarder.py`` on the host's Python (``/usr`` bound read-only into a tiny
  image this module imports once, ``turnstile-hostroot``): ``--network none`` (or the default bridge with
  ``allow_internet``), listening on ``127.0.0.1:<gateway port>`` and relaying to a Unix socket on the host
  that connects to the gateway (see ``forwarder``);
- the *sandbox* container, from the task's image (``spec.image``, or built from ``spec.environment``'s
  Dockerfile), joins that container's network namespace (``--network container:...``): its only
  interface is that loopback, where the gateway answers and nothing else does. It runs ``sleep infinity``
  under ``--init``; commands are ``docker exec``. ``/workspace`` is the workspace bound read-write.

Time limit: ``docker exec`` cannot kill what it started, so past the limit the sandbox container is
restarted (``docker restart -t 0``: every process in it killed, its files kept). Memory and CPUs:
``--memory``/``--cpus``, enforced by the engine. The engine must run on this host (the workspace and the
socket are bind-mounted).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import io
import os
import posixpath
import tarfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from pipeline.harness.backends import forwarder, hostdirs, hostroot
from pipeline.harness.backends.commands import kill_process, run_limited
from pipeline.harness.sandbox import ExecResult, SandboxError, SandboxSpec

WORKDIR = "/workspace"
RUN = "/run/turnstile"
HOSTROOT_IMAGE = "turnstile-hostroot:2"
LABEL = "turnstile.owner"


async def docker(*args: str, stdin: bytes | None = None, env: Mapping[str, str] | None = None) -> bytes:
    """``docker ARGS``'s stdout; a failure is a ``SandboxError`` with docker's own message."""
    try:
        process = await asyncio.create_subprocess_exec(
            "docker", *args,
            stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            env=None if env is None else {**os.environ, **env},
        )  # fmt: skip
    except FileNotFoundError as error:
        raise SandboxError(
            "docker: the `docker` CLI is not on PATH (Debian: apt-get install docker.io)"
        ) from error
    out, err = await process.communicate(stdin)
    if process.returncode != 0:
        raise SandboxError(f"docker {args[0]} failed: {err.decode(errors='replace').strip()}")
    return out


def _hostroot_tar() -> bytes:
    """An image's root file system that is only mount points and the host's /usr symlinks."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        # /sbin a folder of its own, not the host's symlink into the read-only /usr: Docker's --init binds
        # its docker-init at /sbin/docker-init.
        entries = [(path, target) for path, target in hostroot.system_layout() if path != "/sbin"]
        folders = ("etc", "tmp", "run", "workspace", "proc", "dev", "sys", "sbin")
        entries += [(f"/{name}", None) for name in folders]
        for path, target in entries:
            info = tarfile.TarInfo(path.lstrip("/"))
            if target:
                info.type, info.linkname = tarfile.SYMTYPE, target
            else:
                info.type, info.mode = tarfile.DIRTYPE, 0o1777 if path == "/tmp" else 0o755
            tar.addfile(info)
    return buffer.getvalue()


async def hostroot_image() -> str:
    """``turnstile-hostroot``, imported once: nothing in it, the host's system folders bound at run."""
    with contextlib.suppress(SandboxError):
        await docker("image", "inspect", HOSTROOT_IMAGE)
        return HOSTROOT_IMAGE
    await docker("import", "-", HOSTROOT_IMAGE, stdin=_hostroot_tar())
    return HOSTROOT_IMAGE


async def image_for(spec: SandboxSpec) -> str:
    """The spec's image, or one built from its environment's Dockerfile (tagged by the folder's content, so a
    task's image is built once)."""
    if spec.image:
        return spec.image
    if spec.environment is None:
        raise SandboxError("docker: the task has neither an image nor an environment/Dockerfile")
    tag = f"turnstile-env:{await asyncio.to_thread(_content_digest, spec.environment)}"
    with contextlib.suppress(SandboxError):
        await docker("image", "inspect", tag)
        return tag
    await docker("build", "-q", "-t", tag, str(spec.environment))
    return tag


def _content_digest(environment: Path) -> str:
    """16 hex digits of the folder's file names and contents: a changed Dockerfile or file, a new image."""
    if not (environment / "Dockerfile").is_file():
        raise SandboxError(f"docker: {environment} has no Dockerfile (and the task no image)")
    digest = hashlib.sha256()
    for path in sorted(p for p in environment.rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(environment)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


class DockerSandbox:
    """A started sandbox: its two containers, its host directory (the gateway's socket), its socket server."""

    def __init__(self, spec: SandboxSpec, directory: Path, port: int) -> None:
        self.spec = spec
        self.directory = directory
        self.port = port
        self.server: asyncio.Server | None = None
        self.name = f"turnstile-{directory.name}"
        self.stopped = False

    @property
    def gateway_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def workdir(self) -> str:
        return WORKDIR

    def labels(self, role: str) -> list[str]:
        owner = hostdirs.read_owner(self.directory)
        assert owner is not None
        return [
            "--label", f"{LABEL}={owner.label}", "--label", f"turnstile.pid={owner.pid}",
            "--label", f"turnstile.start={owner.start_time}", "--label", f"turnstile.role={role}",
            "--label", f"turnstile.dir={self.directory}",
        ]  # fmt: skip

    async def create(self, image: str) -> None:
        """The network container, then the sandbox container in its network namespace."""
        forward = forwarder.inside_command(
            hostroot.interpreter(), RUN, self.port, ["PATH"], ["sleep", "infinity"]
        )
        system = [arg for path in hostroot.real_folders() for arg in ("-v", f"{path}:{path}:ro")]
        network = "bridge" if self.spec.allow_internet else "none"
        await docker(
            "run", "-d", "--name", f"{self.name}-net", *self.labels("network"), "--network", network,
            "-e", "PATH=/usr/bin:/bin", *system, "-v", f"{self.directory / 'run'}:{RUN}:ro",
            await hostroot_image(), *forward,
        )  # fmt: skip
        limits = []
        if self.spec.memory_mib is not None:
            limits += ["--memory", f"{self.spec.memory_mib}m", "--memory-swap", f"{self.spec.memory_mib}m"]
        if self.spec.cpus is not None:
            limits += ["--cpus", str(self.spec.cpus)]
        mounts = [
            arg for source, target in self.spec.mounts.items() for arg in ("-v", f"{source}:{target}:ro")
        ]
        await docker(
            "run", "-d", "--name", self.name, *self.labels("sandbox"),
            "--network", f"container:{self.name}-net", "--init", "--entrypoint", "",
            "-v", f"{self.spec.workspace}:{WORKDIR}", "-w", WORKDIR,
            *mounts, *limits, image, "sleep", "infinity",
        )  # fmt: skip

    async def exec(
        self, argv: Sequence[str], *, env: Mapping[str, str], limit_s: float, cwd: str | None = None
    ) -> ExecResult:
        if self.stopped:
            raise SandboxError("docker: exec on a stopped sandbox")
        # Values go through the docker client's environment (-e NAME), not its command line, which every
        # user of the host can read.
        names = [arg for key in env for arg in ("-e", key)]
        argv_ = ["docker", "exec", "-w", cwd or WORKDIR, *names, self.name, *argv]

        async def restart(process: asyncio.subprocess.Process) -> None:
            await kill_process(process)
            await docker("restart", "-t", "0", self.name)

        return await run_limited(argv_, limit_s=limit_s, on_timeout=restart, env={**os.environ, **env})

    async def copy_in(self, source: Path, target: str) -> None:
        """A tar of ``source`` named by ``target``'s path from /, so that docker makes the missing folders."""
        inside = posixpath.normpath(posixpath.join(WORKDIR, target))
        await docker(
            "cp", "-", f"{self.name}:/", stdin=await asyncio.to_thread(hostdirs.tar_as, source, inside)
        )

    async def copy_out(self, source: str, target: Path) -> None:
        inside = posixpath.normpath(posixpath.join(WORKDIR, source))
        try:
            data = await docker("cp", f"{self.name}:{inside}", "-")
        except SandboxError as error:
            if "Could not find the file" in str(error) or "No such container:path" in str(error):
                raise FileNotFoundError(f"{source} does not exist inside the sandbox") from error
            raise
        await asyncio.to_thread(hostdirs.extract_as, data, target)

    async def stop(self) -> None:
        if self.stopped:
            return
        self.stopped = True
        if self.server is not None:
            self.server.close()
        with contextlib.suppress(SandboxError):
            await docker("rm", "-f", "-v", self.name, f"{self.name}-net")
        await asyncio.to_thread(hostdirs.remove_sandbox_dir, self.directory)


class DockerBackend:
    """Sandboxes on the local Docker engine; host directories (the gateway's socket) under ``root``."""

    name = "docker"

    def __init__(self, root: Path | None = None) -> None:
        self.root = root or hostdirs.default_root()

    async def start(self, spec: SandboxSpec) -> DockerSandbox:
        hostdirs.check_sources(self.name, [spec.workspace, *spec.mounts])
        host, _, port = spec.gateway.rpartition(":")
        if not host or not port.isdigit():
            raise SandboxError(f"docker: gateway {spec.gateway!r} is not host:port (e.g. 127.0.0.1:8000)")
        image = await image_for(spec)
        with hostdirs.host_errors(self.name, f"making the sandbox's directory under {self.root}"):
            directory = hostdirs.make_sandbox_dir(self.root, spec.owner)
        sandbox = DockerSandbox(spec, directory, int(port))
        try:
            with hostdirs.host_errors(self.name, f"listening for the gateway in {directory}"):
                forwarder.install(directory / "run")
                sandbox.server = await forwarder.serve_gateway_socket(
                    directory / "run" / forwarder.SOCKET, host.strip("[]"), int(port)
                )
            await sandbox.create(image)
        except BaseException:
            await sandbox.stop()
            raise
        return sandbox

    async def sweep(self, owner: str) -> int:
        """Remove the containers of ``owner`` whose harness is gone, then their host directories."""
        columns = " ".join(f'{{{{.Label "turnstile.{name}"}}}}' for name in ("role", "pid", "start"))
        listed = await docker(
            "ps", "-a", "--filter", f"label={LABEL}={owner}", "--format", "{{.ID}} " + columns
        )
        dead, sandboxes = [], 0
        for line in listed.decode().splitlines():
            container, role, pid, start = line.split()
            if not hostdirs.Owner(owner, int(pid), None if start == "None" else int(start)).alive():
                dead.append(container)
                sandboxes += role == "sandbox"
        if dead:
            await docker("rm", "-f", "-v", *dead)
        await asyncio.to_thread(hostdirs.sweep_dirs, self.root, owner)
        return sandboxes
