"""PostgreSQL-only behaviour of the event store: binary token arrays, group commit, refusals by PostgreSQL,
tolerant reading of stored rows, explicit transactions. What every store does:
tests/support/store_contract.py."""

from __future__ import annotations

import asyncio

import psycopg
import pytest
from sqlalchemy.engine import make_url

from pipeline.dev.embedded import free_port
from pipeline.errors import InvalidEvent, StoreUnavailable, WrongExpectedVersion
from pipeline.log import AppendResult, EventStore
from pipeline.log.store import APPEND_LOCK, APPEND_STATEMENT
from pipeline.settings import libpq_url
from schemas import Event
from tests.support.factories import finished, new_stream, opened, reward, started_in, turn


async def count_events(store: EventStore) -> int:
    return len(await store.read_all(0, 1_000_000))


async def test_token_arrays_are_stored_in_binary_not_as_json(store: EventStore) -> None:
    event = turn(prompt_len=1000, completion_len=200)
    await store.append(new_stream(), [event])
    async with await psycopg.AsyncConnection.connect(store.libpq_url) as connection:
        cursor = await connection.execute("SELECT data, length(tokens) FROM events")
        data, size = await cursor.fetchone()  # type: ignore[misc]
    assert not {"prompt_token_ids", "completion_token_ids", "completion_logprobs"} & data.keys()
    assert size == 16 + 4 * (1000 + 200 + 200)


async def test_concurrent_appends_are_group_committed_into_few_transactions(store: EventStore) -> None:
    streams = [new_stream() for _ in range(300)]
    results = await asyncio.gather(*(store.append(s, [started_in(s), turn()], 0) for s in streams))
    positions = sorted(p for result in results for p in result.positions)
    assert positions == list(range(1, 601))
    assert store.stats.appends == 300
    assert store.stats.transactions < 30, store.stats
    for stream, result in zip(streams[:5], results[:5], strict=True):
        assert [r.position for r in await store.read_stream(stream)] == list(result.positions)


async def test_one_bad_append_in_a_group_commit_fails_alone(store: EventStore) -> None:
    taken = new_stream()
    await store.append(taken, [started_in(taken)])
    before = store.stats.transactions
    good = [(new_stream(), turn(f"question {i}")) for i in range(40)]
    refused_by_postgres = turn("a NUL \x00 byte, which jsonb cannot hold")
    outcomes = await asyncio.gather(
        *(store.append(s, [e], 0) for s, e in good[:20]),
        store.append(new_stream(), [refused_by_postgres], 0),
        store.append(taken, [reward()], expected_version=0),
        *(store.append(s, [e], 0) for s, e in good[20:]),
        return_exceptions=True,
    )
    bad_content, conflict = outcomes[20], outcomes[21]
    assert isinstance(bad_content, InvalidEvent)
    assert "PostgreSQL refused" in str(bad_content)
    assert "\\u0000" in str(bad_content)
    assert isinstance(conflict, WrongExpectedVersion)
    assert all(
        isinstance(o, object) and not isinstance(o, BaseException) for o in outcomes[:20] + outcomes[22:]
    )
    recorded = {r.event_id for r in await store.read_all()}
    assert {e.event_id for _, e in good} <= recorded
    assert refused_by_postgres.event_id not in recorded
    assert len(recorded) == 41
    assert store.stats.transactions > before  # the batch was split, the good appends still committed


async def test_a_batch_whose_expected_versions_or_event_ids_are_taken_is_decided_append_by_append(
    store: EventStore,
) -> None:
    """A group commit writes appends with an expected version without looking their streams up; where the
    database refuses that, the batch is written again with look-ups and each append gets its own outcome."""
    recorded_stream, behind, ahead = new_stream(), new_stream(), new_stream()
    retried = [started_in(recorded_stream), turn()]
    first = await store.append(recorded_stream, retried, 0)
    await store.append(behind, [started_in(behind), turn()], 0)
    await store.append(ahead, [started_in(ahead)], 0)
    assert store.stats.rewritten == 0  # nothing guessed wrong: nothing looked up

    async def among_new_appends(
        stream: str, events: list[Event], expected: int
    ) -> AppendResult | BaseException:
        """The append in one batch with 30 appends to new streams, which all succeed."""
        before = store.stats.rewritten
        fresh = [opened() for _ in range(30)]
        *outcomes, outcome = await asyncio.gather(
            *(store.append(s, e, 0) for s, e in fresh), store.append(stream, events, expected),
            return_exceptions=True,
        )  # fmt: skip
        assert all(isinstance(o, AppendResult) for o in outcomes)
        assert store.stats.rewritten == before + 1
        return outcome

    retry = await among_new_appends(recorded_stream, retried, 0)  # its event ids are taken
    assert retry == AppendResult(recorded_stream, first.positions, 2, duplicate=True)
    stale = await among_new_appends(behind, [reward()], 1)  # the stream is at 2: (behind, 2) is taken
    assert isinstance(stale, WrongExpectedVersion)
    assert (stale.expected, stale.actual) == (1, 2)
    # at 1: version 4 would leave a gap, which migration 0015's guard refuses
    early = await among_new_appends(ahead, [reward()], 3)
    assert isinstance(early, WrongExpectedVersion)
    assert (early.expected, early.actual) == (3, 1)
    assert [r.version for r in await store.read_stream(behind)] == [1, 2]
    assert [r.version for r in await store.read_stream(ahead)] == [1]
    assert await count_events(store) == 5 + 3 * 30


async def test_readers_ignore_unknown_fields_and_keep_unknown_types(store: EventStore) -> None:
    stream = new_stream()
    event = reward(2.0)
    await store.append(stream, [event])
    async with await psycopg.AsyncConnection.connect(libpq_url(store.libpq_url)) as connection:
        await connection.execute(
            "UPDATE events SET data = data || '{\"from_the_future\": true}'::jsonb WHERE position = 1"
        )
        await connection.execute("SELECT pg_advisory_xact_lock(%s)", (APPEND_LOCK,))  # the append rule
        await connection.execute(
            "INSERT INTO events (position, stream, version, event_id, type, data, content_hash) "
            "VALUES (2, %s, 2, gen_random_uuid(), 'EpisodePaused', '{}', '\\x00')",
            (stream,),
        )
        await connection.commit()
    first, second = await store.read_stream(stream)
    assert first.event == event
    assert (second.type, second.event) == ("EpisodePaused", None)


async def test_an_explicit_transaction_appends_atomically(store: EventStore) -> None:
    stream = new_stream()
    async with store.transaction() as transaction:
        await transaction.append(stream, [started_in(stream)], 0)
        with pytest.raises(WrongExpectedVersion):
            await transaction.append(stream, [reward()], 0)
        await transaction.append(stream, [reward()], 1)
    assert [r.version for r in await store.read_stream(stream)] == [1, 2]

    class Abandon(Exception):
        pass

    with pytest.raises(Abandon):
        async with store.transaction() as transaction:
            await transaction.append(stream, [finished()], 2)
            raise Abandon
    assert await store.stream_version(stream) == 2


BIND_APPEND = b"\x00" + APPEND_STATEMENT[0].encode() + b"\x00"
"""In a Bind message: the unnamed portal's empty name, then the statement's name."""


class CommitCutter:
    """A TCP proxy in front of PostgreSQL that, once, lets a commit through (a COMMIT, or the Bind message of
    a lone append's one prepared statement, ``APPEND_STATEMENT``, whose transaction commits as it returns)
    and then cuts the connection before the client hears PostgreSQL's answer: the append is committed but
    its outcome unknown. (The statement's PREPARE names it too, after a space: not cut.)"""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.armed = True
        self.cut = asyncio.Event()
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> CommitCutter:
        self.server = await asyncio.start_server(self._connection, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *_: object) -> None:
        assert self.server is not None
        self.server.close()

    @property
    def address(self) -> tuple[str, int]:
        assert self.server is not None
        host, port = self.server.sockets[0].getsockname()[:2]
        return host, port

    async def _connection(self, client_in: asyncio.StreamReader, client_out: asyncio.StreamWriter) -> None:
        server_in, server_out = await asyncio.open_connection(self.host, self.port)
        commit_sent = asyncio.Event()

        async def upstream() -> None:
            while data := await client_in.read(65536):
                if self.armed and (b"COMMIT" in data or BIND_APPEND in data):
                    self.armed = False
                    commit_sent.set()
                server_out.write(data)
                await server_out.drain()

        async def downstream() -> None:
            while data := await server_in.read(65536):
                if commit_sent.is_set():  # PostgreSQL's answer to the COMMIT: never delivered
                    self.cut.set()
                    break
                client_out.write(data)
                await client_out.drain()
            client_out.close()
            server_out.close()

        await asyncio.gather(upstream(), downstream(), return_exceptions=True)


async def test_an_append_whose_commit_outcome_is_unknown_is_retried_to_exactly_one_copy(
    database_url: str,
) -> None:
    url = make_url(libpq_url(database_url))
    async with CommitCutter(url.host or "127.0.0.1", url.port or 5432) as cutter:
        host, port = cutter.address
        through = url.set(host=host, port=port).render_as_string(hide_password=False)
        store = await EventStore.connect(through)
        try:
            stream, events = opened(turn())
            result = await store.append(stream, events, expected_version=0)
            assert cutter.cut.is_set()  # the first COMMIT's answer was lost
            assert result.positions == (1, 2)
            assert result.duplicate  # the retry found the committed events by their ids
            assert [r.event for r in await store.read_all()] == events
        finally:
            await store.close()


async def test_an_append_to_an_unreachable_postgresql_is_store_unavailable_after_retry_for() -> None:
    store = await EventStore.connect(
        f"postgresql://postgres@127.0.0.1:{free_port()}/turnstile", retry_for=1.0
    )
    try:
        with pytest.raises(StoreUnavailable) as unavailable:
            await store.append(*opened(), 0)
        assert "PostgreSQL unreachable for 1 s while appending" in str(unavailable.value)
        assert "TURNSTILE_DATABASE_URL" in str(unavailable.value)
    finally:
        await store.close()


async def test_tail_without_a_position_starts_at_the_first_event(store: EventStore) -> None:
    await store.append(*opened())
    await store.append(*opened())
    seen = []
    async with asyncio.timeout(30):
        async for recorded in store.tail():
            seen.append(recorded.position)
            if len(seen) == 2:
                break
    assert seen == [1, 2]
