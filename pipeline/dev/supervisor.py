"""The demo's machinery (``turnstile demo``): a supervisor for the service processes, and the statistics
of the closed loop read back from the database (rewards per episode, status, the summary)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import psycopg

from pipeline.dev.charts import curve_points, mean_ci
from pipeline.settings import libpq_url

POLICY: Final = "demo"


@dataclass
class Summary:
    episodes: int = 0
    turns: int = 0
    seconds: float = 0.0
    batches_trained: int = 0
    batches_skipped: int = 0  # by the trainer, as more than --max-staleness versions behind
    policy_version: int = 0
    first_update_s: float | None = None
    first_window: tuple[float, float, int] = (0.0, 0.0, 0)
    last_window: tuple[float, float, int] = (0.0, 0.0, 0)
    curve: list[tuple[int, float, float]] = field(default_factory=list)
    plots: str | None = None  # the directory of the standard plots

    @property
    def improved(self) -> bool:
        (first, first_ci, _), (last, last_ci, _) = self.first_window, self.last_window
        return last - last_ci > first + first_ci


class ServiceProcesses:
    """The service processes, stopped with SIGTERM (then SIGKILL) on exit."""

    def __init__(self, env: dict[str, str], logs: Path) -> None:
        self.env, self.logs = env, logs
        self.processes: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, *args: str) -> None:
        self.logs.mkdir(parents=True, exist_ok=True)
        log = (self.logs / f"{name}.log").open("ab")
        self.processes[name] = subprocess.Popen(
            [sys.executable, "-m", "consumers.cli", *args],
            env=self.env,
            stdout=log,
            stderr=log,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # Ctrl-C reaches the demo; the demo stops them in order
        )

    def check(self) -> None:
        for name, process in self.processes.items():
            if process.poll() is not None:
                raise RuntimeError(
                    f"the {name} process exited ({process.returncode}); see {self.logs}/{name}.log"
                )

    def stop(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.processes.values():
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


TRY_QUERIES: Final = (
    "SELECT policy_version, episodes, round(mean_reward::numeric, 3) AS mean_reward "
    "FROM reward_by_policy_version WHERE policy = 'demo' ORDER BY policy_version",
    "SELECT b.batch_id, t.policy_version AS trained_into, b.samples, b.groups, b.min_policy_version "
    "FROM trained_batches t JOIN batches b USING (batch_id) ORDER BY t.trained_at DESC LIMIT 5",
    "SELECT * FROM turn_latency_by_consumer",
)
"""Queries the demo suggests for ``turnstile sql`` once it has run."""


def query(database_url: str, sql: str, *params: Any) -> list[tuple[Any, ...]]:
    with psycopg.connect(libpq_url(database_url)) as connection:
        return connection.execute(sql, params).fetchall()


def log_head(database_url: str) -> int:
    """The position of the newest event in the log (0 when it is empty)."""
    return int(query(database_url, "SELECT coalesce(max(position), 0) FROM events")[0][0])


def batches_trained(database_url: str) -> int:
    """Batches the trainers have trained on, over every run so far."""
    return int(query(database_url, "SELECT count(*) FROM trained_batches WHERE outcome = 'trained'")[0][0])


def rewards_since(database_url: str, since_position: int) -> list[float]:
    """Mean reward per turn of each finished episode recorded after ``since_position``, in finish order."""
    rows = query(
        database_url,
        "SELECT reward / turns FROM episodes WHERE policy = %s AND status = 'finished' "
        "AND termination IN ('done', 'truncated', 'max_turns') AND turns > 0 AND started_position > %s "
        "ORDER BY finished_position",
        POLICY,
        since_position,
    )
    return [float(r[0] or 0.0) for r in rows]


def loop_status(database_url: str, since_position: int, started: float) -> dict[str, Any]:
    rewards = rewards_since(database_url, since_position)
    trained = batches_trained(database_url)
    version = query(
        database_url,
        "SELECT coalesce(max((data->>'version')::int), 0) FROM events WHERE stream = %s",
        f"policy-{POLICY}",
    )[0][0]
    turns = query(
        database_url,
        "SELECT count(*) FROM events WHERE type = 'TurnCompleted' AND position > %s",
        since_position,
    )[0][0]
    recent = rewards[-200:]
    elapsed = time.monotonic() - started
    return {
        "episodes": len(rewards),
        "turns": int(turns),
        "turns_per_s": turns / max(elapsed, 1e-9),
        "batches_trained": int(trained),
        "policy_version": int(version),
        "mean_reward_recent": sum(recent) / len(recent) if recent else None,
        "elapsed": elapsed,
    }


def summarize(database_url: str, since: int, started_wall: float, window: int) -> Summary:
    """The run's figures: episodes and turns since position ``since``, the mean reward of the first and last
    ``window`` episodes with 95% intervals, the reward curve, batches trained and the first update's time."""
    rewards = rewards_since(database_url, since)
    summary = Summary(episodes=len(rewards))
    summary.turns = int(
        query(
            database_url, "SELECT count(*) FROM events WHERE type = 'TurnCompleted' AND position > %s", since
        )[0][0]
    )
    window = min(window, max(len(rewards) // 3, 1))
    summary.first_window = mean_ci(rewards[:window])
    summary.last_window = mean_ci(rewards[-window:])
    summary.curve = curve_points(rewards)
    outcomes = dict(
        query(
            database_url,
            "SELECT outcome, count(*) FROM trained_batches WHERE trained_at >= to_timestamp(%s) GROUP BY 1",
            started_wall,
        )
    )
    summary.batches_trained = int(outcomes.get("trained", 0))
    summary.batches_skipped = int(outcomes.get("stale", 0))
    versions = query(
        database_url,
        "SELECT (data->>'version')::int, extract(epoch FROM recorded_at) FROM events WHERE stream = %s "
        "AND position > %s ORDER BY position",
        f"policy-{POLICY}",
        since,
    )
    if versions:
        summary.policy_version = int(versions[-1][0])
        summary.first_update_s = float(versions[0][1]) - started_wall
    first_row = query(
        database_url,
        "SELECT extract(epoch FROM min(recorded_at)), extract(epoch FROM max(recorded_at)) FROM events "
        "WHERE type = 'TurnCompleted' AND position > %s",
        since,
    )[0]
    if first_row[0] is not None:
        summary.seconds = float(first_row[1]) - float(first_row[0])
    return summary
