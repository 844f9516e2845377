"""Recovery after a PostgreSQL outage: every runner's lease renewals failed alike, so every live runner's
lease looks lapsed until it is renewed again. A recovery pass waits until its own lease has been renewed on
time for a whole lease timeout; before, a runner aborted its own live episodes after PostgreSQL came back
(seen in tests/integration/test_restart_all.py: 7 of 72 episodes ``aborted`` and run again)."""

from __future__ import annotations

import asyncio

from pipeline.episodes import RunnerLease, recover_abandoned_episodes
from pipeline.log import InMemoryStore
from schemas import EpisodeFinished
from tests.support.factories import opened
from tests.support.waiting import wait_until

LEASE_TIMEOUT = 0.5


class Flaky(InMemoryStore):
    """Lease renewals fail while ``away`` is set, as they do while PostgreSQL restarts."""

    away = False

    async def renew_lease(self, runner_id: str) -> None:
        if self.away:
            raise ConnectionError("connection refused")
        await super().renew_lease(runner_id)


async def episode_of(store: InMemoryStore, runner_id: str) -> str:
    stream, events = opened()
    await store.append(stream, events, 0, metadata={"runner": runner_id})
    return stream


async def ended(store: InMemoryStore, stream: str) -> bool:
    return any(isinstance(r.event, EpisodeFinished) for r in await store.read_stream(stream))


async def test_after_an_outage_no_pass_runs_until_the_own_lease_is_steady_and_live_episodes_stay_open() -> (
    None
):
    store = Flaky()
    async with RunnerLease(store, interval=LEASE_TIMEOUT / 10) as lease:
        live = await episode_of(store, lease.runner_id)
        dead = await episode_of(store, "dead")  # no lease: closed by the first pass that runs
        store.away = True
        await wait_until(lambda: lease.steady_for == 0, 10, "a failed renewal")
        await asyncio.sleep(
            2 * LEASE_TIMEOUT
        )  # the outage outlasts the lease timeout: the lease looks lapsed
        recovery = asyncio.create_task(
            recover_abandoned_episodes(
                store, every=LEASE_TIMEOUT / 10, lease_timeout=LEASE_TIMEOUT, lease=lease
            )
        )
        try:
            await asyncio.sleep(LEASE_TIMEOUT)
            assert not await ended(store, dead), "a pass ran during the outage"
            store.away = False
            await wait_until(lambda: ended(store, dead), 10, "a recovery pass once the lease is steady again")
            assert lease.steady_for >= LEASE_TIMEOUT
            assert not await ended(store, live)
        finally:
            recovery.cancel()
