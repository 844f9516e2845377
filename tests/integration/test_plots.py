"""Plots: charts built from rows with hand-computed numbers, drawn by matplotlib (title, axis names, legend;
without matplotlib a one-line message says how to get it), and ``turnstile plot`` on a real PostgreSQL
through the reader login."""

from __future__ import annotations

import math
import struct
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest

from pipeline.dev.charts import (
    CHART_NAMES,
    curve_points,
    draw,
    figure,
    read_charts,
    reward_by_version,
    reward_curve,
    staleness,
    throughput,
)
from tests.conftest import login_url
from tests.integration.test_sql import TURNSTILE, clean_env, seed

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def reader_url(database_url: str, logins: dict[str, tuple[str, str]]) -> str:
    """The test's database as the reader login (not a superuser: the charts read as ``turnstile sql``)."""
    return login_url(database_url, logins["turnstile_reader"])


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def test_curve_points_are_bucket_means_with_95_percent_half_widths() -> None:
    rewards = [0.0, 1.0, 1.0, 1.0, 0.5]
    points = curve_points(rewards, points=2)  # buckets of 2: [0, 1], [1, 1], [0.5]
    assert [x for x, _, _ in points] == [2, 4, 5]
    assert [y for _, y, _ in points] == [0.5, 1.0, 0.5]
    # sample sd of (0, 1) = sqrt(0.5); half-width 1.96 * sqrt(0.5) / sqrt(2) = 0.98
    assert points[0][2] == pytest.approx(0.98)
    assert points[1][2] == 0.0
    assert points[2][2] == 0.0  # a single episode: no spread to estimate
    assert reward_curve(rewards, points=2).series[0].label == "mean of 2 episodes"


def test_reward_by_version_band_is_the_95_percent_interval_of_the_mean() -> None:
    chart = reward_by_version([(0, 4, 0.5, 0.2), (1, 1, 0.9, None), (2, 0, None, None)], policy="p")
    (series,) = chart.series
    assert list(series.x) == [0, 1]  # a version without rewarded episodes is left out
    assert list(series.y) == [0.5, 0.9]
    assert series.low is not None
    assert series.high is not None
    assert series.low[0] == pytest.approx(0.5 - 1.96 * 0.2 / 2)
    assert series.high[0] == pytest.approx(0.5 + 1.96 * 0.2 / 2)
    assert (series.low[1], series.high[1]) == (0.9, 0.9)
    assert chart.title == "Reward per policy version (policy p)"


def test_throughput_is_counts_per_second_over_minutes() -> None:
    chart = throughput([(0.0, 100), (30.0, 40)], [(30.0, 15)], 10.0)
    turns, episodes = chart.series
    assert list(turns.x) == pytest.approx([0.0, 1 / 6, 2 / 6, 0.5])
    assert list(turns.y) == [10.0, 0.0, 0.0, 4.0]
    assert list(episodes.x) == list(turns.x)
    assert list(episodes.y) == [0.0, 0.0, 0.0, 1.5]
    assert chart.y_from_zero


def test_a_stall_in_throughput_is_drawn_at_zero_not_joined_across() -> None:
    """3 minutes without a turn between two busy minutes (buckets of 60 s): the line drops to 0 and stays
    there for the stall; before, it ran straight from 2.4 to 0.6 turns/s across it."""
    chart = throughput([(0.0, 144), (240.0, 36)], [], 60.0)
    turns, _ = chart.series
    assert list(turns.y) == [2.4, 0.0, 0.0, 0.0, 0.6]
    line = figure(chart).axes[0].get_lines()[0]
    assert list(line.get_ydata()) == [2.4, 0.0, 0.0, 0.0, 0.6]


def test_staleness_shows_training_time_staleness_and_the_skipped_share(tmp_path: Path) -> None:
    rows = [
        (1, 0.5, 0, 1, "trained", 1),
        (2, 1.0, 1, 1, "trained", 3),
        (3, 0.0, 0, 0, "stale", 6),
        (4, 0.0, 0, 0, None, None),  # not taken by a trainer yet
    ]
    chart = staleness(rows, policy="p")
    made, trained, skipped = chart.series
    assert list(made.y) == [0.5, 1.0, 0.0, 0.0]
    assert (list(trained.x), list(trained.y)) == ([1.0, 2.0], [1.0, 3.0])
    assert (list(skipped.x), list(skipped.y)) == ([3.0], [6.0])
    assert not skipped.line
    assert chart.notes == ("skipped 1 of 3 batches taken (33%)",)
    labels = [t.get_text() for t in figure(chart).axes[0].get_legend().get_texts()]
    assert sorted(labels) == sorted([made.label, trained.label, skipped.label, "min..max"])
    assert staleness([(1, 0.5, 0, 1)]).notes == ()  # no trainer yet: no share to tell


def test_matplotlib_draws_title_axis_names_units_and_legend(tmp_path: Path) -> None:
    chart = reward_by_version([(0, 4, 0.5, 0.2), (1, 4, 0.7, 0.2)], policy="demo")
    fig = figure(chart)
    (axes,) = fig.axes
    assert axes.get_title() == "Reward per policy version (policy demo)"
    assert axes.get_xlabel() == "policy version (newest that sampled the episode)"
    assert axes.get_ylabel() == "mean episode reward"
    legend = axes.get_legend()
    assert legend is not None
    assert [text.get_text() for text in legend.get_texts()] == ["mean reward", "95% CI"]
    rates = figure(throughput([(0.0, 100)], [(0.0, 10)], 10.0))
    assert rates.axes[0].get_ylabel() == "rate (per second)"
    assert rates.axes[0].get_ylim()[0] == 0.0
    assert png_size(draw(chart, tmp_path / "m.png")) == (960, 540)  # 8 x 4.5 inches at 120 dpi


def test_an_empty_chart_says_so_instead_of_failing(tmp_path: Path) -> None:
    chart = staleness([])
    assert chart.empty
    texts = [text.get_text() for text in figure(chart).axes[0].texts]
    assert texts == ["no data yet"]
    assert png_size(draw(chart, tmp_path / "e.png")) == (960, 540)


def test_without_matplotlib_plot_and_draw_say_in_one_line_how_to_get_it(tmp_path: Path) -> None:
    out = tmp_path / "none.png"
    code = (
        "import sys; sys.modules['matplotlib'] = None\n"  # import matplotlib now raises ImportError
        "from pathlib import Path\n"
        "from pipeline.dev.charts import PlotsUnavailable, draw, have_matplotlib, reward_curve\n"
        "assert not have_matplotlib()\n"
        "try:\n"
        f"    draw(reward_curve([0.0, 0.5, 1.0] * 20), Path({str(out)!r}))\n"
        "except PlotsUnavailable as error:\n"
        "    print(error)\n"
        "from consumers.cli import main\n"
        "sys.argv = ['turnstile', 'plot', '--out', sys.argv[1]]\n"
        "main()\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "plots")],
        capture_output=True, text=True, timeout=120, env=clean_env(),
    )  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr  # the CLI's exit code for a TurnstileError
    said = (done.stdout + done.stderr).strip().splitlines()
    assert said[0].startswith("matplotlib is not installed, so no plots were drawn")
    assert "pip install" in said[0]
    assert any("pip install" in line for line in said[1:])  # the CLI says it too, with no traceback
    assert "Traceback" not in done.stderr
    assert not out.exists()
    assert not (tmp_path / "plots").exists()


def test_charts_from_the_read_models_match_the_hand_computed_figures(
    database_url: str, reader_url: str
) -> None:
    seed(database_url)
    with psycopg.connect(database_url) as connection:  # a trainer stepped on version 3 with b1, into 4
        connection.execute(
            "INSERT INTO trained_batches (trainer, batch_id, policy, policy_version, outcome) "
            "VALUES ('t', 'b1', 'main', 4, 'trained')"
        )
    curve, by_version, stale, rates = read_charts(reader_url, "main")
    # finished episodes of main ending done/truncated/max_turns: e1 (1.0 over 2 turns), e2 (0.0 over 1)
    assert sorted(curve.series[0].y) == [0.0, 0.5]
    # version 1: e1 (1.0) and e2 (0.0): mean 0.5, sd sqrt(0.5), 95% half-width 0.98; version 2: e3 (0.5)
    (series,) = by_version.series
    assert list(series.x) == [1, 2]
    assert list(series.y) == [0.5, 0.5]
    assert series.low is not None
    assert series.high is not None
    assert series.high[0] - series.y[0] == pytest.approx(1.96 * math.sqrt(0.5) / math.sqrt(2))
    # batch b1: newest version 3, samples of versions 1, 2, 2: mean 4/3 behind, 1..2
    # and at training time its oldest sample (version 1) was 3 - 1 = 2 versions behind; none skipped
    lag, trained = stale.series
    assert list(lag.y) == [pytest.approx(4 / 3)]
    assert (list(lag.low or []), list(lag.high or [])) == ([1.0], [2.0])
    assert (list(trained.x), list(trained.y)) == ([1.0], [2.0])
    assert stale.notes == ("skipped 0 of 1 batches taken (0%)",)
    # 7 turns of main, all at the same second: buckets of 1 s; episodes finish 10, 20 and 70 s later; both
    # series span every bucket from 0 to 70 s, the empty ones at 0 (a gap is drawn as the zero it was)
    turns, episodes = rates.series
    assert list(turns.x) == list(episodes.x) == pytest.approx([n / 60 for n in range(71)])
    assert list(turns.y) == [7.0] + [0.0] * 70
    assert [n for n, rate in enumerate(episodes.y) if rate] == [10, 20, 70]


def test_turnstile_plot_draws_every_chart_and_refuses_an_unknown_one(
    database_url: str, reader_url: str, tmp_path: Path
) -> None:
    seed(database_url)
    env = clean_env(TURNSTILE_DATABASE_URL=database_url, TURNSTILE_READER_URL=reader_url)
    done = subprocess.run(
        [*TURNSTILE, "plot", "--policy", "main", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    for name in CHART_NAMES:
        assert png_size(tmp_path / f"{name}.png") == (960, 540)
        assert str(tmp_path / f"{name}.png") in done.stderr.replace("\n", "")
    empty = subprocess.run(
        [*TURNSTILE, "plot", "staleness", "--policy", "nobody", "--out", str(tmp_path / "none")],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert empty.returncode == 0, empty.stderr
    assert "(no data yet)" in empty.stderr
    assert png_size(tmp_path / "none" / "staleness.png") == (960, 540)  # "no data yet", drawn by matplotlib
    unknown = subprocess.run(
        [*TURNSTILE, "plot", "loss"], capture_output=True, text=True, timeout=120, env=env
    )  # fmt: skip
    assert unknown.returncode == 2
    assert "unknown plot loss" in unknown.stderr
