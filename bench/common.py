"""What every benchmark in bench/ needs and none should write again: servers, a scratch database, CPU time
per turn, child processes (the inference consumer among them), percentiles and a one-line summary.

Import it from a sibling script (``python bench/x.py`` puts bench/ on ``sys.path``)::

    from common import note, servers, scratch_database, consumer, CpuMeter, summary

Servers: ``servers()`` yields TURNSTILE_DATABASE_URL and TURNSTILE_NATS_URL where set, else embedded
PostgreSQL and nats-server on free ports in a temporary directory, with the embedded ones' pids for CPU
accounting; ``scratch_database(url)`` a migrated database of the run's own, dropped at the end.

The summary line: every script ends with one or more ``SUMMARY <bench> <what>: ...`` lines (the figure, its
baseline from the same run, the ratio, the target and the load average), so that a round of all of them
is collected with ``grep ^SUMMARY``.

Run as a script, this module is the scripted inference consumer that ``consumer()`` starts::

    python bench/common.py consumer NATS_URL POLICY [PROFILE_FILE]
"""

from __future__ import annotations

import asyncio
import contextlib
import cProfile
import math
import os
import platform
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from sqlalchemy.engine import make_url

from pipeline.dev.embedded import EmbeddedNats, EmbeddedNatsCluster, EmbeddedPostgres, scratch_dir
from pipeline.log import AppendResult, EventStore
from pipeline.log.db import migrate
from pipeline.settings import libpq_url

READY_TIMEOUT_S = 60.0
COMMON = str(Path(__file__).resolve())
REPO = Path(COMMON).parent.parent

Processes = dict[str, int | None]
"""The processes whose CPU time a measurement reports: name -> pid (None: this process)."""


def note(message: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {message}", flush=True)


def load_average() -> str:
    """The 1, 5 and 15 minute load averages, as /proc/loadavg (or os.getloadavg) gives them."""
    return " ".join(f"{value:.2f}" for value in os.getloadavg())


def machine() -> str:
    """Python, CPUs and load: the line every run starts with, since other work skews every number."""
    return f"Python {platform.python_version()}, {os.cpu_count()} CPUs, load average {load_average()}"


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile, q in (0, 100]; nan for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = min(len(ordered), max(1, math.ceil(q / 100 * len(ordered))))
    return ordered[rank - 1]


def summary(
    bench: str, what: str, figure: str, baseline: str, ratio: float, target: str | None, met: bool = False
) -> None:
    """The line the lead greps (``^SUMMARY``): one figure beside its same-run baseline, as a ratio, and
    whether it meets its target (``target`` None: it has none)."""
    verdict = "no target" if target is None else f"target {target}: {'met' if met else 'NOT met'}"
    print(
        f"SUMMARY {bench} {what}: {ratio:.2f} ({figure} vs {baseline}); {verdict}; load {load_average()}",
        flush=True,
    )


# --- servers -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Servers:
    database_url: str
    nats_url: str
    pids: Processes
    """The embedded servers' pids by name (``postgres``, ``nats``), for CPU accounting."""


@contextlib.contextmanager
def postgres_server(tmp_dir: Path | None = None) -> Iterator[tuple[str, int | None]]:
    """TURNSTILE_DATABASE_URL's server (no pid), or an embedded one (its pid) that lives for the block.

    ``tmp_dir`` should be on a real disk where fsync matters (on tmpfs it is free)."""
    url = os.environ.get("TURNSTILE_DATABASE_URL")
    if url:
        yield url, None
        return
    with scratch_dir("turnstile-bench-", tmp_dir) as data_dir:
        server = EmbeddedPostgres(Path(data_dir) / "postgres")
        server.start()
        try:
            yield server.url, server.process.pid if server.process else None
        finally:
            server.stop()


@contextlib.contextmanager
def nats_server(tmp_dir: Path | None = None, nodes: int = 1) -> Iterator[tuple[str, int | None]]:
    """TURNSTILE_NATS_URL (no pid), or an embedded nats-server (its pid) for the block; with ``nodes`` > 1
    an embedded cluster with TASKS and BATCHES replicated (its URL names every node; pid None)."""
    url = os.environ.get("TURNSTILE_NATS_URL")
    if url:
        yield url, None
        return
    with scratch_dir("turnstile-bench-", tmp_dir) as data_dir:
        if nodes > 1:
            cluster = EmbeddedNatsCluster(Path(data_dir) / "nats", nodes)
            cluster.start()
            try:
                asyncio.run(cluster.replicate_streams())
                yield cluster.url, None
            finally:
                cluster.stop()
            return
        server = EmbeddedNats(Path(data_dir) / "nats")
        server.start()
        try:
            yield server.url, server.process.pid if server.process else None
        finally:
            server.stop()


@contextlib.contextmanager
def servers(tmp_dir: Path | None = None, *, nats_nodes: int = 1) -> Iterator[Servers]:
    """Both servers: the environment's where set, embedded ones (whose CPU time can be read) otherwise."""
    with (
        postgres_server(tmp_dir) as (database_url, postgres_pid),
        nats_server(tmp_dir, nats_nodes) as (
            nats_url,
            nats_pid,
        ),
    ):
        pids: Processes = {}
        if postgres_pid is not None:
            pids["postgres"] = postgres_pid
        if nats_pid is not None:
            pids["nats"] = nats_pid
        outside = [name for name, pid in (("postgres", postgres_pid), ("nats", nats_pid)) if pid is None]
        if outside:
            note(f"{', '.join(outside)} from the environment (CPU time not reported)")
        yield Servers(database_url, nats_url, pids)


@contextlib.contextmanager
def scratch_database(server_url: str) -> Iterator[str]:
    """A migrated database of this run's own on the server; dropped at the end."""
    name = f"bench_{uuid.uuid4().hex[:12]}"
    admin_url = libpq_url(server_url)
    with psycopg.connect(admin_url, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    try:
        url = libpq_url(make_url(admin_url).set(database=name).render_as_string(hide_password=False))
        migrate(url)
        yield url
    finally:
        with psycopg.connect(admin_url, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def checkpoint(connection: psycopg.Connection[Any]) -> None:
    """CHECKPOINT, so that no measurement pays for writing out the pages of the one before it."""
    try:
        connection.execute("CHECKPOINT")
    except psycopg.errors.InsufficientPrivilege:
        note("no CHECKPOINT between measurements (needs superuser or pg_checkpoint)")


# --- CPU time ------------------------------------------------------------------------------------


def proc_stat(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (Linux); None if the process is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None


def child_pids(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        with contextlib.suppress(OSError):
            found += [int(part) for part in task.read_text().split()]
    return found


def cpu_seconds(pid: int | None, children: bool = False) -> float | None:
    """User + system CPU time of a process (Linux /proc, 10 ms ticks), or of this one; None if unreadable.
    With ``children``, that of its live children and of those it has reaped too (PostgreSQL's backends)."""
    if pid is None:
        return time.process_time()
    fields = proc_stat(pid)
    if fields is None:
        return None
    ticks = int(fields[11]) + int(fields[12])
    if children:
        ticks += int(fields[13]) + int(fields[14])
        for child_pid in child_pids(pid):
            child_fields = proc_stat(child_pid)
            if child_fields is not None:
                ticks += int(child_fields[11]) + int(child_fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


class CpuMeter:
    """CPU time per unit of work (a turn) of each named process between ``start()`` and ``per(n)``.

    PostgreSQL is counted with its backends (a connection's work runs in a child of the postmaster)."""

    def __init__(self, processes: Processes) -> None:
        self.processes = processes
        self.before: dict[str, float | None] = {}

    def snapshot(self) -> dict[str, float | None]:
        return {name: cpu_seconds(pid, children=name == "postgres") for name, pid in self.processes.items()}

    def start(self) -> None:
        self.before = self.snapshot()

    def per(self, count: int) -> dict[str, float]:
        """Microseconds of CPU per unit since ``start()``, by process (those still readable)."""
        after = self.snapshot()
        return {
            name: ((after[name] or 0.0) - start) / max(count, 1) * 1e6
            for name, start in self.before.items()
            if start is not None and after[name] is not None
        }


class UnwrittenStore(EventStore):
    """An event store whose appends cost nothing: no event is validated, encoded or written, and each append
    answers at once with the positions and the version the stream would have. Reads are the real store's.

    For ablations only (``--unwritten`` in bench/episodes.py and bench/gateway.py): a path run on it costs
    what it would cost if recording were free, which is the least any store, however fast, could bring it
    to. Nothing it "appends" can be read back."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._versions: dict[str, int] = {}
        self._head = 0

    async def append(
        self,
        stream: str,
        events: Sequence[Any],
        expected_version: int | None = None,
        *,
        metadata: Any = None,
    ) -> AppendResult:
        version = self._versions.get(stream, 0) + len(events)
        self._versions[stream] = version
        first, self._head = self._head + 1, self._head + len(events)
        return AppendResult(stream, tuple(range(first, self._head + 1)), version)


def cpu_text(cpu_us: dict[str, float]) -> str:
    return "  ".join(f"{name} {value:,.0f}" for name, value in cpu_us.items())


@contextlib.contextmanager
def profiled(target: Path | None) -> Iterator[None]:
    """cProfile stats of the block written to ``target``; nothing when it is None. The clock is this
    process's CPU time, not the wall: on a shared machine, time spent preempted is not charged to whatever
    function happened to be running."""
    if target is None:
        yield
        return
    profiler = cProfile.Profile(time.process_time)
    profiler.enable()
    try:
        yield
    finally:
        profiler.disable()
        profiler.dump_stats(target)


# --- child processes -----------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def child(*argv: str, name: str = "child") -> AsyncIterator[tuple[int, str]]:
    """``python *argv`` in a process of its own that prints ``ready [words]`` once it serves; yields its pid
    and the words. It is told to stop by closing its stdin, so it also goes away if this process dies."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, *argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=REPO
    )
    assert process.stdout is not None
    try:
        line = await asyncio.wait_for(process.stdout.readline(), READY_TIMEOUT_S)
        if not line.startswith(b"ready"):
            raise RuntimeError(f"the {name} process did not start (exit status {await process.wait()})")
        yield process.pid, line.decode().removeprefix("ready").strip()
    finally:
        await stop_child(process, name)


async def stop_child(process: asyncio.subprocess.Process, name: str) -> None:
    if process.stdin is not None:
        process.stdin.close()
    try:
        await asyncio.wait_for(process.wait(), 30)
    except TimeoutError:
        process.kill()
        await process.wait()
    if process.returncode not in (0, -signal.SIGKILL):
        note(f"the {name} process exited with status {process.returncode}")


async def wait_for_stdin_eof() -> None:
    """What a child serves until: its parent closing the pipe (or dying)."""
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.buffer.read)


def consumer(
    nats_url: str, policy: str, profile: Path | None = None
) -> contextlib.AbstractAsyncContextManager[tuple[int, str]]:
    """An inference consumer over the instant ``ScriptedBackend`` in a process of its own, so it does not
    share the benchmark's event loop; yields its pid. ``profile``: cProfile stats of its whole life."""
    return child(COMMON, "consumer", nats_url, policy, *([str(profile)] if profile else []), name="consumer")


async def serve_consumer(nats_url: str, policy: str, profile: Path | None) -> None:
    from consumers.inference import InferenceConfig, create_app
    from pipeline.inference.backends.scripted import ScriptedBackend

    config = InferenceConfig(nats_url, policy, backend="scripted", consumer_id="bench-consumer")
    app, _ = create_app(config, ScriptedBackend())
    await app.start()
    print("ready", flush=True)
    with profiled(profile):
        await wait_for_stdin_eof()
    await app.stop()


def main(argv: Sequence[str]) -> int:
    if len(argv) in (3, 4) and argv[0] == "consumer":
        from consumers.runtime import run  # the event loop of `turnstile serve inference`

        run(serve_consumer(argv[1], argv[2], Path(argv[3]) if len(argv) == 4 else None))
        return 0
    print(f"usage: python {Path(COMMON).name} consumer NATS_URL POLICY [PROFILE_FILE]", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
