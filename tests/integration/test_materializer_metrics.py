"""The materializer service's gauges (``pipeline.materialize.metrics``) against a real log and read models."""

from __future__ import annotations

from pipeline.log import EventStore
from pipeline.materialize import Materializer, MaterializerConfig, MaterializerMetrics
from tests.support.factories import finished, reward, started, turn


async def test_lag_open_episodes_and_batches_follow_the_log_and_the_read_models(
    store: EventStore, database_url: str
) -> None:
    await store.append("episode-done", [started("done"), turn(), reward(1.0), finished()], 0)
    await store.append("episode-open", [started("open"), turn(seed=1)], 0)
    metrics = MaterializerMetrics(database_url)
    try:
        assert await metrics.lag(0) == 6
        assert await metrics.open_episodes() == 0  # nothing folded yet
        assert await metrics.batches() == 0

        materializer = Materializer(database_url, MaterializerConfig(advantage="none", batch_samples=1))
        await materializer.open()
        await materializer.catch_up()
        await materializer.close()

        assert await metrics.lag(materializer.position) == 0
        assert await metrics.open_episodes() == 1
        assert await metrics.batches() == 1
    finally:
        await metrics.close()
