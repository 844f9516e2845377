"""Listing episodes from the log with filters (policy, agent, task, status, time, tags, ...)."""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Sequence
from typing import Any, Final

from rich.table import Table
from rich.text import Text

from pipeline.errors import ConfigError
from pipeline.log import EpisodeFilter, EpisodeRow, Store
from pipeline.materialize import TurnLineage
from pipeline.replay.transcript import clock_time, short_number

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


async def list_episodes(store: Store, filters: EpisodeFilter) -> tuple[list[EpisodeRow], bool]:
    """Episodes matching ``filters``, newest first, and whether more than ``filters.limit`` matched."""
    episodes = await store.list_episodes(filters)
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


def lineages_json(turns: Sequence[TurnLineage]) -> list[dict[str, Any]]:
    """An episode's lineages, first root first: why each started, its turns and which are trained."""
    shown = []
    for root, members in _by_lineage(turns):
        shown.append(
            {
                "root_turn_id": root.turn_id,
                "started_because": root.root_reason,
                "model": root.model,
                "edit": root.edit,
                "turns": [
                    {
                        "index": turn.index,
                        "turn_id": turn.turn_id,
                        "parent_turn_id": turn.parent_turn_id,
                        "trained": turn.trained,
                        "why_not_trained": turn.why_not,
                        "delivered": turn.delivered,
                    }
                    for turn in members
                ],
            }
        )
    return shown


def lineages_table(episode_id: str, turns: Sequence[TurnLineage]) -> Table:
    """``lineages_json`` as a table: a row per lineage, its turns by index (a turn not trained says why)."""
    table = Table(title=f"episode {episode_id}: lineages", show_header=True, header_style="bold")
    for name in ("root", "started because", "model", "turns", "trained", "edit"):
        table.add_column(name, overflow="fold")
    for root, members in _by_lineage(turns):
        trained = [str(turn.index) for turn in members if turn.trained]
        not_trained = [f"{turn.index} ({turn.why_not})" for turn in members if not turn.trained]
        table.add_row(
            f"turn {root.index}",
            root.root_reason or "-",
            root.model or "-",
            " ".join(str(turn.index) for turn in members),
            f"{len(trained)}/{len(members)}" + (f"; not: {', '.join(not_trained)}" if not_trained else ""),
            "; ".join(root.edit) or "-",
        )
    return table


def _by_lineage(turns: Sequence[TurnLineage]) -> list[tuple[TurnLineage, list[TurnLineage]]]:
    members: dict[str, list[TurnLineage]] = {}
    for turn in sorted(turns, key=lambda turn: turn.index):
        members.setdefault(turn.lineage, []).append(turn)
    by_id = {turn.turn_id: turn for turn in turns}
    return [(by_id[root], group) for root, group in members.items()]
