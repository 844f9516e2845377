"""The episode browser under load: p50/p95 of its list page and its episode page on a log of many turns,
beside the raw queries they rest on, measured in the same run.

What it does, in one run on one PostgreSQL server (an embedded one, or ``TURNSTILE_DATABASE_URL``'s, in a
scratch database dropped at the end):

1. The log (not timed as a result). ``--turns`` turns (4 per episode: 250,000 episodes for a million)
   in the read models the list reads: ``episodes`` and ``turn_rows`` rows written with COPY, as the
   materializer would have left them (policies, agents, tasks, groups of 8, tags, rewards, terminations
   with 2% errors, policy versions rising over time, 0.5% of turns with a prefix break and 1% with render
   drift). ``--with-events`` of those episodes (2,000 by default) are also recorded in the log through
   ``EventStore.append`` (EpisodeStarted, four TurnCompleted extending each other's tokens, a reward, the
   end): the episode page reads the log, and these are the episodes it is timed on. Then ``VACUUM ANALYZE``
   (and ``ANALYZE`` of the rollups the trigger filled, as autovacuum would on a live server).
2. ``turnstile ui`` in a process of its own (``--allow-superuser``: the bench logs in as the server's owner),
   and sequential GETs from this process with httpx: each list view ``--repeat`` times, the episode page
   on ``--repeat`` different episodes. The first request of each view is a warm-up, not counted.
3. Baselines in the same run: for each list view, the page's own SELECT (as built by
   ``pipeline.ui.filters.page_query``, run with SQLAlchemy over psycopg, synchronously); for the episode
   page, the SELECT of one stream's events (what ``EventStore.read_stream`` sends); and ``GET /healthz``
   (HTTP and the app, no query).
   "x baseline" is the page's p95 over its baseline query's p95: what rendering, folding and HTTP add.

4. The run page (``/runs/main``: three quarters of the episodes), beside the queries it sent before
   migration 0022 (the views ``episode_stats``, ``reward_by_policy_version``, ``terminations`` and
   ``group_rewards`` over every episode of the policy, and the throughput buckets), run in the same run:
   there "x baseline" is the page's p95 now over those queries' p95 (under 1: faster than before).

5. What the rollups cost the materializer's writes (migration 0021's trigger on ``episodes``): a COPY of
   2,000 episodes and of one, each into ``episodes`` and into a copy of it without the trigger,
   alternating, each rolled back.

The target (issues 20 and 35) is a p95 under 300 ms for every page at a million turns.

    python bench/ui.py                         # 1,000,000 turns
    python bench/ui.py --turns 16000 200000    # one log after the other, each in its own database
    python bench/ui.py --quick                 # 100,000 turns

To time the pages again without building the log again, keep it in a database of its own name: the first
run builds it there and leaves it; a later run with the same name finds its episodes and only measures
(``TURNSTILE_DATABASE_URL`` names the server; without it the embedded server of ``--tmp-dir`` lives only
for the run, so name a server that outlives it)::

    TURNSTILE_DATABASE_URL=postgresql://postgres@127.0.0.1:5432/postgres \
        python bench/ui.py --database turnstile_ui_1m
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import io
import json
import os
import random
import re
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import psycopg
import sqlalchemy as sa
from psycopg.types.json import Jsonb
from sqlalchemy.engine import make_url

from pipeline.log import EventStore
from pipeline.log.db import migrate
from pipeline.materialize.columns import TURN_COLUMNS
from pipeline.settings import libpq_url, sqlalchemy_url
from pipeline.ui.filters import page_query, parse_query
from schemas import (
    ChatMessage,
    EpisodeFinished,
    EpisodeStarted,
    RewardAssigned,
    TurnCompleted,
    TurnReply,
    TurnRequest,
)
from schemas.common import Timings

from common import load_average, machine, note, percentile, postgres_server, scratch_database, summary

TARGET_MS = 300.0
TURNS_PER_EPISODE = 4
GROUP = 8
POLICIES = ("main", "main", "main", "eval")
AGENTS = ("agents.calc:CalculatorAgent", "agents.web:BrowseAgent", "agents.code:CodeAgent")
TERMINATIONS = ("done",) * 90 + ("max_turns",) * 4 + ("truncated",) * 3 + ("error",) * 2 + ("timeout",)
EPOCH = dt.datetime(2026, 11, 1, tzinfo=dt.UTC)
LIST_VIEWS = {
    "newest first": "",
    "policy + finished": "policy=main&status=finished",
    "by reward, desc": "sort=reward&order=desc",
    "reward range + tag": "min_reward=0.5&max_reward=0.9&tag=split%3Dtrain",
    "agent + version": "agent=agents.web:BrowseAgent&version=3",
    "errors": "errors=1",
    "prefix breaks": "prefix_break=1",
    "render drift, by turns": "render_drift=1&sort=turns",
    "page 40": "page=40",
}
RUN_POLICY = "main"
# What the run page sent before migration 0021 for the figures that grow with the run: aggregates over every
# episode (and group) of the policy through the views of migration 0004. Kept here as the baseline.
RUN_QUERIES_BEFORE = (
    "SELECT * FROM episode_stats WHERE policy = %(policy)s",
    "SELECT * FROM reward_by_policy_version WHERE policy = %(policy)s AND rewarded > 0 "
    "ORDER BY policy_version",
    "SELECT min(finished_at) AS first, max(finished_at) AS last FROM episodes "
    "WHERE policy = %(policy)s AND status = 'finished'",
    "SELECT floor(extract(epoch FROM finished_at - %(first)s) / %(width)s)::int AS bucket, count(*), "
    "coalesce(sum(turns), 0) FROM episodes WHERE policy = %(policy)s AND status = 'finished' "
    "GROUP BY bucket ORDER BY bucket",
    "SELECT termination, episodes, share FROM terminations WHERE policy = %(policy)s ORDER BY episodes DESC",
    "SELECT count(*), count(*) FILTER (WHERE zero_spread), avg(stddev_reward), max(stddev_reward) "
    "FROM group_rewards WHERE policy = %(policy)s AND finished = episodes AND episodes > 1",
    "SELECT width_bucket(stddev_reward, 0, 1, 10) AS bucket, count(*) FROM group_rewards "
    "WHERE policy = %(policy)s AND finished = episodes AND episodes > 1 AND stddev_reward IS NOT NULL "
    "GROUP BY bucket ORDER BY bucket",
)


# --- the log -------------------------------------------------------------------------------------------


def episode_id(index: int) -> str:
    return f"ep{index:07d}-{uuid.UUID(int=index * 7919 + 1).hex[:16]}"


def recorded_turns(index: int, rng: random.Random) -> list[TurnCompleted]:
    """Four turns, each extending the previous one's exact tokens, as a session records them."""
    turns: list[TurnCompleted] = []
    messages = [
        ChatMessage(role="system", content="You are a careful assistant. " * 8),
        ChatMessage(role="user", content=f"Task {index}: " + "describe the next step. " * 20),
    ]
    prompt = [rng.randrange(50_000) for _ in range(200)]
    for _ in range(TURNS_PER_EPISODE):
        completion = [rng.randrange(50_000) for _ in range(rng.randint(20, 60))]
        turn = TurnCompleted(
            parent_turn_id=turns[-1].turn_id if turns else None,
            request=TurnRequest(messages=list(messages)),
            reply=TurnReply(text="step " * (len(completion) // 2), finish_reason="stop"),
            prompt_token_ids=prompt,
            completion_token_ids=completion,
            completion_logprobs=[-rng.random() * 3 for _ in completion],
            policy_version=min(index // 25_000, 9),
            engine_id="bench-engine",
            timings=Timings(queued_ms=1.0, first_token_ms=20.0, total_ms=300.0),
        )
        turns.append(turn)
        messages += [
            ChatMessage(role="assistant", content=turn.reply.text),
            ChatMessage(role="user", content="go on " * 10),
        ]
        prompt = [*prompt, *completion, *(rng.randrange(50_000) for _ in range(30))]
    return turns


async def record_events(url: str, indexes: list[int]) -> dict[int, list[TurnCompleted]]:
    """The sampled episodes recorded in the log through the store (group-committed appends)."""
    store = await EventStore.connect(url)
    recorded: dict[int, list[TurnCompleted]] = {}

    async def one(index: int) -> None:
        rng = random.Random(index)
        turns = recorded_turns(index, rng)
        recorded[index] = turns
        events = [
            EpisodeStarted(
                episode_id=episode_id(index),
                task_id=f"task-{index // GROUP}",
                agent=AGENTS[index % 3],
                policy=POLICIES[index % 4],
                group_id=f"g{index // GROUP}",
                group_size=GROUP,
            ),
            *turns,
            RewardAssigned(value=round(rng.random(), 3), source="bench"),
            EpisodeFinished(termination="done"),
        ]
        await store.append(f"episode-{episode_id(index)}", events, expected_version=0)

    try:
        for start in range(0, len(indexes), 200):
            await asyncio.gather(*(one(index) for index in indexes[start : start + 200]))
    finally:
        await store.close()
    return recorded


def _row(values: list[Any]) -> str:
    out = []
    for value in values:
        if value is None:
            out.append("\\N")
        else:
            text = value.isoformat() if isinstance(value, dt.datetime) else str(value)
            out.append(text.replace("\\", "\\\\").replace("\t", "\\t").replace("\n", "\\n"))
    return "\t".join(out) + "\n"


def write_read_models(url: str, episodes: int, recorded: dict[int, list[TurnCompleted]], seed: int) -> None:
    """``episodes`` and ``turn_rows`` rows as the materializer leaves them, COPYed in chunks. A turn's
    ``position`` here is not its event's (only some episodes are recorded in the log): the view ``turns``
    gives NULL engine and timings for most of them; the list pages read only ``turn_rows`` columns."""
    rng = random.Random(seed)
    position = 0
    with psycopg.connect(url) as connection:
        for start in range(0, episodes, 50_000):
            episode_rows, turn_rows = io.StringIO(), io.StringIO()
            for index in range(start, min(start + 50_000, episodes)):
                started = EPOCH + dt.timedelta(seconds=index * 0.5)
                termination = rng.choice(TERMINATIONS)
                version = min(index // 25_000, 9)
                reward = None if termination == "error" else round(rng.random(), 3)
                turns = recorded.get(index)
                turn_ids = (
                    [t.turn_id for t in turns]
                    if turns
                    else [uuid.UUID(int=rng.getrandbits(128)) for _ in range(TURNS_PER_EPISODE)]
                )
                prompt_total = completion_total = 0
                first_position = position + 1
                for k, turn_id in enumerate(turn_ids):
                    position += 2
                    prompt, completion = 200 + 70 * k, rng.randint(20, 60)
                    prompt_total, completion_total = prompt_total + prompt, completion_total + completion
                    turn_rows.write(  # TURN_COLUMNS: the view turns adds the event's fields (migration 0013)
                        _row(
                            [
                                turn_id,
                                first_position,
                                position,
                                -rng.random() * 2,
                                reward if k == len(turn_ids) - 1 and reward is not None else 0.0,
                                reward or 0.0,
                                k,
                                prompt,
                                completion,
                                version,
                                turn_ids[k - 1] if k else None,
                                "t" if rng.random() < 0.005 else "f",
                                "t" if rng.random() < 0.01 else "f",
                                "t",  # delivered
                                "t",  # trained
                                turn_ids[0],  # lineage: one per episode
                                "first call" if k == 0 else None,
                            ]
                        )
                    )
                tags = {"split": "train" if index % 5 else "eval", "suite": f"s{index % 7}"}
                episode_rows.write(
                    _row(
                        [
                            episode_id(index),
                            f"episode-{episode_id(index)}",
                            POLICIES[index % 4],
                            AGENTS[index % 3],
                            f"task-{index // GROUP}",
                            f"g{index // GROUP}",
                            GROUP,
                            None,
                            json.dumps(tags),
                            "finished",
                            termination,
                            "Traceback ...\nValueError: bench" if termination == "error" else None,
                            reward,
                            len(turn_ids),
                            prompt_total,
                            completion_total,
                            version,
                            version,
                            started,
                            started + dt.timedelta(seconds=4),
                            4.0,
                            first_position,
                            position + 1,
                        ]
                    )
                )
                position += 2
            with connection.cursor() as cursor:
                with cursor.copy("COPY episodes FROM STDIN") as copy:
                    copy.write(episode_rows.getvalue())
                with cursor.copy(f"COPY turn_rows ({', '.join(TURN_COLUMNS)}) FROM STDIN") as copy:
                    copy.write(turn_rows.getvalue())
            connection.commit()
            note(f"read models: {min(start + 50_000, episodes):,} of {episodes:,} episodes written")
    with psycopg.connect(url, autocommit=True) as connection:
        connection.execute("VACUUM (ANALYZE) episodes")
        connection.execute("VACUUM (ANALYZE) turn_rows")
        connection.execute("VACUUM (ANALYZE) events")
        # The rollups the trigger filled: statistics as autovacuum would gather them on a live server (on a
        # server with autovacuum off, the run page's plans would be made for empty tables).
        connection.execute("ANALYZE run_rollups, throughput_rollups, group_rollups")


# --- measuring -----------------------------------------------------------------------------------------


async def serve(url: str) -> tuple[asyncio.subprocess.Process, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TURNSTILE_")}
    env["TURNSTILE_READER_URL"] = url
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "consumers.cli",
        "ui",
        "--port",
        "0",
        "--allow-superuser",
        env=env,
        stderr=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.DEVNULL,
    )
    assert process.stderr is not None
    while line := (await process.stderr.readline()).decode():
        if found := re.search(r"episode browser on (http://\S+)/episodes", line):
            return process, found[1]
    raise SystemExit("turnstile ui did not start")


async def timed_get(client: httpx.AsyncClient, path: str) -> float:
    started = time.perf_counter()
    response = await client.get(path)
    elapsed = (time.perf_counter() - started) * 1000
    if response.status_code != 200:
        raise SystemExit(f"GET {path}: {response.status_code}\n{response.text[:2000]}")
    return elapsed


def timed_query(connection: psycopg.Connection[Any], statement: str, params: Any = None) -> float:
    started = time.perf_counter()
    connection.execute(statement, params).fetchall()
    return (time.perf_counter() - started) * 1000


def list_statement(query_string: str) -> sa.Select[Any]:
    params: dict[str, list[str]] = {}
    for pair in filter(None, query_string.split("&")):
        name, _, value = pair.partition("=")
        params.setdefault(name, []).append(value.replace("%3D", "="))
    return page_query(parse_query(params))


def timed_run_queries_before(connection: psycopg.Connection[Any]) -> float:
    """The run page's queries as it sent them before the rollups, one after the other."""
    started = time.perf_counter()
    params: dict[str, Any] = {"policy": RUN_POLICY, "first": EPOCH, "width": 1.0}
    for statement in RUN_QUERIES_BEFORE:
        rows = connection.execute(statement, params).fetchall()
        if statement.startswith("SELECT min(finished_at)") and rows[0][0] is not None:
            params["first"] = rows[0][0]
            params["width"] = max((rows[0][1] - rows[0][0]).total_seconds() / 40, 1.0)
    return (time.perf_counter() - started) * 1000


def rollup_cost(url: str, repeat: int) -> list[tuple[str, list[float], list[float]]]:
    """Writes into ``episodes`` (the rollup trigger fires) beside the same writes into a copy of the table
    without it (its indexes, no trigger), each rolled back: what the rollups add to the materializer."""
    with psycopg.connect(url) as connection:
        connection.execute("CREATE TEMPORARY TABLE bench_episodes_plain (LIKE episodes INCLUDING ALL)")
        connection.commit()
        names = [row[0] for row in connection.execute("SELECT * FROM episodes LIMIT 0").description or []]
        rows = connection.execute("SELECT * FROM episodes ORDER BY episode_id LIMIT 2000").fetchall()
        fresh = [
            tuple(f"new-{value}" if name == "episode_id" else value + 10**12 if name == "started_position"
                  else Jsonb(value) if isinstance(value, dict) else value
                  for name, value in zip(names, row, strict=True))
            for row in rows
        ]  # fmt: skip
        columns = ", ".join(names)

        def timed(table: str, batch: list[tuple[Any, ...]]) -> float:
            started = time.perf_counter()
            with connection.cursor() as cursor, cursor.copy(f"COPY {table} ({columns}) FROM STDIN") as copy:
                for row in batch:
                    copy.write_row(row)
            elapsed = (time.perf_counter() - started) * 1000
            connection.rollback()
            return elapsed

        results = []
        for size in (len(fresh), 1):
            with_trigger, plain = [], []
            for _ in range(repeat):
                with_trigger.append(timed("episodes", fresh[:size]))
                plain.append(timed("bench_episodes_plain", fresh[:size]))
            results.append((f"write {size:,} episode{'s' * (size > 1)}, rollups", with_trigger, plain))
    return results


def timed_select(connection: sa.Connection, statement: sa.Select[Any]) -> float:
    started = time.perf_counter()
    connection.execute(statement).all()
    return (time.perf_counter() - started) * 1000


async def measure(url: str, recorded: list[int], repeat: int) -> list[tuple[str, list[float], list[float]]]:
    results = []
    process, base = await serve(url)
    try:
        async with httpx.AsyncClient(base_url=base, timeout=60) as client:
            engine = sa.create_engine(sqlalchemy_url(url))
            with psycopg.connect(url, autocommit=True) as connection, engine.connect() as sa_connection:
                await timed_get(client, "/healthz")
                health = [await timed_get(client, "/healthz") for _ in range(repeat)]
                results.append(("GET /healthz (no query)", health, []))
                for name, query_string in LIST_VIEWS.items():
                    statement = list_statement(query_string)
                    await timed_get(client, f"/episodes?{query_string}")
                    timed_select(sa_connection, statement)
                    pages = [await timed_get(client, f"/episodes?{query_string}") for _ in range(repeat)]
                    queries = [timed_select(sa_connection, statement) for _ in range(repeat)]
                    results.append((f"list: {name}", pages, queries))
                shown = recorded[1 : repeat + 1]
                await timed_get(client, f"/episodes/{episode_id(recorded[0])}")
                pages = [await timed_get(client, f"/episodes/{episode_id(index)}") for index in shown]
                read = "SELECT * FROM events WHERE stream = %s ORDER BY version"
                queries = [
                    timed_query(connection, read, (f"episode-{episode_id(index)}",)) for index in shown
                ]
                results.append(("episode page (4 turns)", pages, queries))
                await timed_get(client, f"/runs/{RUN_POLICY}")
                timed_run_queries_before(connection)
                pages = [await timed_get(client, f"/runs/{RUN_POLICY}") for _ in range(repeat)]
                before = [timed_run_queries_before(connection) for _ in range(repeat)]
                results.append((f"run page ({RUN_POLICY})", pages, before))
    finally:
        process.terminate()
        await process.wait()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--turns", type=int, nargs="+", default=[1_000_000], help="one log of each size")
    parser.add_argument("--quick", action="store_true", help="100,000 turns")
    parser.add_argument("--with-events", type=int, default=2_000, help="episodes also recorded in the log")
    parser.add_argument("--repeat", type=int, default=50)
    parser.add_argument("--seed", type=int, default=20)
    parser.add_argument("--tmp-dir", type=Path)
    parser.add_argument(
        "--database",
        metavar="NAME",
        help="keep the log in this database (built on first use, measured again without rebuilding it)",
    )
    args = parser.parse_args()
    sizes = [100_000] if args.quick else args.turns
    if args.database and len(sizes) > 1:
        parser.error("--database keeps one log: give one size with --turns")
    note(machine())
    with postgres_server(args.tmp_dir) as (server, _):
        if args.database:
            bench_one_log(kept_database(server, args.database), sizes[0], args)
            return
        for turns in sizes:
            with scratch_database(server) as url:
                bench_one_log(url, turns, args)


def kept_database(server_url: str, name: str) -> str:
    """The URL of database ``name`` on the server, created if missing and migrated to the head either way
    (a log kept from before a migration is brought up to date); never dropped."""
    if not re.fullmatch(r"[a-z_][a-z0-9_]{0,62}", name):
        raise SystemExit(f"--database {name!r}: use lower-case letters, digits and underscores")
    admin_url = libpq_url(server_url)
    with psycopg.connect(admin_url, autocommit=True) as admin:
        if not admin.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone():
            admin.execute(f'CREATE DATABASE "{name}"')
            note(f"database {name} created; the log is built there and kept")
    url = libpq_url(make_url(admin_url).set(database=name).render_as_string(hide_password=False))
    migrate(url)
    return url


def kept_log(url: str, episodes: int) -> list[int] | None:
    """The episodes recorded in the log of a kept database (the ones the episode page is timed on, whatever
    ``--seed`` and ``--with-events`` say now), or None for an empty database, to be built. A database with
    another number of episodes (another size, or a build cut short) is refused rather than measured."""
    with psycopg.connect(url) as connection:
        row = connection.execute("SELECT count(*) FROM episodes").fetchone()
        found = row[0] if row else 0
        streams = connection.execute("SELECT DISTINCT stream FROM events WHERE version = 1").fetchall()
    if not found:
        return None
    if found != episodes:
        raise SystemExit(
            f"the database holds {found:,} episodes, not the {episodes:,} of --turns {episodes * 4:,}: "
            f"give --turns {found * TURNS_PER_EPISODE:,}, another --database, or drop this one"
        )
    return sorted(int(stream.removeprefix("episode-ep")[:7]) for (stream,) in streams)


def bench_one_log(url: str, turns: int, args: argparse.Namespace) -> None:
    """Build a log of ``turns`` turns in ``url``'s database, measure the pages on it, print the table."""
    episodes = turns // TURNS_PER_EPISODE
    rng = random.Random(args.seed)
    sampled = sorted(rng.sample(range(episodes), min(args.with_events, episodes)))
    started = time.perf_counter()
    if (kept := kept_log(url, episodes)) is not None:
        sampled = kept
        note(f"log of {episodes:,} episodes found in the database: measured without rebuilding it")
    else:
        recorded = asyncio.run(record_events(url, sampled))
        note(f"log: {len(sampled):,} episodes ({len(sampled) * 7:,} events) appended through EventStore")
        write_read_models(url, episodes, recorded, args.seed)
    with psycopg.connect(url) as connection:
        counts = connection.execute(
            "SELECT (SELECT count(*) FROM episodes), (SELECT count(*) FROM turns), "
            "(SELECT count(*) FROM events), "
            "pg_size_pretty(pg_total_relation_size('episodes') + pg_total_relation_size('turns'))"
        ).fetchone()
    assert counts is not None
    note(
        f"log ready in {time.perf_counter() - started:.0f} s: {counts[0]:,} episodes, {counts[1]:,} turns "
        f"({counts[3]} with indexes), {counts[2]:,} events"
    )
    results = asyncio.run(measure(url, sampled, args.repeat)) + rollup_cost(url, args.repeat)
    print()
    print(
        f"turnstile ui on {counts[1]:,} turns ({counts[0]:,} episodes), {args.repeat} requests per row, "
        f"sequential; baseline: the page's own SELECT (episode page: one stream's events; run page: the "
        f"queries it sent before the rollups; writes: the same into a table without the rollup trigger) in "
        f"the same run; load average {load_average()}"
    )
    print(
        f"{'view':32} {'p50 ms':>8} {'p95 ms':>8} {'base p50':>9} {'base p95':>9} {'x baseline':>10}  target"
    )
    for name, pages, queries in results:
        p50, p95 = statistics.median(pages), percentile(pages, 95)
        if queries:
            q50, q95 = statistics.median(queries), percentile(queries, 95)
            ratio = f"{p95 / q95:10.2f}"
            base = f"{q50:9.1f} {q95:9.1f}"
        else:
            ratio, base = f"{'':10}", f"{'':9} {'':9}"
        verdict = ("met" if p95 < TARGET_MS else "NOT met") if queries and "write" not in name else ""
        print(f"{name:32} {p50:8.1f} {p95:8.1f} {base} {ratio}  {verdict}")
    print_summaries(results)


def print_summaries(results: list[tuple[str, list[float], list[float]]]) -> None:
    """The slowest list view and the episode page: p95 against their own query's p95."""
    timed = [
        (name, percentile(pages, 95), percentile(queries, 95)) for name, pages, queries in results if queries
    ]
    lists = [row for row in timed if row[0].startswith("list:")]
    pages = [row for row in timed if row[0].startswith("episode page")]
    runs = [row for row in timed if row[0].startswith("run page")]
    for name, p50, plain in [
        (n, statistics.median(w), statistics.median(p)) for n, w, p in results if "write" in n
    ]:
        summary(
            "ui", f"{name} (p50)", f"{p50:.2f} ms", f"without the trigger {plain:.2f} ms", p50 / plain, None
        )
    for name, p95, before in runs:
        summary(
            "ui", f"{name} p95", f"{p95:.1f} ms", f"its queries before the rollups {before:.1f} ms",
            p95 / before, f"p95 < {TARGET_MS:g} ms", p95 < TARGET_MS,
        )  # fmt: skip
    for what, rows in (("slowest list view", lists), ("episode page", pages)):
        if rows:
            name, p95, q95 = max(rows, key=lambda row: row[1])
            summary(
                "ui", f"{what} p95 ({name})", f"{p95:.1f} ms", f"its query {q95:.1f} ms", p95 / q95,
                f"p95 < {TARGET_MS:g} ms", p95 < TARGET_MS,
            )  # fmt: skip


if __name__ == "__main__":
    main()
