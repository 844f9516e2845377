"""Live progress of a run: a rich table on a terminal, a line every few seconds elsewhere (CI, logs)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable

from rich.console import Console
from rich.live import Live
from rich.table import Table

from pipeline.runners.runner import RunStats, is_infrastructure_failure


def stats_line(stats: RunStats) -> str:
    mean = "-" if stats.mean_reward is None else f"{stats.mean_reward:.3f}"
    return (
        f"episodes done {stats.done}, running {stats.running}, failed {stats.failed}, "
        f"retried {stats.retried}, cancelled {stats.cancelled}; turns {stats.turns} "
        f"({stats.turns_per_second:.1f}/s); mean reward {mean}"
        + (f"; bad task lines {stats.task_errors}" if stats.task_errors else "")
    )


def stats_table(stats: RunStats, title: str = "turnstile run", extra: dict[str, str] | None = None) -> Table:
    table = Table(title=title, show_header=False, min_width=44)
    table.add_column(style="bold")
    table.add_column(justify="right")
    elapsed = time.monotonic() - stats.started_at
    rows = {
        "episodes done": str(stats.done),
        "running": str(stats.running),
        "failed": f"[red]{stats.failed}[/red]" if stats.failed else "0",
        "retried": str(stats.retried),
        "cancelled": str(stats.cancelled),
        "turns": str(stats.turns),
        "turns/s": f"{stats.turns_per_second:.1f}",
        "mean reward": "-" if stats.mean_reward is None else f"{stats.mean_reward:.3f}",
        "elapsed": f"{elapsed:.0f} s",
    }
    if stats.task_errors:
        rows["bad task lines"] = f"[red]{stats.task_errors}[/red]"
    rows.update(extra or {})
    for name, value in rows.items():
        table.add_row(name, value)
    return table


@contextlib.asynccontextmanager
async def live_progress(
    console: Console, render: Callable[[], Table], line: Callable[[], str], *, every: float = 5.0
) -> AsyncIterator[None]:
    """Show ``render()`` live on a terminal; otherwise print ``line()`` every ``every`` seconds."""

    async def refresh(update: Callable[[], None], period: float) -> None:
        while True:
            await asyncio.sleep(period)
            update()

    if console.is_terminal:
        with Live(render(), console=console, refresh_per_second=4, transient=False) as live:
            task = asyncio.create_task(refresh(lambda: live.update(render()), 0.25))
            try:
                yield
            finally:
                task.cancel()
                live.update(render())
    else:
        task = asyncio.create_task(refresh(lambda: console.print(line()), every))
        try:
            yield
        finally:
            task.cancel()


def failure_report(stats: RunStats, most: int = 5) -> list[str]:
    """Lines naming why episodes failed, the commonest causes first (empty when none failed)."""
    if not stats.failed:
        return []
    lines = [f"{stats.failed} episode(s) failed; causes:"]
    for cause, count in stats.causes.most_common(most):
        kind = " (infrastructure: no agent change fixes it)" if is_infrastructure_failure(cause) else ""
        lines.append(f"  {count} x {cause}{kind}")
    if len(stats.causes) > most:
        lines.append(
            f"  ... and {len(stats.causes) - most} other causes (see EpisodeFinished.error in the log)"
        )
    return lines


def failed_for_infrastructure(stats: RunStats) -> bool:
    return any(is_infrastructure_failure(cause) for cause in stats.causes)
