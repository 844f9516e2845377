"""What the materializer service reports besides its own counters: the log's head (for its lag), the episodes
open and the batches made, read from the log and the read models with a connection of their own (the
service's login), so that a metrics scrape never waits on a fold step's transaction."""

from __future__ import annotations

import sqlalchemy as sa

from pipeline.log import create_engine


class MaterializerMetrics:
    """``await metrics.lag(position)``, ``open_episodes()``, ``batches()``; ``await metrics.close()``."""

    def __init__(self, database_url: str) -> None:
        self.engine = create_engine(database_url, pool_size=1)

    async def close(self) -> None:
        await self.engine.dispose()

    async def _scalar(self, query: str) -> float:
        async with self.engine.connect() as connection:
            return float(await connection.scalar(sa.text(query)) or 0)

    async def lag(self, position: int) -> float:
        """Events in the log after ``position`` (the materializer's checkpoint)."""
        return await self._scalar("SELECT coalesce(max(position), 0) FROM events") - position

    async def open_episodes(self) -> float:
        """Episodes started and not finished, in the read model the login's search path names."""
        return await self._scalar("SELECT count(*) FROM episodes WHERE status = 'running'")

    async def batches(self) -> float:
        """Batches made so far, in the read model the login's search path names."""
        return await self._scalar("SELECT count(*) FROM batches")
