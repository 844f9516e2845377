"""The fold's state where it stopped, as its checkpoint and read models hold it: what a restart loads."""

from __future__ import annotations

from collections import deque
from datetime import datetime
from typing import Any

import psycopg
from psycopg import sql

from pipeline.materialize.fold import Fold
from pipeline.materialize.records import LogRow, PendingGroup, ReadySample, log_rows, read_query
from pipeline.materialize.writes import qualified


async def read_log(
    connection: psycopg.AsyncConnection[Any], where: str, params: dict[str, Any], limit: int | None = None
) -> list[LogRow]:
    """The events ``where`` selects, in log order. Only what the fold reads of ``data`` comes (see
    ``UNFOLDED_FIELDS``), in binary (token arrays as bytes, not hex), and a page's JSON is parsed in one
    call: reading the log was a third of a rebuild's Python."""
    cursor = connection.cursor(binary=True)
    rows = await (await cursor.execute(*read_query(where, params, limit))).fetchall()
    return log_rows(rows)


async def load_state(connection: psycopg.AsyncConnection[Any], fold: Fold, schema: str) -> None:
    """Where ``fold`` stopped, from its checkpoint and the read models of ``schema``: its open episodes
    (their events), the policies' newest versions, and the samples not yet in a batch."""
    row = await (
        await connection.execute(
            "SELECT position FROM checkpoints WHERE name = %s", (fold.config.checkpoint,)
        )
    ).fetchone()
    fold.position = int(row[0]) if row else 0
    running = await (
        await connection.execute(
            sql.SQL("SELECT stream FROM {} WHERE status = 'running'").format(qualified(schema, "episodes"))
        )
    ).fetchall()
    if running:
        for log_row in await read_log(
            connection,
            "stream = ANY(%(streams)s) AND position <= %(position)s",
            {"streams": [r[0] for r in running], "position": fold.position},
        ):
            fold.open.setdefault(log_row.stream, []).append(log_row)
    versions = await (
        await connection.execute(
            "SELECT data->>'policy', max((data->>'version')::int) FROM events "
            "WHERE type = 'PolicyVersionPublished' AND position <= %s GROUP BY 1",
            (fold.position,),
        )
    ).fetchall()
    seen = await (
        await connection.execute(
            sql.SQL(
                "SELECT policy, max(max_policy_version) FROM {} WHERE status = 'finished' GROUP BY 1"
            ).format(qualified(schema, "episodes"))
        )
    ).fetchall()
    for policy, version in [*versions, *seen]:
        if version is not None:
            fold.newest[policy] = max(fold.newest.get(policy, 0), int(version))
    await load_samples(connection, fold, schema)


async def load_samples(connection: psycopg.AsyncConnection[Any], fold: Fold, schema: str) -> None:
    """The samples not yet in a batch: made ready (queued for a batch) or waiting for their group."""
    query = sql.SQL(
        "SELECT s.sample_id, s.episode_id, s.group_id, s.policy, s.turn_ids, s.policy_version, s.tokens, "
        "s.reward, s.arrays, s.position, s.advantage, s.ready_position, e.group_size, e.finished_at, "
        "s.slot "
        "FROM {} s JOIN {} e USING (episode_id) WHERE s.batch_id IS NULL "
        "ORDER BY s.ready_position NULLS LAST, s.group_id, s.position, s.sample_id"
    ).format(qualified(schema, "samples"), qualified(schema, "episodes"))
    rows = await (await connection.execute(query)).fetchall()
    ready: dict[tuple[str, int, str], list[ReadySample]] = {}
    pending: list[tuple[datetime, str, PendingGroup]] = []
    groups: dict[tuple[str, str], PendingGroup] = {}
    for r in rows:
        sample = ReadySample(
            sample_id=r[0], episode_id=r[1], group_id=r[2], policy=r[3],
            turn_ids=tuple(str(t) for t in r[4]), policy_version=r[5], tokens=r[6], reward=r[7],
            arrays=bytes(r[8]), position=r[9], advantage=r[10], slot=r[14],
        )  # fmt: skip
        if r[11] is not None:
            ready.setdefault((r[3], r[11], r[2]), []).append(sample)
            continue
        size = int(r[12]) if r[2] != r[1] else 1
        group = groups.get((r[3], r[2]))
        if group is None:
            group = groups[(r[3], r[2])] = PendingGroup(r[3], r[2], size, r[13])
            pending.append((r[13], r[2], group))
        group.last_time = max(group.last_time, r[13])
        group.episodes.add(r[1])
        group.samples.append(sample)
    for (policy, _, _), members in sorted(ready.items(), key=lambda item: (item[0][1], item[0][2])):
        fold.queues.setdefault(policy, deque()).append(members)
    for _, _, group in sorted(pending, key=lambda item: (max(s.position for s in item[2].samples), item[1])):
        fold.pending[(group.policy, group.group_id)] = group
