"""The harness's costs. ``--sandbox-start``: a sandbox's start-to-first-command overhead per backend.

For each backend: ``backend.start(spec)`` then ``sandbox.exec(["true"])`` (the first command), timed
together, ``--runs`` times; ``stop`` is not counted. Baseline, measured in the same run: a bare
``bwrap --ro-bind / / true`` (a process in a mount namespace and nothing else). The ratio is the backend's
median over the baseline's. Target: bubblewrap at most 50 ms median. Docker runs where ``docker info``
answers, else it says so.

    python bench/harness.py --sandbox-start [--runs 30]   (or bench/sandbox_start.py --sandbox-start)
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
from pipeline.harness.backends.bubblewrap import BubblewrapBackend
from pipeline.harness.backends.docker import DockerBackend, hostroot_image
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


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--sandbox-start", action="store_true", help="sandbox start-to-first-command per backend"
    )
    parser.add_argument("--runs", type=int, default=30)
    args = parser.parse_args(argv)
    if not args.sandbox_start:
        parser.error("say what to measure: --sandbox-start")
    asyncio.run(sandbox_start(args.runs))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
