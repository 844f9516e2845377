"""Readers never stop for good: events that slipped past validation (an older release, a bug, the owner by
hand) are skipped, recorded with the reason, and everything after them is still read and materialized.

Appends validate every event, so these tests forge the bad rows the way only the tables' owner can: holding
the append lock and inserting at the next position (migration 0007's guard checks exactly that).
"""

from __future__ import annotations

import asyncio
import json
import os
import struct
import subprocess
import sys
import uuid
from typing import Any

import psycopg
import pytest
from alembic import command
from psycopg.types.json import Jsonb

from pipeline.log import EventStore, encode_event
from pipeline.log.db import alembic_config
from pipeline.log.store import APPEND_LOCK
from pipeline.log.tokens import pack_tokens
from pipeline.materialize.config import MaterializerConfig
from pipeline.materialize.writer import Materializer
from pipeline.replay import load_episode
from pipeline.replay.lookup import UnreadableEpisode
from pipeline.settings import libpq_url
from schemas import EpisodeFinished, Event, RewardAssigned
from tests.integration.test_materializer import materialize, rows, started, turn
from tests.integration.test_rebuild_equivalence import digests

TURNSTILE = [sys.executable, "-m", "consumers.cli"]


def forge(database_url: str, stream: str, event: Event, **changes: Any) -> int:
    """Insert ``event`` into ``stream`` as the owner, with its stored fields changed by ``changes``
    (``tokens=`` replaces the packed token arrays); returns its position."""
    encoded = encode_event(event)
    data = {**json.loads(encoded.data), **{k: v for k, v in changes.items() if k != "tokens"}}
    tokens = changes.get("tokens", encoded.tokens)
    with psycopg.connect(libpq_url(database_url)) as connection:
        connection.execute("SELECT pg_advisory_xact_lock(%s)", (APPEND_LOCK,))
        head = connection.execute("SELECT coalesce(max(position), 0) FROM events").fetchone()
        version = connection.execute(
            "SELECT coalesce(max(version), 0) FROM events WHERE stream = %s", (stream,)
        ).fetchone()
        assert head is not None
        assert version is not None
        connection.execute(
            "INSERT INTO events (position, stream, version, event_id, type, data, tokens, content_hash) "
            "VALUES (%s, %s, %s, %s, %s, %s, %s, %s)",
            (head[0] + 1, stream, version[0] + 1, uuid.uuid4(), event.type, Jsonb(data), tokens, b"\0"),
        )
        return int(head[0]) + 1


def forged_before_0021(database_url: str, stream: str, event: Event, **changes: Any) -> int:
    """``forge`` in a log migrated back to before 0021 (which ties an episode to its stream), then forward
    again: the migration keeps what the log already holds."""
    config = alembic_config(database_url)
    command.downgrade(config, "0020")
    try:
        return forge(database_url, stream, event, **changes)
    finally:
        command.upgrade(config, "head")


async def good_episode(store: EventStore, episode_id: str) -> None:
    await store.append(
        f"episode-{episode_id}",
        [
            started(episode_id),
            turn([1, 2], [3, 4]),
            RewardAssigned(value=1.0),
            EpisodeFinished(termination="done"),
        ],
        0,
    )


async def poisoned_log(store: EventStore, database_url: str) -> dict[str, int]:
    """A log with one good episode, six events no reader can fold, and a good episode after them."""
    await good_episode(store, "ok1")
    bad: dict[str, int] = {}
    bad["huge"] = forge(database_url, "episode-huge", started("huge"), group_size=10**12)
    forge(database_url, "episode-huge", turn([1], [2]))
    forge(database_url, "episode-huge", EpisodeFinished(termination="done"))
    for name, tokens in [
        ("neginf", pack_tokens([1, 2], [3, 4, 5], [-0.5, -float("inf"), -0.5])),  # -1e39 as float32
        ("short", pack_tokens([1, 2], [3, 4, 5, 6, 7], [-0.5])),  # 5 completion ids, 1 logprob
        ("torn", b"TSK1" + struct.pack("<III", 2, 1, 1) + b"\0" * 7),  # the arrays cut short
    ]:
        await store.append(f"episode-{name}", [started(name)], 0)
        bad[name] = forge(database_url, f"episode-{name}", turn([1, 2], [3]), tokens=tokens)
        await store.append(f"episode-{name}", [EpisodeFinished(termination="done")], 2)
    await store.append("episode-lots", [started("lots"), turn([1, 2], [3, 4])], 0)
    bad["lots"] = forge(database_url, "episode-lots", RewardAssigned(value=1.0), value="lots")
    await store.append("episode-lots", [EpisodeFinished(termination="done")], 3)
    # A second episode claiming ok1's id, as a log written before migration 0021 may hold one (appends now
    # refuse it): only the read models' primary key notices (the safety net).
    bad["dup"] = forged_before_0021(database_url, "episode-dup", started("dup"), episode_id="ok1")
    await store.append("episode-dup", [turn([1, 2], [3, 4]), EpisodeFinished(termination="done")], 1)
    await good_episode(store, "ok2")
    return bad


async def test_the_materializer_skips_what_it_cannot_fold_records_why_and_goes_on(
    store: EventStore, database_url: str
) -> None:
    bad = await poisoned_log(store, database_url)
    head = await store.head()
    config = MaterializerConfig(batch_samples=1)
    live = await materialize(database_url, config)

    assert live.position == head
    assert live.skipped == len(bad)
    skipped = {r[0]: r[1:] for r in rows(database_url, "SELECT * FROM skipped_events ORDER BY position")}
    assert set(skipped) == set(bad.values())
    reasons = {name: skipped[position][3] for name, position in bad.items()}
    assert "group_size is 1000000000000" in reasons["huge"]
    assert "logprob is not a finite number" in reasons["neginf"]
    assert "1 logprobs for 5 completion tokens" in reasons["short"]
    assert "TSK1" in reasons["torn"]
    assert "value is 'lots'" in reasons["lots"]
    assert "refused it" in reasons["dup"]
    assert "duplicate key" in reasons["dup"]
    assert skipped[bad["neginf"]][:3] == ("episode-neginf", "TurnCompleted", "neginf")

    # the good episodes on both sides of the poison became samples and batches
    batched = rows(database_url, "SELECT episode_id FROM samples WHERE batch_id IS NOT NULL ORDER BY 1")
    assert batched == [("ok1",), ("ok2",)]
    episodes = dict(rows(database_url, "SELECT episode_id, error FROM episodes"))
    assert "huge" not in episodes  # its start was skipped, so the rest of its stream is ignored
    assert episodes["ok1"] is None
    assert episodes["ok2"] is None
    for name in ("neginf", "short", "torn", "lots"):
        assert episodes[name].startswith(f"not materialized: the event at position {bad[name]}")
    assert rows(
        database_url, "SELECT count(*) FROM turns WHERE episode_id IN ('neginf', 'short', 'torn')"
    ) == [(0,)]

    # a restart neither skips them again nor stops; new events after them are folded
    await good_episode(store, "ok3")
    again = await materialize(database_url, config)
    assert again.skipped == 0
    assert rows(database_url, "SELECT count(*) FROM skipped_events") == [(len(bad),)]
    assert ("ok3",) in rows(database_url, "SELECT episode_id FROM samples WHERE batch_id IS NOT NULL")

    # a rebuild in another process reports the same skips, and says so
    env = {k: v for k, v in os.environ.items() if not k.startswith("TURNSTILE_")}
    env["TURNSTILE_DATABASE_URL"] = database_url
    done = await asyncio.to_thread(
        subprocess.run,
        [*TURNSTILE, "rematerialize", "--name", "again", "--batch-samples", "1"],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    printed = " ".join((done.stdout + done.stderr).split())
    assert f"{len(bad)} events could not be folded and were skipped" in printed
    assert rows(database_url, "SELECT * FROM rm_again.skipped_events ORDER BY position") == rows(
        database_url, "SELECT * FROM skipped_events ORDER BY position"
    )
    assert rows(database_url, "SELECT payload FROM rm_again.batch_outbox ORDER BY batch_id") == rows(
        database_url, "SELECT payload FROM batch_outbox ORDER BY batch_id"
    )


async def test_tailers_and_replays_read_past_an_event_that_does_not_parse(
    store: EventStore, database_url: str
) -> None:
    bad = await poisoned_log(store, database_url)
    head = await store.head()
    seen = []
    async for recorded in store.tail(after=0):
        seen.append(recorded)
        if recorded.position == head:
            break
    assert [r.position for r in seen] == list(range(1, head + 1))
    unreadable = {r.position: r.problem for r in seen if r.problem is not None}
    # the events whose stored form no longer parses (the others parse, and only the fold refuses them)
    assert set(unreadable) == {bad["huge"], bad["neginf"], bad["torn"], bad["lots"]}
    assert all(r.event is None for r in seen if r.problem is not None)
    assert f"position {bad['torn']} (TurnCompleted) does not parse" in str(unreadable[bad["torn"]])

    with pytest.raises(
        UnreadableEpisode, match=f"episode torn cannot be replayed: stored event at position {bad['torn']}"
    ):
        await load_episode(store, "torn")
    assert (await load_episode(store, "ok2")).finished is not None


async def test_a_live_materializer_keeps_folding_while_poison_arrives(
    store: EventStore, database_url: str
) -> None:
    config = MaterializerConfig(batch_samples=1)
    materializer = Materializer(database_url, config)
    await materializer.open()
    try:
        await good_episode(store, "before")
        await materializer.catch_up()
        await store.append("episode-late", [started("late")], 0)
        position = forge(database_url, "episode-late", turn([1], [2]), tokens=b"nonsense")
        await store.append("episode-late", [EpisodeFinished(termination="done")], 2)
        await good_episode(store, "after")
        await materializer.catch_up()
        assert materializer.position == await store.head()
        assert materializer.skipped == 1
    finally:
        await materializer.close()
    assert rows(database_url, "SELECT position, episode_id FROM skipped_events") == [(position, "late")]
    assert rows(database_url, "SELECT episode_id FROM samples ORDER BY 1") == [("after",), ("before",)]


@pytest.mark.parametrize("step_events", [1, 2, 3, 5])
async def test_catch_up_reading_ahead_folds_every_event_once_also_around_a_refused_step(
    store: EventStore, database_url: str, step_events: int
) -> None:
    """``catch_up`` reads each page while the one before it folds, and commits while the next folds; a step
    the read models refuse (the duplicate episode id) sends it back to fold that step's events one at a
    time, and the page it had read ahead is dropped. The read models end as those of ``step()`` alone,
    which reads one page after the other and commits each before reading on."""
    bad = await poisoned_log(store, database_url)
    head = await store.head()

    def config(name: str) -> MaterializerConfig:
        return MaterializerConfig(name=name, batch_samples=1, step_events=step_events)

    stepwise = Materializer(database_url, config("stepwise"))
    await stepwise.open(create=True)
    while await stepwise.step():
        pass
    await stepwise.close()

    ahead = Materializer(database_url, config("ahead"))
    await ahead.open(create=True)
    folded: list[int] = []
    fold = ahead._fold

    def recording(rows: list[Any]) -> Any:
        folded.extend(row.position for row in rows)
        return fold(rows)

    ahead._fold = recording  # type: ignore[method-assign]
    try:
        assert await ahead.catch_up() == head
    finally:
        await ahead.close()
    assert ahead.position == head
    assert ahead.skipped == stepwise.skipped == len(bad)
    # pages come in order without a gap; a position comes twice only where a refused step was read again
    assert sorted(set(folded)) == list(range(1, head + 1))
    assert len(folded) > head  # the duplicate's step was refused and its next page read again
    assert digests(database_url, "rm_ahead") == digests(database_url, "rm_stepwise")
