"""Runner leases, and closing the episodes a dead runner left open.

A runner records a lease (``Store.start_lease``) before it starts any episode, renews it every
``interval`` seconds, and records its id in each EpisodeStarted's metadata. After a crash, any runner (at
start, and then periodically) finds the episodes that were started and never finished whose runner's lease
has lapsed, and closes each with EpisodeFinished ``aborted``, so read models never show dangling episodes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
import uuid
from types import TracebackType

from pipeline.episodes.session import RUNNER_METADATA
from pipeline.errors import WrongExpectedVersion
from pipeline.log import AbandonedEpisode, Store
from schemas import EpisodeFinished

log = logging.getLogger(__name__)


def new_runner_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class RunnerLease:
    """``async with RunnerLease(store) as lease:`` holds ``lease.runner_id`` while the block runs."""

    def __init__(self, store: Store, *, runner_id: str | None = None, interval: float = 5.0) -> None:
        self.store = store
        self.runner_id = runner_id or new_runner_id()
        self.interval = interval
        self._task: asyncio.Task[None] | None = None
        self._renewed_at = self._steady_since = time.monotonic()

    async def __aenter__(self) -> RunnerLease:
        await self.store.start_lease(self.runner_id, host=socket.gethostname(), pid=os.getpid())
        self._renewed_at = self._steady_since = time.monotonic()
        self._task = asyncio.create_task(self._renew(), name=f"lease-{self.runner_id}")
        return self

    @property
    def steady_for(self) -> float:
        """Seconds this lease has been renewed on time, every renewal succeeding (0: one just failed or is
        late). After a PostgreSQL outage every runner's renewals failed alike, so every lease looks lapsed
        until its runner renews it: a recovery pass waits until its own lease has been steady for a whole
        lease timeout (``recover_abandoned_episodes``), or it would abort live runners' episodes."""
        now = time.monotonic()
        return 0.0 if now - self._renewed_at > 2 * self.interval else now - self._steady_since

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        with contextlib.suppress(Exception):  # a lease that is not ended lapses by itself
            await self.store.end_lease(self.runner_id)

    async def _renew(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.store.renew_lease(self.runner_id)
            except Exception as error:  # PostgreSQL away for a moment: the next renewal tries again
                log.warning("runner lease %s: renewal failed (%s)", self.runner_id, error)
                self._steady_since = float("inf")
                continue
            now = time.monotonic()
            if self._steady_since == float("inf") or now - self._renewed_at > 2 * self.interval:
                self._steady_since = now
            self._renewed_at = now


async def find_abandoned_episodes(
    store: Store, *, lease_timeout: float = 30.0, orphan_after: float = 3600.0
) -> list[AbandonedEpisode]:
    """Open episodes whose runner's lease lapsed ``lease_timeout`` seconds ago (or ended), and open
    episodes recorded without a runner whose last event is older than ``orphan_after`` seconds."""
    return await store.abandoned_episodes(
        runner_key=RUNNER_METADATA, lease_timeout=lease_timeout, orphan_after=orphan_after
    )


async def close_abandoned_episodes(
    store: Store, *, lease_timeout: float = 30.0, orphan_after: float = 3600.0
) -> list[str]:
    """Close every abandoned episode as ``aborted``; the streams closed."""
    closed = []
    for episode in await find_abandoned_episodes(
        store, lease_timeout=lease_timeout, orphan_after=orphan_after
    ):
        why = (
            f"runner {episode.runner_id} stopped before the episode finished"
            if episode.runner_id
            else "the episode was left open with no runner"
        )
        try:
            await store.append(
                episode.stream, [EpisodeFinished(termination="aborted", error=why)], episode.version
            )
        except WrongExpectedVersion:
            continue  # it moved on since we looked: someone is still writing it
        closed.append(episode.stream)
    if closed:
        log.info("closed %d abandoned episodes as aborted", len(closed))
    return closed


async def recover_abandoned_episodes(
    store: Store,
    *,
    every: float,
    lease_timeout: float = 30.0,
    orphan_after: float = 3600.0,
    lease: RunnerLease | None = None,
) -> None:
    """Close abandoned episodes every ``every`` seconds, until cancelled; a failed pass is logged and the
    next one tries again (a holder of a lease runs this beside its work). With the holder's ``lease``, a
    pass is skipped until that lease has been renewed on time for ``lease_timeout`` seconds: when its own
    renewals failed (PostgreSQL went away), every other runner's did too, and their leases look lapsed."""
    while True:
        await asyncio.sleep(every)
        if lease is not None and lease.steady_for < lease_timeout:
            log.info("recovery pass skipped: this runner's own lease was not renewed on time lately")
            continue
        try:
            await close_abandoned_episodes(store, lease_timeout=lease_timeout, orphan_after=orphan_after)
        except Exception as error:
            log.warning("recovery pass failed (%s); next pass in %.0f s", error, every)
