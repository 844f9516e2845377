"""``turnstile harness run``: the harness (pipeline/harness) with live progress, Ctrl-C and SIGTERM ending
open sessions ``cancelled`` and stopping every sandbox, and a summary table at the end."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from rich.console import Console

from consumers.runtime import stop_on_signals
from pipeline.harness import HarnessConfig, HarnessStats, HarnessTask, Recovered, backend, run_harness
from pipeline.runners import live_progress


@dataclass
class HarnessResult:
    stats: HarnessStats
    cancelled: bool = False


async def harness_run(
    config: HarnessConfig, tasks: list[HarnessTask], sandbox: str, console: Console
) -> HarnessResult:
    """Run every task x group size under ``sandbox``; stopped by a signal, it returns ``cancelled``."""
    stats = HarnessStats()
    result = HarnessResult(stats)

    def announce(_: object, recovered: Recovered) -> None:
        if recovered.sandboxes or recovered.sessions:
            console.print(
                f"removed {recovered.sandboxes} sandboxes and ended {recovered.sessions} sessions (aborted) "
                f"left by a stopped harness of owner {config.owner!r}"
            )
        console.print(
            f"harness {config.owner!r}: {len(tasks)} tasks x {config.group_size}, "
            f"agent {config.agent.name!r}, "
            f"sandbox {sandbox!r}, {config.concurrency} at a time, gateway {config.gateway}"
        )

    work = asyncio.create_task(run_harness(config, tasks, backend(sandbox), stats=stats, on_start=announce))
    with stop_on_signals(work.cancel):
        async with live_progress(console, stats.table, stats.line):
            try:
                await work
            except asyncio.CancelledError:
                result.cancelled = True
    return result
