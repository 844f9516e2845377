"""Migration 0021: an episode starts only in its own stream (``episode-<id>``), so no two streams hold one
episode, whoever writes; a log that already holds such a pair still migrates. The append path's refusal is in
the store contract, the session's and the gateway's in their own tests."""

from __future__ import annotations

import psycopg
import pytest

from pipeline.log import EventStore
from pipeline.settings import libpq_url
from tests.integration.test_poison import forge, forged_before_0021, good_episode
from tests.support.factories import started

CONSTRAINT = "events_episode_in_own_stream"


async def test_the_log_refuses_a_start_outside_its_stream_even_from_the_tables_owner(
    store: EventStore, database_url: str
) -> None:
    await good_episode(store, "a")
    with pytest.raises(psycopg.errors.CheckViolation, match=CONSTRAINT):
        forge(database_url, "episode-b", started("a"))
    with pytest.raises(psycopg.errors.CheckViolation, match=CONSTRAINT):  # no id at all is no way round it
        forge(database_url, "episode-c", started("c"), episode_id=None)
    assert forge(database_url, "episode-d", started("d")) == 5  # its own stream: the owner may
    assert {r.stream for r in await store.read_all()} == {"episode-a", "episode-d"}


async def test_a_log_already_holding_one_episode_in_two_streams_migrates_and_keeps_both(
    store: EventStore, database_url: str
) -> None:
    await good_episode(store, "a")
    position = forged_before_0021(database_url, "episode-b", started("b"), episode_id="a")

    (kept,) = await store.read_stream("episode-b")  # upgraded: the old row is still read as it was
    assert (kept.position, kept.event.episode_id if kept.event else None) == (position, "a")
    with (
        psycopg.connect(libpq_url(database_url)) as connection,  # what docs/operations.md says to run
        pytest.raises(psycopg.errors.CheckViolation, match=CONSTRAINT),
    ):
        connection.execute(f"ALTER TABLE events VALIDATE CONSTRAINT {CONSTRAINT}")
    with pytest.raises(psycopg.errors.CheckViolation, match=CONSTRAINT):  # and nothing new like it
        forge(database_url, "episode-c", started("c"), episode_id="a")
