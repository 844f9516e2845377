"""The runs: one page per policy with its figures and charts, read from the rollups that migration 0022
keeps beside ``episodes`` (``run_rollups``, ``throughput_rollups``, ``group_rollups``) and from the policy's
last 500 batches. Nothing here reads every episode of a run: the page costs about the same at 16k turns and
at a million.
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Mapping
from typing import Any, Final

import sqlalchemy as sa
from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse
from sqlalchemy.ext.asyncio import AsyncConnection

from pipeline.ui import svg
from pipeline.ui.browser import Browser, Page
from pipeline.ui.filters import BadRequest

THROUGHPUT_BARS: Final = 40
RECENT_BATCHES: Final = 500
RECENT_GROUPS: Final = 2_000

# Per policy, summed over its rollup rows (a few per policy version and termination): the figures of the
# view episode_stats.
RUN_STATS: Final = """
    SELECT policy,
           sum(episodes)::bigint                                   AS episodes,
           coalesce(sum(episodes) FILTER (WHERE status = 'running'), 0)::bigint  AS running,
           coalesce(sum(episodes) FILTER (WHERE status = 'finished'), 0)::bigint AS finished,
           sum(reward_sum) / nullif(sum(rewarded), 0)              AS mean_reward,
           sum(turns)::double precision / nullif(sum(counted_turns), 0) AS mean_turns,
           (sum(prompt_tokens) + sum(completion_tokens))::bigint   AS tokens,
           min(first_started_at) FILTER (WHERE episodes > 0)       AS first_started_at,
           max(last_finished_at) FILTER (WHERE episodes > 0)       AS last_finished_at
    FROM run_rollups
    {where}
    GROUP BY policy
    HAVING sum(episodes) > 0
    ORDER BY policy
"""
# Finished episodes per newest policy version: the view reward_by_policy_version's figures, the sample
# standard deviation from the sums (rewards are small numbers: no cancellation worth the name).
BY_VERSION: Final = """
    SELECT policy_version,
           sum(episodes)::bigint AS episodes,
           sum(rewarded)::bigint AS rewarded,
           sum(reward_sum) / sum(rewarded) AS mean_reward,
           CASE WHEN sum(rewarded) > 1 THEN sqrt(greatest(
               (sum(reward_sumsq) - sum(reward_sum) ^ 2 / sum(rewarded)) / (sum(rewarded) - 1), 0)) END
               AS stddev_reward,
           min(reward_min) FILTER (WHERE rewarded > 0) AS min_reward,
           max(reward_max) FILTER (WHERE rewarded > 0) AS max_reward
    FROM run_rollups
    WHERE policy = :policy AND status = 'finished' AND policy_version IS NOT NULL
    GROUP BY policy_version
    HAVING sum(rewarded) > 0
    ORDER BY policy_version
"""
TERMINATIONS: Final = """
    SELECT termination, sum(episodes)::bigint AS episodes,
           sum(episodes)::double precision / sum(sum(episodes)) OVER () AS share
    FROM run_rollups
    WHERE policy = :policy AND status = 'finished'
    GROUP BY termination
    HAVING sum(episodes) > 0
    ORDER BY episodes DESC
"""
# The policy's first and last second with a finished episode: the two ends of the primary key.
SPAN: Final = """
    SELECT (SELECT bucket FROM throughput_rollups WHERE policy = :policy AND width_s = 1 AND episodes > 0
            ORDER BY bucket LIMIT 1) AS first,
           (SELECT bucket FROM throughput_rollups WHERE policy = :policy AND width_s = 1 AND episodes > 0
            ORDER BY bucket DESC LIMIT 1) AS last
"""
THROUGHPUT: Final = """
    SELECT floor(extract(epoch FROM bucket - :first) / :width)::int AS bar, sum(turns) AS turns
    FROM throughput_rollups
    WHERE policy = :policy AND width_s = :rollup AND bucket >= :first
    GROUP BY bar
    HAVING sum(episodes) > 0
    ORDER BY bar
"""
# The last RECENT_GROUPS finished groups of more than one episode (``spread_ready``, by migration 0025's
# partial index over those groups only): the view group_rewards' spread (population standard deviation),
# zero when the group's rewards are all the same. All of them while a run has fewer; a bounded read however
# long it runs.
GROUPS: Final = f"""
    SELECT CASE WHEN reward_min = reward_max THEN 0.0
                WHEN rewarded > 0
                THEN sqrt(greatest(reward_sumsq / rewarded - (reward_sum / rewarded) ^ 2, 0))
           END AS stddev_reward,
           coalesce(reward_max = reward_min, false) AS zero_spread
    FROM group_rollups
    WHERE policy = :policy AND spread_ready
    ORDER BY last_finished_at DESC NULLS LAST
    LIMIT {RECENT_GROUPS}
"""
# Their figures and the histogram of their spreads (ten buckets from 0 to the largest) in one statement,
# the groups read once: [[bucket, groups], ...] in ``histogram``.
SPREAD: Final = f"""
    WITH g AS MATERIALIZED ({GROUPS}),
    s AS (SELECT count(*) AS groups, count(*) FILTER (WHERE zero_spread) AS zero_spread,
                 avg(stddev_reward) AS mean_stddev, max(stddev_reward) AS max_stddev FROM g)
    SELECT s.*,
           (SELECT coalesce(json_agg(json_build_array(bucket, groups) ORDER BY bucket), '[]')
            FROM (SELECT width_bucket(stddev_reward, 0, s.max_stddev + 1e-9, 10) AS bucket, count(*) AS groups
                  FROM g WHERE stddev_reward IS NOT NULL GROUP BY bucket) h) AS histogram
    FROM s
"""
STALENESS: Final = f"""
    SELECT * FROM (SELECT * FROM batch_staleness WHERE policy = :policy ORDER BY created_at DESC
    LIMIT {RECENT_BATCHES}) recent ORDER BY created_at
"""
# Staleness when a trainer took the batch: a batch trained into version v was stepped on v - 1; a skipped one
# is recorded with the version it was measured against.
TAKEN: Final = f"""
    SELECT * FROM (SELECT t.outcome, t.trained_at,
        CASE t.outcome WHEN 'trained' THEN t.policy_version - 1 ELSE t.policy_version END
        - b.min_policy_version AS behind FROM trained_batches t
    JOIN batches b USING (batch_id) WHERE t.policy = :policy AND t.outcome IN ('trained', 'stale')
    ORDER BY t.trained_at DESC, t.batch_id LIMIT {RECENT_BATCHES}) recent ORDER BY trained_at
"""
TRAINING: Final = """
    SELECT count(*) AS taken, count(*) FILTER (WHERE outcome = 'stale') AS skipped
    FROM trained_batches WHERE policy = :policy AND outcome IN ('trained', 'stale')
"""


def runs_router(browser: Browser, page: Page, error_page: Page) -> APIRouter:
    """The runs: every policy's figures, and one policy's page."""
    router = APIRouter()

    @router.get("/runs", response_class=HTMLResponse)
    async def runs(request: Request) -> HTMLResponse:
        engine, _ = await browser.open()
        async with engine.connect() as connection:
            stats = (await connection.execute(sa.text(RUN_STATS.format(where="")))).mappings().all()
        return page(request, "runs.html", stats=stats)

    @router.get("/runs/{policy}", response_class=HTMLResponse)
    async def run(request: Request, policy: str) -> HTMLResponse:
        refresh = _refresh(request)
        engine, _ = await browser.open()
        async with engine.connect() as connection:
            figures = await run_figures(connection, policy)
        if figures["stats"] is None:
            return error_page(
                request,
                404,
                "No such run",
                f"no episodes of policy {policy!r} in the episodes read model (is the materializer running?)",
            )
        return page(request, "run.html", policy=policy, refresh=refresh, **figures)

    return router


def _refresh(request: Request) -> int | None:
    unknown = sorted(set(request.query_params) - {"refresh"})
    if unknown:
        raise BadRequest(f"unknown parameter {unknown[0]!r}: the run page takes refresh (seconds)")
    text = request.query_params.get("refresh")
    if text is None:
        return None
    if not text.isdigit() or not 5 <= int(text) <= 3600:
        raise BadRequest(f"refresh: {text!r} is not a number of seconds from 5 to 3600")
    return int(text)


async def run_figures(connection: AsyncConnection, policy: str) -> dict[str, Any]:
    """The run page's numbers and charts for one policy."""

    async def rows(statement: str, **params: Any) -> list[Mapping[str, Any]]:
        found = await connection.execute(sa.text(statement), {"policy": policy, **params})
        return [dict(row) for row in found.mappings()]

    stats = await rows(RUN_STATS.format(where="WHERE policy = :policy"))
    if not stats:
        return {"stats": None}
    by_version = await rows(BY_VERSION)
    spread = dict((await rows(SPREAD))[0])
    histogram: list[list[int]] = spread.pop("histogram")
    staleness = await rows(STALENESS)
    trained = [row for row in await rows(TAKEN) if row["outcome"] == "trained"]
    return {
        "stats": stats[0],
        "by_version": by_version,
        "reward_chart": _reward_chart(by_version),
        "throughput_chart": await _throughput_chart(rows),
        "staleness": staleness,
        "staleness_chart": svg.line_chart(
            [float(index) for index in range(len(staleness))],
            [float(row["mean_staleness"] or 0.0) for row in staleness],
            low=[float(row["min_staleness"]) for row in staleness],
            high=[float(row["max_staleness"]) for row in staleness],
            xlabel=f"batch (oldest to newest of the last {RECENT_BATCHES})",
            ylabel="versions behind",
            title="staleness per batch: mean, with the band from the freshest to the stalest sample",
        ),
        "training": (await rows(TRAINING))[0],
        "training_chart": svg.line_chart(
            [float(index) for index in range(len(trained))],
            [float(row["behind"]) for row in trained],
            xlabel=f"trained batch (oldest to newest of the last {RECENT_BATCHES} taken)",
            ylabel="versions behind",
            title="staleness at training time: the batch's oldest sample against the version stepped on",
        ),
        "terminations": await rows(TERMINATIONS),
        "spread": spread,
        "recent_groups": RECENT_GROUPS,
        "spread_chart": svg.bar_chart(
            [(min(int(bucket), 10) - 1, float(groups)) for bucket, groups in histogram],
            slots=10,
            x_low=0.0,
            x_high=float(spread["max_stddev"] or 0.0),
            xlabel=f"reward std within a group (10 buckets up to {float(spread['max_stddev'] or 0):.4g}; "
            f"the last {RECENT_GROUPS:,} finished groups at most)",
            ylabel="groups",
            title="group reward spread",
        ),
    }


def _reward_chart(by_version: list[Mapping[str, Any]]) -> str:
    xs, means, lows, highs = [], [], [], []
    for row in by_version:
        mean = float(row["mean_reward"])
        half = 1.96 * float(row["stddev_reward"] or 0.0) / math.sqrt(max(int(row["rewarded"]), 1))
        xs.append(float(row["policy_version"]))
        means.append(mean)
        lows.append(mean - half)
        highs.append(mean + half)
    return svg.line_chart(
        xs,
        means,
        low=lows,
        high=highs,
        xlabel="policy version",
        ylabel="mean reward",
        title="mean reward per policy version, with its 95% confidence band",
    )


async def _throughput_chart(rows: Any) -> str:
    """Turns per second of finished episodes in ``THROUGHPUT_BARS`` bars over the run: from the per-second
    rollup while a bar is under a minute wide (at most 40 minutes of rows), else the per-minute one with bars
    a whole number of minutes wide (each minute in one bar)."""
    span = (await rows(SPAN))[0]
    if span["first"] is None:
        return svg.bar_chart([], slots=1, x_low=0, x_high=1, xlabel="", ylabel="", title="")
    first: dt.datetime = span["first"]
    width = max(((span["last"] - first).total_seconds() + 1) / THROUGHPUT_BARS, 1.0)
    rollup = 60 if width >= 60 else 1
    if rollup == 60:
        width = math.ceil(width / 60) * 60
        first = first.replace(second=0, microsecond=0)
    bars = await rows(THROUGHPUT, first=first, width=width, rollup=rollup)
    slots = int(bars[-1]["bar"]) + 1 if bars else 1
    return svg.bar_chart(
        [(int(row["bar"]), float(row["turns"]) / width) for row in bars],
        slots=slots,
        x_low=0.0,
        x_high=slots * width,
        xlabel=f"seconds since the first finished episode (bars of {width:.0f} s)",
        ylabel="turns/s",
        title="turns per second of finished episodes",
    )
