"""The fold's episode half in a worker process (``Materializer.fold_worker``: what a rebuild far behind the
log does) gives, byte for byte, what the fold in one process gives: the varied log of
``test_rebuild_equivalence`` under its four configurations, and a poisoned log whose steps are refused."""

from __future__ import annotations

import json

import pytest

from pipeline.log import EventStore
from pipeline.materialize.materializer import Materializer, MaterializerConfig
from tests.test_poison import poisoned_log
from tests.test_rebuild_equivalence import CONFIGS, FIXTURE, digests, varied_log, write_log


async def rebuild(database_url: str, config: MaterializerConfig, worker: bool) -> Materializer:
    materializer = Materializer(database_url, config)
    materializer.fold_worker = worker
    await materializer.open(create=True)
    try:
        await materializer.catch_up()
    finally:
        await materializer.close()
    return materializer


async def test_a_worker_folding_the_episodes_gives_what_the_earlier_fold_made(database_url: str) -> None:
    log = varied_log()
    write_log(database_url, log)
    expected = json.loads(FIXTURE.read_text())
    for name, options in CONFIGS.items():
        materializer = await rebuild(database_url, MaterializerConfig(name=name, **options), worker=True)
        assert materializer.position == len(log)
        assert materializer.worker_peak_rss_kb is not None  # the worker ran, and ended as it should
        assert digests(database_url, f"rm_{name}") == expected[name], name


@pytest.mark.parametrize("step_events", [1, 3, 10_000])
async def test_a_worker_gives_what_one_process_gives_around_refused_steps_and_skips(
    store: EventStore, database_url: str, step_events: int
) -> None:
    bad = await poisoned_log(store, database_url)
    head = await store.head()
    made = {}
    for worker in (False, True):
        name = f"worker_{str(worker).lower()}"
        config = MaterializerConfig(name=name, batch_samples=1, step_events=step_events)
        made[worker] = await rebuild(database_url, config, worker)
        assert made[worker].position == head
        assert made[worker].skipped == len(bad)
    assert digests(database_url, "rm_worker_true") == digests(database_url, "rm_worker_false")
    # the open episodes went back and forth: a later step in this process goes on from them
    assert made[True].fold.open.keys() == made[False].fold.open.keys()
