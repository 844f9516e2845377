"""The fold's episode half in worker processes (``Materializer.fold_worker``: what a rebuild far behind the
log does) gives, byte for byte, what the fold in one process gives: the varied log of
``test_rebuild_equivalence`` under its four configurations, and a poisoned log whose steps are refused,
with one, two and three workers."""

from __future__ import annotations

import json
import multiprocessing

import pytest

from pipeline.log import EventStore
from pipeline.materialize.config import MaterializerConfig
from pipeline.materialize.fold import Fold
from pipeline.materialize.records import LogRow
from pipeline.materialize.writer import Materializer
from tests.integration.test_poison import poisoned_log
from tests.integration.test_rebuild_equivalence import CONFIGS, FIXTURE, digests, varied_log, write_log


async def rebuild(
    database_url: str, config: MaterializerConfig, worker: bool, workers: int = 2
) -> Materializer:
    materializer = Materializer(database_url, config)
    materializer.fold_worker = worker
    materializer.fold_workers = workers
    await materializer.open(create=True)
    try:
        await materializer.catch_up()
    finally:
        await materializer.close()
    return materializer


@pytest.mark.parametrize("workers", [1, 2, 3])
async def test_workers_folding_the_episodes_give_what_the_earlier_fold_made(
    database_url: str, workers: int
) -> None:
    """Each worker folds the episodes of its share of the streams; their pages merge in log order."""
    log = varied_log()
    write_log(database_url, log)
    expected = json.loads(FIXTURE.read_text())
    for name, options in CONFIGS.items():
        config = MaterializerConfig(name=name, **options)
        materializer = await rebuild(database_url, config, worker=True, workers=workers)
        assert materializer.position == len(log)
        assert materializer.worker_peak_rss_kb is not None  # the worker ran, and ended as it should
        assert digests(database_url, f"rm_{name}") == expected[name], name


@pytest.mark.parametrize(("step_events", "workers"), [(1, 2), (3, 1), (3, 2), (10_000, 2)])
async def test_workers_give_what_one_process_gives_around_refused_steps_and_skips(
    store: EventStore, database_url: str, step_events: int, workers: int
) -> None:
    bad = await poisoned_log(store, database_url)
    head = await store.head()
    made = {}
    for worker in (False, True):
        name = f"worker_{str(worker).lower()}"
        config = MaterializerConfig(name=name, batch_samples=1, step_events=step_events)
        made[worker] = await rebuild(database_url, config, worker, workers)
        assert made[worker].position == head
        assert made[worker].skipped == len(bad)
    assert digests(database_url, "rm_worker_true") == digests(database_url, "rm_worker_false")
    # the open episodes went back and forth: a later step in this process goes on from them
    assert made[True].fold.open.keys() == made[False].fold.open.keys()


async def test_a_failing_worker_stops_the_catch_up_with_its_traceback_and_leaves_no_process(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_log(database_url, varied_log(episodes=20))

    def broken(self: Fold, row: LogRow) -> None:
        raise RuntimeError(f"broken at {row.position}")

    monkeypatch.setattr(Fold, "fold_event", broken)  # the forked workers inherit it
    materializer = Materializer(database_url, MaterializerConfig(name="broken"))
    materializer.fold_worker = True
    await materializer.open(create=True)
    try:
        with pytest.raises(RuntimeError, match="episode worker failed") as failed:
            await materializer.catch_up()
    finally:
        await materializer.close()
    assert "broken at 1" in str(failed.value)
    assert multiprocessing.active_children() == []
    assert materializer.position == 0  # nothing was committed
