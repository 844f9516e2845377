"""What a harness run tells its user: each attempt's outcome, a live line, and a summary table per task."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Literal

from rich.table import Table

Outcome = Literal["passed", "failed", "timeout", "error", "cancelled"]
"""passed / failed: the verifier's verdict (reward >= 1 / below); timeout: the agent ran past its limit (no
reward, not retried: the agent's own doing); error: an infrastructure failure (no reward, retried as a new
episode); cancelled: the harness was stopped."""
PHASES = ("start", "agent", "verify")


@dataclass
class Attempt:
    """One episode: a session, a sandbox, the agent, the verifier."""

    task_id: str
    group_id: str
    group_size: int
    number: int
    session_id: str | None = None
    outcome: Outcome = "error"
    reward: float | None = None
    cause: str | None = None
    turns: int = 0
    tokens: int = 0
    seconds: dict[str, float] = field(default_factory=dict)
    exit_code: int | None = None
    """The agent's exit status (None: it did not run, or ran past its limit)."""


@dataclass
class HarnessStats:
    """Attempts so far, for the live line and the summary."""

    attempts: list[Attempt] = field(default_factory=list)
    running: int = 0
    started_at: float = field(default_factory=time.monotonic)

    def add(self, attempt: Attempt) -> None:
        self.attempts.append(attempt)

    def counts(self) -> Counter[str]:
        return Counter(attempt.outcome for attempt in self.attempts)

    def line(self) -> str:
        counts = self.counts()
        done = counts["passed"] + counts["failed"]
        return (
            f"episodes verified {done} (passed {counts['passed']}, failed {counts['failed']}), "
            f"agent timeouts {counts['timeout']}, infrastructure errors {counts['error']}, "
            f"cancelled {counts['cancelled']}, running {self.running}; "
            f"{time.monotonic() - self.started_at:.0f} s"
        )

    def causes(self) -> Counter[str]:
        return Counter(a.cause for a in self.attempts if a.outcome == "error" and a.cause)

    def table(self, title: str = "turnstile harness run") -> Table:
        """Per task: pass rate over verified episodes, errors, turns, tokens and mean seconds per phase."""
        table = Table(title=title)
        for name in ("task", "pass rate", "verified", "timeouts", "errors", "turns", "tokens"):
            table.add_column(name, justify="left" if name == "task" else "right")
        for phase in PHASES:
            table.add_column(f"{phase} s", justify="right")
        for task_id in dict.fromkeys(a.task_id for a in self.attempts):
            table.add_row(*task_row([a for a in self.attempts if a.task_id == task_id], task_id))
        if len({a.task_id for a in self.attempts}) > 1:
            table.add_row(*task_row(self.attempts, "all"), style="bold")
        return table


def task_row(attempts: list[Attempt], name: str) -> list[str]:
    verified = [a for a in attempts if a.outcome in ("passed", "failed")]
    passed = sum(a.outcome == "passed" for a in verified)
    rate = f"{passed / len(verified):.0%} ({passed}/{len(verified)})" if verified else "-"
    row = [
        name,
        rate,
        str(len(verified)),
        str(sum(a.outcome == "timeout" for a in attempts)),
        str(sum(a.outcome == "error" for a in attempts)),
        str(sum(a.turns for a in attempts)),
        str(sum(a.tokens for a in attempts)),
    ]
    for phase in PHASES:
        times = [a.seconds[phase] for a in attempts if phase in a.seconds]
        row.append(f"{sum(times) / len(times):.1f}" if times else "-")
    return row
