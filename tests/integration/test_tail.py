"""Tailing the log in PostgreSQL: every event exactly once, in commit order, never skipping a late commit
(invariant 4), through a held transaction and a restart. The contract of every store: store_contract.py."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from pipeline.dev.embedded import EmbeddedPostgres
from pipeline.log import EventStore
from pipeline.log.db import migrate
from tests.support.factories import new_stream, opened, reward, started_in, turn
from tests.support.store_contract import Tailer


class Abandon(Exception):
    pass


async def test_sixteen_appenders_while_a_transaction_is_held_open(store: EventStore) -> None:
    # 16 independent writers (each its own group-commit writer and connection, as 16 processes would be)
    appenders = [EventStore(store.engine) for _ in range(16)]
    tailer = Tailer(store)
    await store.append(*opened())
    await tailer.wait_for(1)

    # Round 1: the held transaction commits late, after the 16 appends were issued.
    late = reward(1.0)
    async with store.transaction() as held:
        await held.append(new_stream(), [late])
        pending = [
            asyncio.create_task(a.append(new_stream(), [turn(seed=i)], 0)) for i, a in enumerate(appenders)
        ]
        await asyncio.sleep(0.5)
        assert [r.position for r in tailer.seen] == [1], "nothing may be yielded past an open append"
        assert not any(task.done() for task in pending)
    results = await asyncio.gather(*pending)
    seen = await tailer.wait_for(18)
    assert [r.position for r in seen] == list(range(1, 19))
    assert seen[1].event_id == late.event_id, "the late commit is yielded at its place, not skipped"
    assert sorted(p for r in results for p in r.positions) == list(range(3, 19))

    # Round 2: the held transaction rolls back; the tailer neither stalls nor yields the abandoned event.
    abandoned = reward(-1.0)
    with pytest.raises(Abandon):
        async with store.transaction() as held:
            await held.append(new_stream(), [abandoned])
            pending = [
                asyncio.create_task(a.append(new_stream(), [turn(seed=i)], 0))
                for i, a in enumerate(appenders)
            ]
            await asyncio.sleep(0.5)
            assert len(tailer.seen) == 18
            raise Abandon
    await asyncio.gather(*pending)
    seen = await tailer.wait_for(34)
    await asyncio.sleep(0.2)
    assert [r.position for r in seen] == list(range(1, 35)), "exactly once, in order, gapless"
    assert abandoned.event_id not in {r.event_id for r in seen}
    assert len({r.event_id for r in seen}) == 34
    await tailer.stop()
    for appender in appenders:
        await appender.close()


async def test_appends_and_tail_survive_a_postgres_restart(server_dir: Path) -> None:
    postgres = EmbeddedPostgres(server_dir / "pg")
    postgres.start()
    try:
        migrate(postgres.url)
        store = await EventStore.connect(postgres.url, retry_for=60)
        tailer = Tailer(store, poll_interval=0.5)
        stream = new_stream()
        await store.append(stream, [started_in(stream)], 0)
        await tailer.wait_for(1)

        await asyncio.to_thread(postgres.stop)
        restart = asyncio.create_task(asyncio.sleep(1.0))
        appending = asyncio.create_task(store.append(stream, [turn()], 1))  # retries until the server is back
        await restart
        await asyncio.to_thread(postgres.start)
        result = await appending
        assert result.positions == (2,)

        await store.append(stream, [reward()], 2)
        seen = await tailer.wait_for(3, within=30)
        assert [r.position for r in seen] == [1, 2, 3]
        await tailer.stop()
        await store.close()
    finally:
        postgres.stop()
