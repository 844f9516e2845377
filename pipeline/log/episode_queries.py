"""PostgreSQL side of the store port's ``RunnerLeases`` and ``EpisodeIndex`` (``pipeline.log.port``): runner
lease rows, abandoned episodes, and episodes found and listed from the log's EpisodeStarted rows.

``EventStore`` calls these with its own engine, so each statement runs as the login that opened the store
(the runner's for leases, the reader's for look-ups), as it did before they moved here.
"""

from __future__ import annotations

import re
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from pipeline.log.port import AbandonedEpisode, EpisodeFilter, EpisodeRow
from pipeline.log.tables import events, runners

EPISODE_PREFIX = "episode-"


# -- runner leases ----------------------------------------------------------------------------------------


async def start_lease(engine: AsyncEngine, runner_id: str, *, host: str, pid: int) -> None:
    async with engine.begin() as connection:
        await connection.execute(sa.insert(runners).values(runner_id=runner_id, host=host, pid=pid))


async def renew_lease(engine: AsyncEngine, runner_id: str) -> None:
    async with engine.begin() as connection:
        await connection.execute(
            sa.update(runners).where(runners.c.runner_id == runner_id).values(heartbeat_at=sa.func.now())
        )


async def end_lease(engine: AsyncEngine, runner_id: str) -> None:
    async with engine.begin() as connection:
        await connection.execute(
            sa.update(runners).where(runners.c.runner_id == runner_id).values(stopped_at=sa.func.now())
        )


_ABANDONED = sa.text(
    """
    SELECT s.stream, s.metadata ->> :runner_key AS runner_id,
           (SELECT max(e.version) FROM events e WHERE e.stream = s.stream) AS version
    FROM events s
    WHERE s.type = 'EpisodeStarted'
      AND NOT EXISTS (SELECT 1 FROM events f WHERE f.type = 'EpisodeFinished' AND f.stream = s.stream)
      AND CASE
            WHEN s.metadata ? :runner_key THEN NOT EXISTS (
                SELECT 1 FROM runners r
                WHERE r.runner_id = s.metadata ->> :runner_key
                  AND r.stopped_at IS NULL
                  AND r.heartbeat_at > now() - make_interval(secs => :lease_timeout))
            ELSE (SELECT max(e.recorded_at) FROM events e WHERE e.stream = s.stream)
                 < now() - make_interval(secs => :orphan_after)
          END
    ORDER BY s.position
    """
)


async def abandoned_episodes(
    engine: AsyncEngine, *, runner_key: str, lease_timeout: float, orphan_after: float
) -> list[AbandonedEpisode]:
    params = {"runner_key": runner_key, "lease_timeout": lease_timeout, "orphan_after": orphan_after}
    async with engine.connect() as connection:
        rows = (await connection.execute(_ABANDONED, params)).all()
    return [AbandonedEpisode(row.stream, row.runner_id, int(row.version)) for row in rows]


# -- finding and listing episodes -------------------------------------------------------------------------


def _like_prefix(text: str) -> str:
    return re.sub(r"([\\%_])", r"\\\1", text) + "%"


async def find_episode_ids(engine: AsyncEngine, text: str, limit: int) -> list[str]:
    e = events
    exact = sa.select(e.c.stream).where(e.c.type == "EpisodeStarted", e.c.stream == EPISODE_PREFIX + text)
    # EpisodeStarted rows have a partial index (events_episode_started); the LIKE filters those rows only.
    prefix = EPISODE_PREFIX + _like_prefix(text)
    by_prefix = (
        sa.select(e.c.stream)
        .where(e.c.type == "EpisodeStarted", e.c.stream.like(prefix, escape="\\"))
        .order_by(e.c.position)
        .limit(limit)
    )
    async with engine.connect() as connection:
        if await connection.scalar(exact) is not None:
            return [text]
        streams = list((await connection.scalars(by_prefix)).all())
    return [str(stream).removeprefix(EPISODE_PREFIX) for stream in streams]


def _listing_query(filters: EpisodeFilter) -> sa.Select[Any]:
    """Episodes from the log itself: EpisodeStarted rows, their EpisodeFinished, turn counts, reward sums."""
    e = events
    started, finished, other = e.alias("started"), e.alias("finished"), e.alias("other")
    turns = (
        sa.select(sa.func.count())
        .where(other.c.stream == started.c.stream, other.c.type == "TurnCompleted")
        .scalar_subquery()
    )
    reward_values = e.alias("reward")
    reward = (
        sa.select(sa.func.sum(reward_values.c.data["value"].as_float()))
        .where(reward_values.c.stream == started.c.stream, reward_values.c.type == "RewardAssigned")
        .scalar_subquery()
    )
    conditions: list[sa.ColumnElement[bool]] = [started.c.type == "EpisodeStarted"]
    if filters.policy is not None:
        conditions.append(started.c.data["policy"].as_string() == filters.policy)
    if filters.agent is not None:
        conditions.append(started.c.data["agent"].as_string() == filters.agent)
    if filters.since is not None:
        conditions.append(started.c.recorded_at >= filters.since)
    if filters.status == "running":
        conditions.append(finished.c.position.is_(None))
    elif filters.status == "finished":
        conditions.append(finished.c.position.is_not(None))
    if filters.termination is not None:
        conditions.append(finished.c.data["termination"].as_string() == filters.termination)
    listing = (
        sa.select(
            started.c.position,
            started.c.data["episode_id"].as_string().label("episode_id"),
            started.c.data["policy"].as_string().label("policy"),
            started.c.data["agent"].as_string().label("agent"),
            started.c.data["task_id"].as_string().label("task_id"),
            started.c.recorded_at.label("started_at"),
            finished.c.recorded_at.label("finished_at"),
            finished.c.data["termination"].as_string().label("termination"),
            turns.label("turns"),
            reward.label("reward"),
        )
        .select_from(
            started.outerjoin(
                finished, sa.and_(finished.c.stream == started.c.stream, finished.c.type == "EpisodeFinished")
            )
        )
        .where(*conditions)
        .subquery()
    )
    query = sa.select(listing)
    if filters.min_reward is not None:
        query = query.where(listing.c.reward >= filters.min_reward)
    if filters.max_reward is not None:
        query = query.where(listing.c.reward <= filters.max_reward)
    return query.order_by(listing.c.position.desc()).limit(filters.limit + 1)


async def list_episodes(engine: AsyncEngine, filters: EpisodeFilter) -> list[EpisodeRow]:
    async with engine.connect() as connection:
        rows = (await connection.execute(_listing_query(filters))).all()
    return [
        EpisodeRow(
            episode_id=row.episode_id,
            policy=row.policy,
            agent=row.agent,
            task_id=row.task_id,
            started_at=row.started_at,
            finished_at=row.finished_at,
            termination=row.termination,
            turns=int(row.turns),
            reward=None if row.reward is None else float(row.reward),
        )
        for row in rows
    ]
