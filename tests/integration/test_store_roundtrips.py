"""The group commit's one-round-trip path (``write_in_one_round_trip``): a batch of appends that all name
their expected version is written as BEGIN, the append lock, one INSERT and COMMIT before a single sync.
These tests check that it is taken, that it stores the very bytes the COPY path stores, that every refusal
falls back to the careful path with the outcome it always had, and that two stores appending at once
still get gapless positions in commit order."""

from __future__ import annotations

import asyncio
import struct
from typing import Any

import psycopg
import pytest

from pipeline.errors import InvalidEvent, StoreUnavailable, WrongExpectedVersion
from pipeline.log import AppendResult, EventStore
from pipeline.log.appends import prepare_append
from pipeline.log.prepared import PreparedStatement
from pipeline.log.store import APPEND_LOCK, ONE_ROUND_TRIP_MAX_EVENTS, write_appends
from pipeline.settings import libpq_url
from schemas import Event, FunctionSpec, ToolSpec, TurnRequest
from tests.support.factories import finished, new_stream, opened, reward, started_in, turn
from tests.support.waiting import wait_until

STORED = (
    "SELECT stream, version, event_id, type, data::text, tokens, metadata::text, content_hash FROM events"
)


def varied_events(stream: str) -> list[Event]:
    """Events with every kind of column: no tokens, tokens, tool parameters held as text, non-ASCII."""
    tool = ToolSpec(function=FunctionSpec(name="search", parameters={"z": {"type": "string"}, "a": {}}))
    with_tools = turn("¿Qué tal? 日本語 \U0001f600", seed=3).model_copy(
        update={"request": TurnRequest(messages=turn().request.messages, tools=[tool])}
    )
    return [
        started_in(stream),
        with_tools,
        turn(prompt_len=1000, completion_len=200),
        reward(0.5),
        finished(),
    ]


async def stored_rows(url: str) -> list[tuple[Any, ...]]:
    async with await psycopg.AsyncConnection.connect(url) as connection:
        cursor = await connection.execute(f"{STORED} ORDER BY position")
        return await cursor.fetchall()


async def test_an_append_that_names_its_expected_version_takes_one_round_trip(store: EventStore) -> None:
    stream = new_stream()
    first = await store.append(stream, [started_in(stream), turn()], 0)
    second = await store.append(stream, [reward()], 2)
    assert (first, second) == (AppendResult(stream, (1, 2), 2), AppendResult(stream, (3,), 3))
    assert (store.stats.one_round_trip, store.stats.transactions, store.stats.rewritten) == (2, 2, 0)
    await store.append(*opened())  # no expected version: looked up, then COPYed
    assert store.stats.one_round_trip == 2
    assert [r.position for r in await store.read_all()] == [1, 2, 3, 4]


async def test_one_round_trip_stores_the_bytes_the_copy_path_stores(store: EventStore) -> None:
    stream = new_stream()
    events = varied_events(stream)
    metadata = {"source": "tests", "ñ": [1, 2.5, None]}
    await store.append(stream, events[:2], 0, metadata=metadata)
    await store.append(stream, events[2:], 2, metadata=metadata)
    assert store.stats.one_round_trip == 2
    in_one_round_trip = await stored_rows(store.libpq_url)
    async with await psycopg.AsyncConnection.connect(store.libpq_url) as connection:
        await connection.execute("TRUNCATE events")
        await connection.commit()
        for expected, chunk in ((0, events[:2]), (2, events[2:])):
            pending = prepare_append(stream, chunk, expected, metadata, store.max_event_bytes)
            async with connection.transaction():
                await write_appends(connection, [pending], store.lock_timeout)  # looks up, then COPYs
    assert await stored_rows(store.libpq_url) == in_one_round_trip
    assert [r.event for r in await store.read_stream(stream)] == events


async def test_rows_of_one_batch_are_stamped_in_position_order(store: EventStore) -> None:
    await store.append(new_stream(), [turn(seed=n) for n in range(20)], 0)
    stamps = [r.recorded_at for r in await store.read_all()]
    assert stamps == sorted(stamps)
    assert len(set(stamps)) > 1  # clock_timestamp() per row, as COPY stamps them, not one now()


async def test_a_batch_over_the_cut_off_is_copied(store: EventStore) -> None:
    stream = new_stream()
    events = [turn(seed=n) for n in range(ONE_ROUND_TRIP_MAX_EVENTS + 1)]
    result = await store.append(stream, events, 0)
    assert result.positions == tuple(range(1, len(events) + 1))
    assert (store.stats.one_round_trip, store.stats.transactions) == (0, 1)


async def test_refusals_in_one_round_trip_fall_back_to_the_outcomes_of_the_careful_path(
    store: EventStore,
) -> None:
    stream, retried = opened(turn())
    first = await store.append(stream, retried, 0)

    retry = await store.append(stream, retried, 0)  # the event ids are taken
    assert retry == AppendResult(stream, first.positions, 2, duplicate=True)
    assert store.stats.rewritten == 1
    with pytest.raises(WrongExpectedVersion, match=stream) as stale:  # (stream, 2) is taken
        await store.append(stream, [reward()], 1)
    assert (stale.value.expected, stale.value.actual) == (1, 2)
    with pytest.raises(WrongExpectedVersion, match=stream) as early:  # version 4 would leave a gap
        await store.append(stream, [reward()], 3)
    assert (early.value.expected, early.value.actual) == (3, 2)
    with pytest.raises(InvalidEvent, match="PostgreSQL refused"):
        await store.append(new_stream(), [turn("a NUL \x00 byte, which jsonb cannot hold")], 0)
    assert store.stats.one_round_trip == 5  # every attempt above went out in one round trip first

    # the connection was rolled back after each refusal: the next append goes through on it
    assert await store.append(stream, [reward()], 2) == AppendResult(stream, (3,), 3)
    assert [r.version for r in await store.read_stream(stream)] == [1, 2, 3]


async def test_a_lock_timeout_in_one_round_trip_is_store_unavailable_and_leaves_the_writer_usable(
    database_url: str,
) -> None:
    store = await EventStore.connect(database_url, lock_timeout=0.2, writers=1)
    try:
        stream = new_stream()
        await store.append(stream, [started_in(stream)], 0)
        async with await psycopg.AsyncConnection.connect(store.libpq_url) as holder:
            await holder.execute("SELECT pg_advisory_xact_lock(%s)", (APPEND_LOCK,))
            with pytest.raises(StoreUnavailable, match="append lock was not granted"):
                await store.append(stream, [reward()], 1)
            await holder.rollback()
        assert store.stats.rewritten == 0  # a lock timeout is not written again: it is the outcome
        assert await store.append(stream, [reward()], 1) == AppendResult(stream, (2,), 2)
        assert store.stats.one_round_trip == 3
    finally:
        await store.close()


async def test_two_stores_appending_at_once_get_gapless_positions_in_commit_order(database_url: str) -> None:
    stores = [await EventStore.connect(database_url) for _ in range(2)]
    streams = [new_stream() for _ in range(8)]
    turns_per_stream = 15

    async def appender(store: EventStore, stream: str) -> list[AppendResult]:
        return [
            await store.append(stream, [turn(seed=version)], version) for version in range(turns_per_stream)
        ]

    try:
        results = await asyncio.gather(
            *(appender(stores[index % 2], stream) for index, stream in enumerate(streams))
        )
        assert all(store.stats.one_round_trip > 0 for store in stores)
        recorded = await stores[0].read_all(0, 10_000)
    finally:
        for store in stores:
            await store.close()
    assert [r.position for r in recorded] == list(range(1, len(streams) * turns_per_stream + 1))
    by_stream = {stream: [r for r in recorded if r.stream == stream] for stream in streams}
    for stream, outcomes in zip(streams, results, strict=True):
        assert [r.version for r in by_stream[stream]] == list(range(1, turns_per_stream + 1))
        positions = [p for outcome in outcomes for p in outcome.positions]
        assert positions == [r.position for r in by_stream[stream]]
    stamps = [r.recorded_at for r in recorded]
    assert stamps == sorted(stamps)  # positions follow commit order across both stores


# --- the statement itself, through libpq (``pipeline.log.prepared``) ---------------------------------


async def test_a_prepared_statement_returns_its_value_and_refusals_as_psycopgs_errors(
    database_url: str,
) -> None:
    statement = PreparedStatement("turnstile_test_half", ["int4"], "SELECT 10 / $1")
    async with await psycopg.AsyncConnection.connect(libpq_url(database_url), autocommit=True) as connection:
        assert await statement.run(connection, [struct.pack("!i", 5)]) == b"2"
        with pytest.raises(psycopg.errors.DivisionByZero, match="division by zero"):
            await statement.run(connection, [struct.pack("!i", 0)])
        assert await statement.run(connection, [struct.pack("!i", 2)]) == b"5"  # usable after a refusal
        other = PreparedStatement("turnstile_test_none", ["int4"], "SELECT NULL::int WHERE $1 > 0")
        assert await other.run(connection, [struct.pack("!i", 1)]) is None


async def test_a_prepared_statement_sends_parameters_larger_than_the_socket_takes_at_once(
    database_url: str,
) -> None:
    statement = PreparedStatement("turnstile_test_length", ["bytea"], "SELECT length($1)")
    big = bytes(range(256)) * (32 * 1024)  # 8 MiB: flushed in many writes
    async with await psycopg.AsyncConnection.connect(libpq_url(database_url), autocommit=True) as connection:
        assert await statement.run(connection, [big]) == str(len(big)).encode()


async def test_a_prepared_statement_cancelled_in_flight_leaves_its_connection_broken(
    database_url: str,
) -> None:
    """Its answer would come to whoever used the connection next: the connection is not used again."""
    statement = PreparedStatement("turnstile_test_sleep", ["float8"], "SELECT pg_sleep($1)")
    async with await psycopg.AsyncConnection.connect(libpq_url(database_url), autocommit=True) as connection:
        running = asyncio.create_task(statement.run(connection, [struct.pack("!d", 30.0)]))
        await wait_until(lambda: connection.pgconn.is_busy() == 1, 10, "the statement is running")
        running.cancel()
        with pytest.raises(asyncio.CancelledError):
            await running
        assert connection.broken


async def test_the_writer_connects_again_after_its_connection_was_lost_mid_statement(
    store: EventStore,
) -> None:
    stream = new_stream()
    await store.append(stream, [started_in(stream)], 0)
    async with await psycopg.AsyncConnection.connect(store.libpq_url, autocommit=True) as admin:
        cursor = await admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = current_database() AND query LIKE '%append_events(%' AND pid <> pg_backend_pid()"
        )
        assert await cursor.fetchall() == [(True,)]  # the writer's connection, and no other
    assert await store.append(stream, [turn()], 1) == AppendResult(stream, (2,), 2)
    assert [r.version for r in await store.read_stream(stream)] == [1, 2]
