"""The harness's costs. ``--sandbox-start``: a sandbox's start-to-first-command overhead per backend.

For each backend: ``backend.start(spec)`` then ``sandbox.exec(["true"])`` (the first command), timed
together, ``--runs`` times; ``stop`` is not counted. Baseline, measured in the same run: a bare
``bwrap --ro-bind / / true`` (a process in a mount namespace and nothing else). The ratio is the backend's
median over the baseline's. Target: bubblewrap at most 50 ms median. Docker runs where ``docker info``
answers, else it says so.

    python bench/harness.py --sandbox-start [--runs 30]   (or bench/sandbox_start.py --sandbox-start)
    python bench/harness.py --sandbox-start --stages      where bubblewrap's first command spends its time

``--stages`` runs plain ``bwrap`` command lines that add one part of the backend's first command at a time
(namespaces, the network namespace, the binds with /etc entry by entry as before ``sandbox_etc``, the binds
as they are, then the real first command with its forwarder), interleaved run by run; each figure is a
median of its own, read against the bare one of the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from pipeline.harness.backends import hostroot
from pipeline.harness.backends.bubblewrap import BubblewrapBackend, BubblewrapSandbox
from pipeline.harness.backends.docker import DockerBackend, hostroot_image
from pipeline.harness.backends.sandbox_etc import ENTRIES
from pipeline.harness.sandbox import SandboxBackend, SandboxSpec

from common import machine, note, percentile, summary

BWRAP_TARGET_MS = 50


@dataclass
class Times:
    """Milliseconds per run: ``start()``, the first command after it, and the bare bwrap beside them."""

    start: list[float]
    first: list[float]
    baseline: list[float]

    @property
    def total(self) -> list[float]:
        return [start + first for start, first in zip(self.start, self.first, strict=True)]


async def bare_bwrap() -> float:
    """Milliseconds of one ``bwrap --ro-bind / / true``."""
    started = time.perf_counter()
    process = await asyncio.create_subprocess_exec("bwrap", "--ro-bind", "/", "/", "true")
    assert await process.wait() == 0
    return (time.perf_counter() - started) * 1000


async def start_and_first_command(backend: SandboxBackend, spec: SandboxSpec) -> tuple[float, float]:
    """Milliseconds of one start and of its first command; the stop after them is outside the clock."""
    started = time.perf_counter()
    sandbox = await backend.start(spec)
    up = time.perf_counter()
    result = await sandbox.exec(["true"], env={}, limit_s=60)
    done = time.perf_counter()
    await sandbox.stop()
    assert result.exit_code == 0, result.output
    return (up - started) * 1000, (done - up) * 1000


async def interleaved(backend: SandboxBackend, spec: SandboxSpec, runs: int) -> Times:
    """The backend's times and the baseline's, taken in turn (so the machine's load weighs on both alike),
    after one untimed warm-up of each (page cache, the Docker forwarder's image import)."""
    await bare_bwrap()
    await start_and_first_command(backend, spec)
    times = Times([], [], [])
    for _ in range(runs):
        times.baseline.append(await bare_bwrap())
        start, first = await start_and_first_command(backend, spec)
        times.start.append(start)
        times.first.append(first)
    return times


def docker_answers() -> bool:
    if shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "info"], capture_output=True, check=False, timeout=60).returncode == 0


def report(name: str, times: Times, target_ms: float | None) -> None:
    note(
        f"{name}: start + first command {describe(times.total)} (start {describe(times.start)}, first "
        f"command {describe(times.first)}); bare bwrap true {describe(times.baseline)}"
    )
    figure, base = statistics.median(times.total), statistics.median(times.baseline)
    summary(
        "harness", f"{name} sandbox start-to-first-command", f"{figure:.1f} ms median",
        f"bare bwrap true {base:.1f} ms", figure / base, None if target_ms is None else f"<= {target_ms} ms",
        met=target_ms is not None and figure <= target_ms,
    )  # fmt: skip


def describe(times: list[float]) -> str:
    return f"median {statistics.median(times):.1f} ms, p90 {percentile(times, 90):.1f} ms"


async def sandbox_start(runs: int) -> None:
    note(machine())
    server = await asyncio.start_server(lambda _r, w: w.close(), "127.0.0.1", 0)  # a gateway stand-in
    gateway = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    with tempfile.TemporaryDirectory(prefix="bench-sandbox-") as scratch:
        root, workspace = Path(scratch, "root"), Path(scratch, "workspace")
        os.mkdir(workspace)
        spec = SandboxSpec(workspace=workspace, gateway=gateway, owner="bench")
        report("bubblewrap", await interleaved(BubblewrapBackend(root), spec, runs), BWRAP_TARGET_MS)
        if not docker_answers():
            note("docker: no engine answers here (`docker info` failed): Docker not measured")
        else:
            image = await hostroot_image()
            docker_spec = SandboxSpec(
                workspace=workspace,
                gateway=gateway,
                owner="bench",
                image=image,
                mounts=hostroot.real_folders(),
            )
            report("docker", await interleaved(DockerBackend(root), docker_spec, max(5, runs // 3)), None)
    server.close()


def stage_commands(sandbox: BubblewrapSandbox) -> dict[str, list[str]]:
    """Plain bwrap command lines, each adding one part of what the sandbox's first command does."""
    namespaces = ["bwrap", "--unshare-all", "--die-with-parent", "--new-session"]
    binds = sandbox._binds()
    at = binds.index("/etc") - 2  # "--ro-bind", <the copies>, "/etc": as before, one bind per entry
    per_entry = [arg for name in ENTRIES for arg in ("--ro-bind-try", f"/etc/{name}", f"/etc/{name}")]
    return {
        "bare bwrap true": ["bwrap", "--ro-bind", "/", "/", "true"],
        "+ every namespace but the network": [*namespaces, "--share-net", "--ro-bind", "/", "/", "true"],
        "+ the network namespace": [*namespaces, "--ro-bind", "/", "/", "true"],
        "+ the binds, /etc entry by entry": [*namespaces, *binds[:at], *per_entry, *binds[at + 3 :], "true"],
        "+ the binds, /etc one folder": [*namespaces, *binds, "true"],
    }


async def run_quietly(argv: list[str]) -> float:
    started = time.perf_counter()
    process = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL
    )
    assert await process.wait() == 0, argv
    return (time.perf_counter() - started) * 1000


async def stages(runs: int) -> None:
    """Where bubblewrap's first command spends its time (see the module's docstring)."""
    note(machine())
    server = await asyncio.start_server(lambda _r, w: w.close(), "127.0.0.1", 0)
    gateway = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    with tempfile.TemporaryDirectory(prefix="bench-sandbox-") as scratch:
        workspace = Path(scratch, "workspace")
        os.mkdir(workspace)
        backend = BubblewrapBackend(Path(scratch, "root"))
        sandbox = await backend.start(SandboxSpec(workspace=workspace, gateway=gateway, owner="bench"))
        commands = stage_commands(sandbox)
        times: dict[str, list[float]] = {name: [] for name in [*commands, "+ the forwarder (socat)"]}
        for _ in range(runs):
            for name, argv in commands.items():
                times[name].append(await run_quietly(argv))
            started = time.perf_counter()
            assert (await sandbox.exec(["true"], env={}, limit_s=60)).exit_code == 0
            times["+ the forwarder (socat)"].append((time.perf_counter() - started) * 1000)
        await sandbox.stop()
    server.close()
    for name, measured in times.items():
        note(f"{name}: {describe(measured)}")
    one_folder = statistics.median(times["+ the binds, /etc one folder"])
    per_entry = statistics.median(times["+ the binds, /etc entry by entry"])
    summary(
        "harness", "bubblewrap command, /etc one folder", f"{one_folder:.1f} ms median",
        f"/etc entry by entry {per_entry:.1f} ms", one_folder / per_entry, None,
    )  # fmt: skip


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--sandbox-start", action="store_true", help="sandbox start-to-first-command per backend"
    )
    parser.add_argument("--stages", action="store_true", help="bubblewrap's first command, part by part")
    parser.add_argument("--runs", type=int, default=30)
    args = parser.parse_args(argv)
    if not args.sandbox_start:
        parser.error("say what to measure: --sandbox-start")
    asyncio.run(stages(args.runs) if args.stages else sandbox_start(args.runs))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
