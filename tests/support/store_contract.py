"""The store contract: the assertions every adapter of ``pipeline.log.Store`` must pass.

Subclass ``StoreContract`` once per adapter and give it two fixtures: ``store`` (a new, empty store) and
``small_store`` (one whose events may be at most 64 KiB). ``tests/integration/test_store_contract.py`` runs
it against PostgreSQL (``EventStore``) and memory (``InMemoryStore``), the way pyeventsourcing runs its
recorder tests against every recorder.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from pipeline.errors import DuplicateEventConflict, InvalidEvent, WrongExpectedVersion
from pipeline.log import AbandonedEpisode, EpisodeFilter, RecordedEvent, Store
from schemas import ChatMessage, EpisodeFinished, Event, PolicyVersionPublished, TurnCompleted, TurnRequest
from tests.support.factories import finished, new_stream, opened, reward, started, started_in, turn


async def count_events(store: Store) -> int:
    return len(await store.read_all(0, 1_000_000))


class Tailer:
    """Collects what ``store.tail`` yields, in a background task."""

    def __init__(self, store: Store, after: int = 0, poll_interval: float = 5.0) -> None:
        self.seen: list[RecordedEvent] = []
        self._changed = asyncio.Event()
        self._task = asyncio.create_task(self._run(store.tail(after, poll_interval=poll_interval)))

    async def _run(self, events: AsyncIterator[RecordedEvent]) -> None:
        async for recorded in events:
            self.seen.append(recorded)
            self._changed.set()

    async def wait_for(self, count: int, within: float = 20.0) -> list[RecordedEvent]:
        async with asyncio.timeout(within):
            while len(self.seen) < count:
                self._changed.clear()
                await self._changed.wait()
        return self.seen

    async def stop(self) -> None:
        self._task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await self._task


class StoreContract:
    async def test_appended_events_read_back_equal_with_envelope(self, store: Store) -> None:
        stream, events = opened(turn(prompt_len=1000, completion_len=200), reward(0.5), finished())
        metadata = {"trace": "abc", "runner": "r1"}
        result = await store.append(stream, events, expected_version=0, metadata=metadata)
        assert result.positions == (1, 2, 3, 4)
        assert result.version == 4
        recorded = await store.read_stream(stream)
        assert [r.event for r in recorded] == events
        assert [r.version for r in recorded] == [1, 2, 3, 4]
        assert [r.event_id for r in recorded] == [e.event_id for e in events]
        assert {r.type for r in recorded} == {
            "EpisodeStarted",
            "TurnCompleted",
            "RewardAssigned",
            "EpisodeFinished",
        }
        assert all(r.metadata == metadata for r in recorded)
        assert all(isinstance(r.recorded_at, datetime) and r.recorded_at.tzinfo for r in recorded)
        assert await store.stream_version(stream) == 4
        assert await store.head() == 4

    async def test_wrong_expected_version_names_stream_expected_and_actual(self, store: Store) -> None:
        stream = new_stream()
        await store.append(stream, [started_in(stream)], expected_version=0)
        with pytest.raises(WrongExpectedVersion) as error:
            await store.append(stream, [turn()], expected_version=0)
        assert (error.value.stream, error.value.expected, error.value.actual) == (stream, 0, 1)
        assert stream in str(error.value)
        assert "expected 0" in str(error.value)
        assert "actual 1" in str(error.value)
        with pytest.raises(WrongExpectedVersion):
            await store.append(*opened(), expected_version=3)
        assert await count_events(store) == 1

    async def test_the_same_append_twice_is_a_no_op_returning_the_same_positions(self, store: Store) -> None:
        stream, events = opened(turn())
        first = await store.append(stream, events, expected_version=0)
        again = await store.append(stream, events, expected_version=0)
        assert again.positions == first.positions
        assert again.version == first.version
        assert (first.duplicate, again.duplicate) == (False, True)
        assert await count_events(store) == 2

    async def test_a_retry_reports_the_recorded_positions_not_the_stream_versions(self, store: Store) -> None:
        await store.append(*opened(turn()))  # positions 1, 2 belong to another stream
        stream, events = opened(turn())
        first = await store.append(stream, events, expected_version=0)
        again = await store.append(stream, events, expected_version=0)
        assert first.positions == again.positions == (3, 4)  # versions 1, 2
        assert again.duplicate

    async def test_tail_pages_through_a_backlog_without_waiting_for_a_notification(
        self, store: Store
    ) -> None:
        for _ in range(5):
            await store.append(*opened())
        seen = []
        async with asyncio.timeout(30):  # a wait for a notification would take an hour
            async for recorded in store.tail(batch_size=2, poll_interval=3600):
                seen.append(recorded.position)
                if len(seen) == 5:
                    break
        assert seen == [1, 2, 3, 4, 5]

    async def test_the_same_event_id_with_other_content_is_refused(self, store: Store) -> None:
        stream = new_stream()
        event = turn("first question")
        await store.append(stream, [event])
        changed = event.model_copy(
            update={"request": TurnRequest(messages=[ChatMessage(role="user", content="other")])}
        )
        with pytest.raises(DuplicateEventConflict, match=str(event.event_id)):
            await store.append(stream, [changed])
        with pytest.raises(DuplicateEventConflict, match="other content"):
            await store.append(new_stream(), [event])  # same event, other stream
        recorded = await store.read_all()
        assert [r.event for r in recorded] == [event]

    async def test_a_retry_mixing_recorded_and_new_events_is_refused(self, store: Store) -> None:
        stream, (first,) = opened()
        await store.append(stream, [first], expected_version=0)
        with pytest.raises(DuplicateEventConflict, match="mixes recorded and new events"):
            await store.append(stream, [first, turn()], expected_version=0)
        with pytest.raises(InvalidEvent, match="repeats event_id"):
            await store.append(new_stream(), [reward(), *([turn()] * 2)])
        assert await count_events(store) == 1

    async def test_concurrent_appends_with_one_expected_version_let_exactly_one_win(
        self, store: Store
    ) -> None:
        stream = new_stream()
        await store.append(stream, [started_in(stream)], expected_version=0)
        outcomes = await asyncio.gather(
            *(store.append(stream, [turn(seed=n)], expected_version=1) for n in range(8)),
            return_exceptions=True,
        )
        assert sum(not isinstance(o, BaseException) for o in outcomes) == 1
        assert all(isinstance(o, WrongExpectedVersion) for o in outcomes if isinstance(o, BaseException))
        assert [r.version for r in await store.read_stream(stream)] == [1, 2]

    async def test_positions_are_gapless_and_read_all_pages_through_them(self, store: Store) -> None:
        streams = [new_stream() for _ in range(30)]
        await asyncio.gather(*(store.append(s, [started_in(s), turn()], 0) for s in streams))
        pages: list[int] = []
        after = 0
        while page := await store.read_all(after, limit=7):
            pages += [r.position for r in page]
            after = page[-1].position
        assert pages == list(range(1, 61))
        assert await store.head() == 60
        assert [r.version for r in await store.read_stream(streams[3], after_version=1)] == [2]

    async def test_bad_input_gets_a_clear_error_and_leaves_the_log_unchanged(
        self, small_store: Store
    ) -> None:
        store = small_store
        stream = new_stream()
        await store.append(stream, [started_in(stream)])
        oversized = TurnCompleted.model_validate(
            {**turn().model_dump(), "request": {"messages": [{"role": "user", "content": "x" * 100_000}]}}
        )
        cases = [
            ([{"type": "EpisodeExploded"}], "unknown type 'EpisodeExploded'"),
            ([{"type": "RewardAssigned", "value": float("nan")}], r"field value"),
            ([{**turn().model_dump(mode="json"), "reply": None}], r"field reply"),
            ([oversized], r"over the limit of 65,536 bytes \(TURNSTILE_MAX_EVENT_BYTES\)"),
            (["not an event"], "pass an event model or a dict"),
            # what no reader could read back: each one stopped every tailer for good before
            ([{**turn().model_dump(mode="json"), "completion_logprobs": [-1e39]}], "beyond float32's range"),
            (
                [
                    {
                        **turn().model_dump(mode="json"),
                        "completion_token_ids": [1, 2, 3, 4, 5],
                        "completion_logprobs": [-0.5],
                    }
                ],
                "1 completion_logprobs for 5 completion_token_ids",
            ),
            ([{**started().model_dump(mode="json"), "group_size": 10**12}], "group_size"),
            ([started_in(stream).model_copy(update={"task": {"x": "\ud800"}})], "no lone surrogates"),
        ]
        for events, message in cases:
            with pytest.raises(InvalidEvent, match=message):
                await store.append(stream, events)  # type: ignore[arg-type]
        with pytest.raises(InvalidEvent, match="bad stream name"):
            await store.append("episode/../x", [started()])
        with pytest.raises(InvalidEvent, match="belongs in a 'episode-<id>' stream"):
            await store.append("policy-main", [started()])
        assert [r.version for r in await store.read_stream(stream)] == [1]
        assert (await store.append(stream, [finished()], expected_version=1)).version == 2  # still serving

    async def test_an_episode_id_taken_by_one_stream_is_refused_in_another(self, store: Store) -> None:
        stream, events = opened(turn())
        await store.append(stream, events, 0)
        episode_id = stream.removeprefix("episode-")
        other = new_stream()
        with pytest.raises(InvalidEvent) as refused:  # the materializer would drop this episode's samples
            await store.append(other, [started(episode_id), turn(seed=1)], 0)
        message = str(refused.value)
        assert f"starts episode {episode_id!r}, whose stream is {stream!r}, not {other!r}" in message
        assert "choose a new episode_id" in message
        assert await store.read_stream(other) == []
        assert [r.event for r in await store.read_all()] == events

    async def test_a_nul_character_is_refused_and_nothing_is_recorded(self, store: Store) -> None:
        with pytest.raises(InvalidEvent) as error:
            await store.append(new_stream(), [turn("a NUL \x00 byte, which jsonb cannot hold")], 0)
        assert "\\u0000" in str(error.value)
        assert await store.head() == 0
        literal = turn("a backslash and u0000 typed as text: \\u0000")
        await store.append(new_stream(), [literal], 0)
        assert [r.event for r in await store.read_all()] == [literal]

    async def test_tail_wakes_on_notify_not_by_polling(self, store: Store) -> None:
        waiting = asyncio.Event()
        read_all = store.read_all

        async def reading(after: int = 0, limit: int = 1000) -> list[RecordedEvent]:
            batch = await read_all(after, limit)
            if not batch:
                waiting.set()  # the tailer found nothing new: next it waits for a wake-up
            return batch

        store.read_all = reading  # type: ignore[method-assign]
        tailer = Tailer(store, poll_interval=3600)
        await asyncio.wait_for(waiting.wait(), 20)
        stream, (event,) = opened()
        await store.append(stream, [event])
        seen = await tailer.wait_for(1, within=10)  # a poll would take an hour
        assert seen[0].event_id == event.event_id
        await tailer.stop()

    async def test_tail_starts_after_the_given_position(self, store: Store) -> None:
        stream = new_stream()
        await store.append(stream, [started_in(stream), turn(), reward(), turn(seed=1)])
        tailer = Tailer(store, after=2)
        seen = await tailer.wait_for(2)
        await asyncio.sleep(0.2)
        assert [r.position for r in seen] == [3, 4]
        await tailer.stop()

    async def test_tail_yields_every_event_of_concurrent_appenders_once_in_order(self, store: Store) -> None:
        tailer = Tailer(store)
        streams = [new_stream() for _ in range(50)]
        await asyncio.gather(*(store.append(s, [started_in(s), turn(), reward()], 0) for s in streams))
        seen = await tailer.wait_for(150)
        assert [r.position for r in seen] == list(range(1, 151))
        for stream in streams[:5]:
            assert [r.version for r in seen if r.stream == stream] == [1, 2, 3]
        await tailer.stop()

    # -- the episode index: finding episodes by id or prefix, and listing them ----------------------------

    async def test_episode_ids_are_found_exactly_or_by_prefix_oldest_first(self, store: Store) -> None:
        for episode_id in ("abc1", "abc2", "abc", "a_c9", "xyz"):
            await store.append(f"episode-{episode_id}", [started(episode_id)], expected_version=0)
        await store.append("policy-abc", [PolicyVersionPublished(policy="abc", version=1, checkpoint="c")])
        assert await store.find_episode_ids("abc1", 11) == ["abc1"]
        assert await store.find_episode_ids("abc", 11) == ["abc"]  # an exact id wins over longer ones
        assert await store.find_episode_ids("ab", 11) == ["abc1", "abc2", "abc"]
        assert await store.find_episode_ids("ab", 2) == ["abc1", "abc2"]
        assert await store.find_episode_ids("a_", 11) == ["a_c9"]  # _ is text, not LIKE's wildcard
        assert await store.find_episode_ids("a%", 11) == []
        assert await store.find_episode_ids("nope", 11) == []

    async def test_episodes_are_listed_newest_first_with_turns_reward_and_filters(self, store: Store) -> None:
        await store.append(
            "episode-e1",
            [started("e1"), turn(seed=1), turn(seed=2), reward(0.5), reward(0.25), finished()],
            expected_version=0,
        )
        await store.append("episode-e2", [started("e2", policy="other", agent="x:Other")], expected_version=0)
        await store.append(
            "episode-e3", [started("e3"), EpisodeFinished(termination="max_turns")], expected_version=0
        )

        async def ids(**filters: Any) -> list[str]:
            return [row.episode_id for row in await store.list_episodes(EpisodeFilter(**filters))]

        rows = await store.list_episodes(EpisodeFilter())
        assert [row.episode_id for row in rows] == ["e3", "e2", "e1"]
        e1 = rows[2]
        assert (e1.policy, e1.agent, e1.task_id, e1.turns, e1.reward, e1.termination) == (
            "main", "tests:Agent", "t1", 2, 0.75, "done",
        )  # fmt: skip
        assert e1.finished_at is not None
        assert e1.finished_at >= e1.started_at
        e2 = rows[1]
        assert (e2.turns, e2.reward, e2.termination, e2.finished_at) == (0, None, None, None)
        assert e2.status == "running"
        assert await ids(status="running") == ["e2"]
        assert await ids(status="finished") == ["e3", "e1"]
        assert await ids(termination="max_turns") == ["e3"]
        assert await ids(policy="other") == ["e2"]
        assert await ids(agent="tests:Agent") == ["e3", "e1"]
        assert await ids(min_reward=0.5) == ["e1"]
        assert await ids(max_reward=0.1) == []  # an episode without rewards has no reward to compare
        assert await ids(limit=1) == ["e3", "e2"]  # one more than the limit: more matched
        assert await ids(since=e1.started_at) == ["e3", "e2", "e1"]
        assert await ids(since=datetime.now(UTC) + timedelta(hours=1)) == []

    # -- runner leases and the episodes they leave open ----------------------------------------------------

    async def test_open_episodes_of_runners_without_a_live_lease_are_abandoned(self, store: Store) -> None:
        await store.start_lease("live", host="h", pid=1)
        await store.start_lease("gone", host="h", pid=2)
        await store.end_lease("gone")

        async def open_episode(episode_id: str, runner: str | None, *more: Event) -> None:
            metadata = None if runner is None else {"runner": runner}
            await store.append(f"episode-{episode_id}", [started(episode_id), *more], 0, metadata=metadata)

        await open_episode("of-live", "live")
        await open_episode("of-gone", "gone", turn())
        await open_episode("of-unknown", "unknown")
        await open_episode("no-runner", None)
        await open_episode("finished", "gone", finished())

        async def abandoned(lease_timeout: float = 30, orphan_after: float = 3600) -> list[AbandonedEpisode]:
            return await store.abandoned_episodes(
                runner_key="runner", lease_timeout=lease_timeout, orphan_after=orphan_after
            )

        assert await abandoned() == [
            AbandonedEpisode("episode-of-gone", "gone", 2),
            AbandonedEpisode("episode-of-unknown", "unknown", 1),
        ]
        assert [a.stream for a in await abandoned(orphan_after=0)] == [
            "episode-of-gone", "episode-of-unknown", "episode-no-runner",
        ]  # fmt: skip
        assert (await abandoned(orphan_after=0))[-1].runner_id is None
        await store.renew_lease("live")
        # a lease lapses when its last heartbeat is older than lease_timeout: with 0, every lease has
        assert [a.stream for a in await abandoned(lease_timeout=0)] == [
            "episode-of-live", "episode-of-gone", "episode-of-unknown",
        ]  # fmt: skip
        await store.end_lease("live")
        assert "episode-of-live" in [a.stream for a in await abandoned()]
