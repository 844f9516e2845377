"""Plots people can read: the demo's reward curve and the standard plots of a run, as PNG.

A chart is data (``Chart``: title, axis names with units, labelled series, optional 95% bands) built by pure
functions from rows of the read models; ``draw`` renders it with matplotlib (in the base install; without
it ``draw`` raises ``PlotsUnavailable``, one line saying how to get it). ``read_charts`` builds the standard
plots from a database through the reader role (``turnstile plot``), so they can be drawn at any time, during
a run or long after it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from pipeline.errors import ConfigError
from pipeline.sql import run_readonly

Z95: Final = 1.96  # normal approximation of the 95% interval of a mean


@dataclass(frozen=True)
class Series:
    label: str
    x: Sequence[float]
    y: Sequence[float]
    low: Sequence[float] | None = None  # the band low..high, drawn shaded under the line
    high: Sequence[float] | None = None
    band_label: str | None = None
    markers: bool = False
    line: bool = True  # False: markers alone (points that do not follow one another)


@dataclass(frozen=True)
class Chart:
    name: str  # the file's stem
    title: str
    x_label: str
    y_label: str
    series: tuple[Series, ...] = ()
    notes: tuple[str, ...] = field(default=())  # a line under the title (what was left out, filters)
    y_from_zero: bool = False  # counts and rates: the y axis starts at 0

    @property
    def empty(self) -> bool:
        return not any(len(series.x) for series in self.series)


class PlotsUnavailable(ConfigError):
    """matplotlib is not importable here, so no plot can be drawn."""


NO_MATPLOTLIB: Final = (
    "matplotlib is not installed, so no plots were drawn: it comes with turnstile-rl (pip install -e . "
    "again, or pip install 'matplotlib>=3.8')"
)


def have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def mean_ci(values: Sequence[float]) -> tuple[float, float, int]:
    """Mean, 95% confidence half-width (normal approximation, sample standard deviation) and count."""
    n = len(values)
    if n == 0:
        return 0.0, 0.0, 0
    mean = sum(values) / n
    variance = sum((v - mean) ** 2 for v in values) / (n - 1) if n > 1 else 0.0
    return mean, Z95 * math.sqrt(variance / n), n


# -- charts from rows (pure) ---------------------------------------------------------------------------


def curve_points(rewards: Sequence[float], points: int = 30) -> list[tuple[int, float, float]]:
    """Rewards in finish order as about ``points`` buckets of episodes: (episodes finished at the bucket's
    last episode, the bucket's mean, its 95% half-width)."""
    size = max(len(rewards) // points, 1)
    found = []
    for start in range(0, len(rewards), size):
        mean, ci, n = mean_ci(rewards[start : start + size])
        found.append((start + n, mean, ci))
    return found


def reward_curve(rewards: Sequence[float], *, points: int = 30, policy: str = "") -> Chart:
    """Mean reward per turn of each finished episode in finish order, in buckets of episodes with their 95%
    intervals (``curve_points``)."""
    return curve_chart(curve_points(rewards, points), policy=policy)


def curve_chart(points: Sequence[tuple[int, float, float]], *, policy: str = "") -> Chart:
    """The chart of ``curve_points``: the first bucket's size is every bucket's but the last's."""
    bucket = points[0][0] if points else 0
    return Chart(
        name="reward_curve",
        title=f"Reward while training{_of(policy)}",
        x_label="episodes finished",
        y_label="mean reward per turn",
        series=(
            Series(
                f"mean of {bucket} episode{'s' if bucket != 1 else ''}",
                [x for x, _, _ in points],
                [y for _, y, _ in points],
                [y - ci for _, y, ci in points],
                [y + ci for _, y, ci in points],
                band_label="95% CI",
            ),
        ),
    )


def reward_by_version(
    rows: Sequence[tuple[int, int, float | None, float | None]], *, policy: str = ""
) -> Chart:
    """Rows (policy version, episodes with a reward, mean reward, sample standard deviation): the mean
    reward of the episodes sampled by each version, with a 95% interval (none for a single episode)."""
    xs: list[float] = []
    ys: list[float] = []
    low: list[float] = []
    high: list[float] = []
    for version, n, mean, stddev in rows:
        if mean is None or n == 0:
            continue
        ci = Z95 * stddev / math.sqrt(n) if stddev is not None and n > 1 else 0.0
        xs.append(version)
        ys.append(mean)
        low.append(mean - ci)
        high.append(mean + ci)
    return Chart(
        name="reward_by_version",
        title=f"Reward per policy version{_of(policy)}",
        x_label="policy version (newest that sampled the episode)",
        y_label="mean episode reward",
        series=(Series("mean reward", xs, ys, low, high, band_label="95% CI", markers=len(xs) < 40),),
    )


StalenessRow = tuple[int, float | None, int, int] | tuple[int, float | None, int, int, str | None, int | None]


def staleness(rows: Sequence[StalenessRow], *, policy: str = "") -> Chart:
    """Rows (batch number, mean staleness, min staleness, max staleness[, outcome, staleness at training])
    in the order the batches were made: how many policy versions a batch's samples lag the newest version
    when the batch was made, and — where a trainer took it — when it was trained (its oldest sample
    against the version the step started from) or skipped as too stale (outcome ``stale``)."""
    xs = [float(row[0]) for row in rows]
    taken = [(float(row[0]), row[4], float(row[5])) for row in rows if len(row) > 5 and row[5] is not None]
    trained = [(x, y) for x, outcome, y in taken if outcome == "trained"]
    skipped = [(x, y) for x, outcome, y in taken if outcome == "stale"]
    series = [
        Series(
            "at batch time: mean over the batch's samples",
            xs,
            [float(row[1] or 0.0) for row in rows],
            [float(row[2]) for row in rows],
            [float(row[3]) for row in rows],
            band_label="min..max",
        )
    ]
    if trained:
        series.append(Series("at training time: oldest sample", *_columns(trained)))
    if skipped:
        series.append(Series("skipped as too stale", *_columns(skipped), line=False))
    notes: tuple[str, ...] = ()
    if taken:
        notes = (f"skipped {len(skipped)} of {len(taken)} batches taken ({len(skipped) / len(taken):.0%})",)
    return Chart(
        name="staleness",
        title=f"Staleness of training batches{_of(policy)}",
        x_label="batch (in order made)",
        y_label="staleness (policy versions behind)",
        series=tuple(series),
        notes=notes,
        y_from_zero=True,
    )


def _columns(points: Sequence[tuple[float, float]]) -> tuple[list[float], list[float]]:
    return [x for x, _ in points], [y for _, y in points]


def throughput(
    turns: Sequence[tuple[float, int]],
    episodes: Sequence[tuple[float, int]],
    bucket_s: float,
    *,
    policy: str = "",
) -> Chart:
    """Rows (bucket start in seconds since the first turn, count): turns recorded and episodes finished per
    second, averaged over buckets of ``bucket_s`` seconds.

    The queries return only buckets that hold something; every bucket from the first to the last of either
    series is drawn, empty ones at 0, so a stall shows as the drop to zero it was rather than as a line
    drawn across it between the buckets on either side."""
    slots = 1 + max((round(t / bucket_s) for t, _ in (*turns, *episodes)), default=-1)

    def per_second(rows: Sequence[tuple[float, int]]) -> tuple[list[float], list[float]]:
        counts = [0] * slots
        for t, count in rows:
            counts[round(t / bucket_s)] += count
        return [slot * bucket_s / 60 for slot in range(slots)], [count / bucket_s for count in counts]

    turn_x, turn_y = per_second(turns)
    episode_x, episode_y = per_second(episodes)
    return Chart(
        name="throughput",
        title=f"Throughput{_of(policy)}",
        x_label="time since the first turn (minutes)",
        y_label="rate (per second)",
        series=(
            Series("turns recorded /s", turn_x, turn_y),
            Series("episodes finished /s", episode_x, episode_y),
        ),
        notes=(f"averaged over {bucket_s:g} s",),
        y_from_zero=True,
    )


def _of(policy: str) -> str:
    return f" (policy {policy})" if policy else ""


# -- drawing -------------------------------------------------------------------------------------------


def draw(chart: Chart, path: Path, *, dpi: int = 120) -> Path:
    """Render ``chart`` to the PNG ``path`` with matplotlib (``PlotsUnavailable`` if it is not installed)."""
    if not have_matplotlib():
        raise PlotsUnavailable(NO_MATPLOTLIB)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure(chart).savefig(path, dpi=dpi, metadata={"Software": None})
    return path


def figure(chart: Chart) -> Any:
    """The chart as a matplotlib ``Figure`` (not pyplot: no global state, safe in any thread)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 4.5), layout="constrained")
    axes = fig.add_subplot()
    title = chart.title if not chart.notes else f"{chart.title}\n{'; '.join(chart.notes)}"
    axes.set_title(title)
    axes.set_xlabel(chart.x_label)
    axes.set_ylabel(chart.y_label)
    axes.grid(True, alpha=0.3)
    for series in chart.series:
        (line,) = axes.plot(
            series.x,
            series.y,
            label=series.label,
            linewidth=2,
            linestyle="-" if series.line else "none",
            marker="o" if series.markers or not series.line else None,
        )
        if series.low is not None and series.high is not None and len(series.x):
            axes.fill_between(
                series.x, series.low, series.high, color=line.get_color(), alpha=0.2, label=series.band_label
            )
    if chart.y_from_zero:
        axes.set_ylim(bottom=0)
    if chart.empty:
        axes.text(0.5, 0.5, "no data yet", transform=axes.transAxes, ha="center", va="center", color="grey")
    else:
        axes.legend(loc="best")
    return fig


# -- charts from a database (the reader role) ----------------------------------------------------------

REWARDS_SQL: Final = (
    "SELECT reward / turns FROM episodes WHERE policy = %(policy)s AND status = 'finished' "
    "AND termination IN ('done', 'truncated', 'max_turns') AND turns > 0 ORDER BY finished_position"
)
BY_VERSION_SQL: Final = (
    "SELECT policy_version, rewarded, mean_reward, stddev_reward FROM reward_by_policy_version "
    "WHERE policy = %(policy)s ORDER BY policy_version"
)
# A batch trained into version v was stepped on version v - 1 (every batch of a version starts from the
# one before); a skipped one is recorded with the version it was measured against.
STALENESS_SQL: Final = (
    "SELECT row_number() OVER (ORDER BY s.created_at, s.batch_id), s.mean_staleness, s.min_staleness, "
    "s.max_staleness, t.outcome, t.at_training FROM batch_staleness s LEFT JOIN LATERAL ("
    "SELECT outcome, CASE outcome WHEN 'trained' THEN policy_version - 1 ELSE policy_version END "
    "- s.min_policy_version AS at_training FROM trained_batches "
    "WHERE batch_id = s.batch_id AND outcome IN ('trained', 'stale') ORDER BY trained_at LIMIT 1"
    ") t ON true WHERE s.policy = %(policy)s ORDER BY s.created_at, s.batch_id"
)
SPAN_SQL: Final = (
    "SELECT extract(epoch FROM min(t.recorded_at))::double precision, "
    "extract(epoch FROM max(t.recorded_at))::double precision "
    "FROM turns t JOIN episodes e USING (episode_id) WHERE e.policy = %(policy)s"
)
TURNS_PER_BUCKET_SQL: Final = (
    "SELECT floor((extract(epoch FROM t.recorded_at) - %(first)s) / %(bucket)s) * %(bucket)s AS at, count(*) "
    "FROM turns t JOIN episodes e USING (episode_id) WHERE e.policy = %(policy)s GROUP BY 1 ORDER BY 1"
)
EPISODES_PER_BUCKET_SQL: Final = (
    "SELECT floor((extract(epoch FROM finished_at) - %(first)s) / %(bucket)s) * %(bucket)s AS at, count(*) "
    "FROM episodes WHERE policy = %(policy)s AND finished_at IS NOT NULL "
    "AND extract(epoch FROM finished_at) >= %(first)s GROUP BY 1 ORDER BY 1"
)
CHART_NAMES: Final = ("reward_curve", "reward_by_version", "staleness", "throughput")


def read_charts(
    reader_url: str,
    policy: str,
    names: Sequence[str] = CHART_NAMES,
    *,
    search_path: str | None = None,
    allow_superuser: bool = False,
    buckets: int = 60,
) -> list[Chart]:
    """The standard charts of ``policy`` read from the read models, one query each (read-only, as
    turnstile_reader: see ``pipeline.sql``)."""

    def rows(sql: str, **params: Any) -> list[tuple[Any, ...]]:
        return run_readonly(
            reader_url,
            sql,
            search_path=search_path,
            allow_superuser=allow_superuser,
            params={"policy": policy, **params},
        ).rows

    charts = []
    for name in names:
        if name == "reward_curve":
            charts.append(reward_curve([float(r[0] or 0.0) for r in rows(REWARDS_SQL)], policy=policy))
        elif name == "reward_by_version":
            charts.append(reward_by_version([tuple(r) for r in rows(BY_VERSION_SQL)], policy=policy))
        elif name == "staleness":
            charts.append(staleness([tuple(r) for r in rows(STALENESS_SQL)], policy=policy))
        elif name == "throughput":
            first, last = rows(SPAN_SQL)[0]
            bucket = _bucket_seconds(0.0 if first is None else last - first, buckets)
            turns = [] if first is None else rows(TURNS_PER_BUCKET_SQL, first=first, bucket=bucket)
            episodes = [] if first is None else rows(EPISODES_PER_BUCKET_SQL, first=first, bucket=bucket)
            charts.append(
                throughput(
                    [(float(at), int(n)) for at, n in turns],
                    [(float(at), int(n)) for at, n in episodes],
                    bucket,
                    policy=policy,
                )
            )
        else:
            raise ValueError(f"unknown chart {name!r}; charts: {', '.join(CHART_NAMES)}")
    return charts


def _bucket_seconds(span_s: float, buckets: int) -> float:
    """A round bucket width (1, 2, 5 x 10^k seconds, at least 1 s) giving about ``buckets`` buckets."""
    raw = max(span_s / max(buckets, 1), 1.0)
    scale = 10 ** math.floor(math.log10(raw))
    return float(next(step * scale for step in (1, 2, 5, 10) if step * scale >= raw))
