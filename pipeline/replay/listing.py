"""Listing episodes from the log with filters (policy, agent, task, status, time, tags, ...)."""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

import sqlalchemy as sa
from rich.table import Table
from rich.text import Text

from pipeline.errors import ConfigError
from pipeline.log import EventStore
from pipeline.log.tables import events as events_table
from pipeline.replay.transcript import clock_time, short_number


@dataclass(frozen=True)
class EpisodeFilter:
    policy: str | None = None
    status: Literal["running", "finished"] | None = None
    termination: str | None = None
    agent: str | None = None
    min_reward: float | None = None
    max_reward: float | None = None
    since: dt.datetime | None = None
    limit: int = 20


@dataclass(frozen=True)
class EpisodeRow:
    episode_id: str
    policy: str
    agent: str
    task_id: str
    started_at: dt.datetime
    finished_at: dt.datetime | None
    termination: str | None
    turns: int
    reward: float | None

    @property
    def status(self) -> str:
        return "running" if self.termination is None else self.termination

    @property
    def duration_s(self) -> float | None:
        return None if self.finished_at is None else (self.finished_at - self.started_at).total_seconds()


_SINCE = re.compile(r"^(\d+(?:\.\d+)?)\s*(s|m|h|d|w)$")
_UNITS: Final = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_since(text: str, now: dt.datetime | None = None) -> dt.datetime:
    """``30m``, ``1h``, ``2d``, ``1w`` ago, or an ISO date or time (local time unless it names a zone)."""
    now = now or dt.datetime.now(dt.UTC)
    relative = _SINCE.match(text.strip())
    if relative:
        return now - dt.timedelta(seconds=float(relative[1]) * _UNITS[relative[2]])
    try:
        moment = dt.datetime.fromisoformat(text.strip())
    except ValueError:
        raise ConfigError(
            f"--since {text!r}: give a duration ago (30m, 1h, 2d, 1w) or a date or time "
            "(2026-11-23, 2026-11-23T10:30)"
        ) from None
    return moment if moment.tzinfo else moment.astimezone()


def _listing_query(filters: EpisodeFilter) -> sa.Select[Any]:
    """Episodes from the log itself: EpisodeStarted rows, their EpisodeFinished, turn counts, reward sums."""
    e = events_table
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


async def list_episodes(store: EventStore, filters: EpisodeFilter) -> tuple[list[EpisodeRow], bool]:
    """Episodes matching ``filters``, newest first, and whether more than ``filters.limit`` matched."""
    async with store.engine.connect() as connection:
        rows = (await connection.execute(_listing_query(filters))).all()
    episodes = [
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
    return episodes[: filters.limit], len(episodes) > filters.limit


def episodes_table(rows: Sequence[EpisodeRow]) -> Table:
    table = Table(show_header=True, header_style="bold")
    for name in ("episode", "started", "policy", "agent", "task", "status"):
        table.add_column(name, overflow="fold")
    for name in ("turns", "reward", "seconds"):
        table.add_column(name, justify="right")
    for row in rows:
        style = "" if row.termination in (None, "done") else "red" if row.termination == "error" else "yellow"
        table.add_row(
            row.episode_id,
            clock_time(row.started_at),
            row.policy,
            row.agent,
            row.task_id,
            Text(row.status, style=style),
            str(row.turns),
            "-" if row.reward is None else short_number(round(row.reward, 6)),
            "-" if row.duration_s is None else f"{row.duration_s:.2f}",
        )
    return table


def episode_row_json(row: EpisodeRow) -> dict[str, Any]:
    return {
        "episode_id": row.episode_id,
        "policy": row.policy,
        "agent": row.agent,
        "task_id": row.task_id,
        "status": "running" if row.termination is None else "finished",
        "termination": row.termination,
        "turns": row.turns,
        "reward": row.reward,
        "started_at": row.started_at.isoformat(),
        "finished_at": row.finished_at.isoformat() if row.finished_at else None,
        "duration_s": row.duration_s,
    }
