"""The demo's machinery (``turnstile demo``): a supervisor for the service processes, and the statistics
of the closed loop read back from the database (rewards per episode, status, the summary)."""

from __future__ import annotations

import re
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
LOG_TAIL_LINES: Final = 40
"""Lines of a service's log quoted when it exited unexpectedly (``ServiceProcesses.check``)."""
HARNESS_POLICY: Final = "harness-demo"
"""The policy of ``turnstile demo --harness``: its own line of versions beside the demo's."""


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
        self._log_starts: dict[str, int] = {}

    def start(self, name: str, *args: str, env: dict[str, str] | None = None) -> None:
        """``turnstile ARGS`` as the service ``name``, logging to ``<logs>/<name>.log`` (appended); ``env``
        adds to the shared environment."""
        self.logs.mkdir(parents=True, exist_ok=True)
        log = (self.logs / f"{name}.log").open("ab")
        self._log_starts[name] = log.tell()
        self.processes[name] = subprocess.Popen(
            [sys.executable, "-m", "consumers.cli", *args],
            env=self.env | (env or {}),
            stdout=log,
            stderr=log,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # Ctrl-C reaches the demo; the demo stops them in order
        )

    def wait_for_log(self, name: str, pattern: str, timeout: float = 180.0) -> re.Match[str]:
        """The first match of ``pattern`` in what service ``name`` logged since it started (e.g. the URL it
        bound to a free port); a ``RuntimeError`` if it exits or ``timeout`` passes first."""
        deadline = time.monotonic() + timeout
        path = self.logs / f"{name}.log"
        while True:
            with path.open("rb") as log:
                log.seek(self._log_starts[name])
                if found := re.search(pattern, log.read().decode(errors="replace")):
                    return found
            self.check()
            if time.monotonic() > deadline:
                raise RuntimeError(f"the {name} service did not log {pattern!r} in {timeout:g} s; see {path}")
            time.sleep(0.2)  # a log file has no event to wait on: polled

    def check(self) -> None:
        """A ``RuntimeError`` naming the first service that exited, with the last lines it logged (a CI run
        keeps the message, not the log file)."""
        for name, process in self.processes.items():
            if process.poll() is not None:
                raise RuntimeError(
                    f"the {name} process exited ({process.returncode}); see {self.logs}/{name}.log, "
                    f"which ends:\n{self.log_tail(name)}"
                )

    def log_tail(self, name: str, lines: int = LOG_TAIL_LINES) -> str:
        """The last ``lines`` lines service ``name`` logged since it started ("" before any)."""
        path = self.logs / f"{name}.log"
        if not path.is_file():
            return ""
        with path.open("rb") as log:
            log.seek(self._log_starts.get(name, 0))
            return "\n".join(log.read().decode(errors="replace").splitlines()[-lines:])

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


def try_queries(policy: str = POLICY) -> tuple[str, ...]:
    """Queries the demo suggests for ``turnstile sql`` once it has run (``policy``: a name of letters,
    digits, ``-`` and ``_``, as every policy's is)."""
    return (
        "SELECT policy_version, episodes, round(mean_reward::numeric, 3) AS mean_reward "
        f"FROM reward_by_policy_version WHERE policy = '{policy}' ORDER BY policy_version",
        "SELECT b.batch_id, t.policy_version AS trained_into, b.samples, b.groups, b.min_policy_version "
        "FROM trained_batches t JOIN batches b USING (batch_id) ORDER BY t.trained_at DESC LIMIT 5",
        "SELECT * FROM turn_latency_by_consumer",
    )


def query(database_url: str, sql: str, *params: Any) -> list[tuple[Any, ...]]:
    with psycopg.connect(libpq_url(database_url)) as connection:
        return connection.execute(sql, params).fetchall()


def log_head(database_url: str) -> int:
    """The position of the newest event in the log (0 when it is empty)."""
    return int(query(database_url, "SELECT coalesce(max(position), 0) FROM events")[0][0])


def batches_trained(database_url: str) -> int:
    """Batches the trainers have trained on, over every run so far."""
    return int(query(database_url, "SELECT count(*) FROM trained_batches WHERE outcome = 'trained'")[0][0])


def rewards_since(database_url: str, since_position: int, policy: str = POLICY) -> list[float]:
    """Mean reward per turn of each finished episode recorded after ``since_position``, in finish order."""
    rows = query(
        database_url,
        "SELECT reward / turns FROM episodes WHERE policy = %s AND status = 'finished' "
        "AND termination IN ('done', 'truncated', 'max_turns') AND turns > 0 AND started_position > %s "
        "ORDER BY finished_position",
        policy,
        since_position,
    )
    return [float(r[0] or 0.0) for r in rows]


def loop_status(
    database_url: str, since_position: int, started: float, policy: str = POLICY
) -> dict[str, Any]:
    rewards = rewards_since(database_url, since_position, policy)
    trained = batches_trained(database_url)
    version = query(
        database_url,
        "SELECT coalesce(max((data->>'version')::int), 0) FROM events WHERE stream = %s",
        f"policy-{policy}",
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


def summarize(
    database_url: str, since: int, started_wall: float, window: int, policy: str = POLICY
) -> Summary:
    """The run's figures: episodes and turns since position ``since``, the mean reward of the first and last
    ``window`` episodes with 95% intervals, the reward curve, batches trained and the first update's time."""
    rewards = rewards_since(database_url, since, policy)
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
        f"policy-{policy}",
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
