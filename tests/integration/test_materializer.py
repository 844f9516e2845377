"""The materializer on real PostgreSQL: hand-computed trajectories, groups and batches; exactly once
across restarts at every position and across kill -9; rebuilds byte-identical to the live read models."""

from __future__ import annotations

import asyncio
import hashlib
import math
import os
import random
import signal
import sys
import uuid
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import nats
import psycopg
import pytest

from pipeline.batches.format import decode_batch
from pipeline.batches.relay import OutboxRelay
from pipeline.errors import ConfigError
from pipeline.log import EventStore
from pipeline.log.db import create_engine
from pipeline.materialize.columns import SAMPLE_COLUMNS, TURN_COLUMNS
from pipeline.materialize.config import MaterializerConfig
from pipeline.materialize.fold import Fold
from pipeline.materialize.records import LogRow
from pipeline.materialize.writer import Materializer
from pipeline.settings import libpq_url
from schemas import (
    ChatMessage,
    EpisodeFinished,
    EpisodeStarted,
    Event,
    FunctionCall,
    PolicyVersionPublished,
    RewardAssigned,
    Timings,
    ToolCall,
    ToolSpec,
    TurnCompleted,
    TurnDelivered,
    TurnEdit,
    TurnReply,
    TurnRequest,
)
from tests.conftest import Servers
from tests.support.processes import running

TURNSTILE = [sys.executable, "-m", "consumers.cli"]


def turn(prompt: list[int], completion: list[int], *, version: int = 0, tool: bool = False) -> TurnCompleted:
    return TurnCompleted(
        request=TurnRequest(messages=[ChatMessage(role="user", content="q")]),
        reply=TurnReply(text="a", finish_reason="tool_calls" if tool else "stop"),
        prompt_token_ids=prompt,
        completion_token_ids=completion,
        completion_logprobs=[-0.5] * len(completion),
        policy_version=version,
        engine_id="engine-a",
    )


def started(
    episode_id: str, *, group: str | None = None, size: int = 1, policy: str = "main"
) -> EpisodeStarted:
    return EpisodeStarted(
        episode_id=episode_id, task_id="t", agent="tests", policy=policy, group_id=group, group_size=size
    )


async def record(store: EventStore, episode_id: str, events: list[Event]) -> None:
    await store.append(f"episode-{episode_id}", events, 0)


def rows(database_url: str, query: str, *params: Any) -> list[tuple[Any, ...]]:
    with psycopg.connect(libpq_url(database_url)) as connection:
        return connection.execute(query, params).fetchall()  # type: ignore[arg-type]


async def materialize(database_url: str, config: MaterializerConfig, *, create: bool = False) -> Materializer:
    materializer = Materializer(database_url, config)
    await materializer.open(create=create)
    await materializer.catch_up()
    await materializer.close()
    return materializer


async def test_branching_tool_episode_and_a_group_of_four_hand_computed(
    store: EventStore, database_url: str
) -> None:
    # Episode A: t1, then two children of t1 (a branch) whose prompts add tool-output tokens.
    t1 = turn([1, 10, 11, 2], [20, 21, 2], tool=True)
    t2 = turn([1, 10, 11, 2, 20, 21, 2, 1, 30, 2], [22, 2])
    t3 = turn([1, 10, 11, 2, 20, 21, 2, 1, 31, 2], [23, 2])
    await record(
        store,
        "a",
        [started("a"), t1, t2, RewardAssigned(turn_id=t2.turn_id, value=0.5), t3,
         RewardAssigned(value=1.0), EpisodeFinished(termination="done")],
    )  # fmt: skip
    # A group of four one-turn episodes with rewards 1, 0, 0, 0; and an episode that failed.
    for n, value in enumerate([1.0, 0.0, 0.0, 0.0]):
        await record(
            store,
            f"g{n}",
            [started(f"g{n}", group="g", size=4), turn([1, 40 + n, 2], [50, 2]), RewardAssigned(value=value),
             EpisodeFinished(termination="done")],
        )  # fmt: skip
    await record(store, "bad", [started("bad"), turn([1, 2], [3]), EpisodeFinished(termination="error")])

    config = MaterializerConfig(discount=0.9, batch_samples=4)
    await materialize(database_url, config)

    returns = dict(rows(database_url, "SELECT turn_id, discounted_return FROM turns WHERE episode_id = 'a'"))
    # t2: own 0.5; t3: own 1.0 (the episode's reward goes to its last turn)
    # t1: 0 + 0.9 * mean(0.5, 1.0) = 0.675
    assert returns[t2.turn_id] == pytest.approx(0.5)
    assert returns[t3.turn_id] == pytest.approx(1.0)
    assert returns[t1.turn_id] == pytest.approx(0.675)
    parents = dict(rows(database_url, "SELECT turn_id, parent_turn_id FROM turns WHERE episode_id = 'a'"))
    assert parents == {t1.turn_id: None, t2.turn_id: t1.turn_id, t3.turn_id: t1.turn_id}

    episodes = dict(rows(database_url, "SELECT episode_id, termination FROM episodes"))
    assert episodes == {"a": "done", "g0": "done", "g1": "done", "g2": "done", "g3": "done", "bad": "error"}
    assert rows(database_url, "SELECT count(*) FROM samples WHERE episode_id = 'bad'") == [(0,)]

    batches = rows(database_url, "SELECT batch_id, samples, groups FROM batches ORDER BY position")
    # A's 3 samples are ready first (a group of its own); 3 + 4 > 4, so the group of four is the next batch
    assert [(n, g) for _, n, g in batches] == [(3, 1), (4, 1)]
    payloads = dict(rows(database_url, "SELECT batch_id, payload FROM batch_outbox"))
    first, second = (decode_batch(bytes(payloads[b])) for b, _, _ in batches)

    # A is a group of one: each of its samples is alone in its slot (turn 1, 2, 3), so GRPO gives 0
    by_turn = {s.turn_ids[0]: s for s in first.samples}
    assert [by_turn[str(t.turn_id)].reward for t in (t1, t2, t3)] == pytest.approx([0.675, 0.5, 1.0])
    assert [s.advantage for s in first.samples] == [0.0, 0.0, 0.0]
    sample = by_turn[str(t2.turn_id)]
    assert sample.input_ids == (*t2.prompt_token_ids, 22, 2)
    assert sample.loss_mask == (0,) * 10 + (1, 1)
    assert sample.logprobs == (0.0,) * 10 + (-0.5, -0.5)

    # The group: rewards 1, 0, 0, 0: mean 0.25, population std 0.4330 -> 1.7320, -0.5773 x 3
    advantages = sorted(s.advantage for s in second.samples)
    assert advantages == pytest.approx([-1 / math.sqrt(3)] * 3 + [math.sqrt(3)], abs=1e-5)
    assert {s.group_id for s in second.samples} == {"g"}


async def test_concat_style_gives_one_sample_per_path_with_tool_tokens_masked(
    store: EventStore, database_url: str
) -> None:
    t1 = turn([1, 10, 2], [20, 2], tool=True)
    t2 = turn([1, 10, 2, 20, 2, 1, 30, 2], [21, 2])
    await record(
        store, "c", [started("c"), t1, t2, RewardAssigned(value=1.0), EpisodeFinished(termination="done")]
    )
    await materialize(database_url, MaterializerConfig(style="concat", advantage="none", batch_samples=1))

    [(payload,)] = rows(database_url, "SELECT payload FROM batch_outbox")
    [sample] = decode_batch(bytes(payload)).samples
    assert sample.input_ids == (1, 10, 2, 20, 2, 1, 30, 2, 21, 2)
    assert sample.loss_mask == (0, 0, 0, 1, 1, 0, 0, 0, 1, 1)  # the model's tokens only; tool output masked
    assert sample.reward == pytest.approx(1.0)  # discount 1: the path's first turn carries the whole return
    assert sample.advantage == pytest.approx(1.0)  # advantage "none": the reward itself


async def test_every_column_of_the_episode_and_turn_rows_holds_what_the_log_says(
    store: EventStore, database_url: str
) -> None:
    first = turn([1, 2], [3, 4], version=2).model_copy(
        update={"timings": Timings(queued_ms=1.5, first_token_ms=2.5, total_ms=7.0), "prefix_break": True}
    )
    second = turn([1, 2, 3, 4, 5], [6], version=3).model_copy(
        update={"parent_turn_id": first.turn_id, "reply": TurnReply(text="", finish_reason="tool_calls",
                tool_calls=[ToolCall(id="c1", function=FunctionCall(name="f", arguments="{}"))])}
    )  # fmt: skip
    begin = EpisodeStarted(
        episode_id="cols", task_id="task-9", agent="agent-x", policy="main", group_id="grp", group_size=1,
        tags={"b": "2", "a": "1"}, retry_of="cols-0",
    )  # fmt: skip
    await record(store, "cols", [begin, first, second, RewardAssigned(value=0.5), RewardAssigned(value=0.25),
                                 EpisodeFinished(termination="error", error="boom")])  # fmt: skip
    await materialize(database_url, MaterializerConfig(discount=1.0, batch_samples=100, advantage="none"))
    [episode] = rows(
        database_url,
        "SELECT agent, task_id, group_id, group_size, retry_of, tags, status, termination, error, reward, "
        "turns, prompt_tokens, completion_tokens, min_policy_version, max_policy_version, "
        "started_position, finished_position FROM episodes WHERE episode_id = 'cols'",
    )
    assert episode == (
        "agent-x", "task-9", "grp", 1, "cols-0", {"a": "1", "b": "2"}, "finished", "error", "boom", 0.75,
        2, 7, 3, 2, 3, 1, 6,
    )  # fmt: skip
    turns = rows(
        database_url,
        "SELECT turn_index, parent_turn_id, recorded_parent, prompt_tokens, completion_tokens, "
        "finish_reason, policy_version, engine_id, queued_ms, first_token_ms, latency_ms, mean_logprob, "
        "prefix_break, tool_calls, position FROM turns WHERE episode_id = 'cols' ORDER BY turn_index",
    )
    assert turns == [
        (0, None, None, 2, 2, "stop", 2, "engine-a", 1.5, 2.5, 7.0, -0.5, True, 0, 2),
        (
            1,
            first.turn_id,
            first.turn_id,
            5,
            1,
            "tool_calls",
            3,
            "engine-a",
            0.0,
            0.0,
            0.0,
            -0.5,
            False,
            1,
            3,
        ),
    ]


async def test_staleness_drops_or_flags_old_samples(store: EventStore, database_url: str) -> None:
    await store.append("policy-main", [PolicyVersionPublished(policy="main", version=5, checkpoint="c5")])
    for n, version in enumerate([1, 3]):  # 3 is the bound itself: 5 - 2
        await record(
            store,
            f"s{n}",
            [started(f"s{n}"), turn([1, n], [2], version=version), RewardAssigned(value=1.0),
             EpisodeFinished(termination="done")],
        )  # fmt: skip
    await materialize(database_url, MaterializerConfig(max_staleness=2, batch_samples=2, advantage="none"))
    [(samples, stale, newest, payload)] = rows(
        database_url,
        "SELECT b.samples, b.stale_samples, b.newest_version, o.payload FROM batches b JOIN batch_outbox o "
        "USING (batch_id)",
    )
    assert (samples, stale, newest) == (1, 1, 5)  # version 1 < 5 - 2: dropped; version 3 = 5 - 2 kept
    assert [s.policy_version for s in decode_batch(bytes(payload)).samples] == [3]

    flagged = MaterializerConfig(
        name="flagged", max_staleness=2, stale="flag", batch_samples=2, advantage="none"
    )
    await materialize(database_url, flagged, create=True)
    [(payload,)] = rows(database_url, "SELECT payload FROM rm_flagged.batch_outbox")
    assert [(s.policy_version, s.stale) for s in decode_batch(bytes(payload)).samples] == [
        (1, True),
        (3, False),
    ]


async def test_a_group_missing_members_goes_out_after_the_group_timeout_in_log_time(
    store: EventStore, database_url: str
) -> None:
    await record(store, "m0", [started("m0", group="m", size=2), turn([1], [2]), RewardAssigned(value=1.0),
                               EpisodeFinished(termination="done")])  # fmt: skip
    config = MaterializerConfig(group_timeout_s=0.2, batch_samples=1, advantage="none")
    await materialize(database_url, config)
    assert rows(database_url, "SELECT count(*) FROM batches") == [(0,)]  # still waiting for its second member
    await asyncio.sleep(0.3)
    await record(store, "later", [started("later")])  # any later event: its recorded_at is past the timeout
    await materialize(database_url, config)
    assert rows(database_url, "SELECT samples, groups FROM batches") == [(1, 1)]


async def test_advantages_compare_the_same_turn_across_the_group(
    store: EventStore, database_url: str
) -> None:
    # Two episodes of one group, two turns each; turn rewards (a) 1.0, 0.2 and (b) 0.0, 0.6.
    for name, (first, second) in {"a": (1.0, 0.2), "b": (0.0, 0.6)}.items():
        t1, t2 = turn([1, 5], [6, 2]), turn([1, 5, 6, 2, 1, 7], [8, 2])
        await record(
            store,
            name,
            [started(name, group="pair", size=2), t1, RewardAssigned(turn_id=t1.turn_id, value=first), t2,
             RewardAssigned(turn_id=t2.turn_id, value=second), EpisodeFinished(termination="done")],
        )  # fmt: skip
    await materialize(database_url, MaterializerConfig(discount=0.0, advantage="mean", batch_samples=4))
    [(payload,)] = rows(database_url, "SELECT payload FROM batch_outbox")
    got = {(s.episode_id, round(s.reward, 6)): s.advantage for s in decode_batch(bytes(payload)).samples}
    # turn 1: 1.0 and 0.0, mean 0.5 -> +0.5, -0.5; turn 2: 0.2 and 0.6, mean 0.4 -> -0.2, +0.2
    # (across all four samples the mean would be 0.45 and turn 2 of "a" would get -0.25 instead)
    assert got == pytest.approx({("a", 1.0): 0.5, ("b", 0.0): -0.5, ("a", 0.2): -0.2, ("b", 0.6): 0.2})


def fold_rows(events: list[tuple[str, Event]]) -> list[LogRow]:
    from datetime import UTC, datetime, timedelta

    from pipeline.log import encode_event

    out = []
    for position, (stream, event) in enumerate(events, start=1):
        encoded = encode_event(event)
        import json

        out.append(
            LogRow(
                position, stream, event.type, json.loads(encoded.data), encoded.tokens,
                datetime(2026, 1, 1, tzinfo=UTC) + timedelta(seconds=position),
            )
        )  # fmt: skip
    return out


def test_events_delivered_twice_are_folded_once() -> None:
    log = fold_rows(
        [("episode-x", started("x")), ("episode-x", turn([1], [2])), ("episode-x", RewardAssigned(value=1.0)),
         ("episode-x", EpisodeFinished(termination="done"))]
    )  # fmt: skip
    fold = Fold(MaterializerConfig(batch_samples=1))
    for row in [*log, *log, log[1], log[3]]:
        fold.apply(row)
    assert len(fold.writes.episodes) == 1
    assert len(fold.writes.turns) == 1
    assert len(fold.writes.samples) == 1
    assert len(fold.writes.batches) == 1


def test_a_group_timeout_counts_log_time_never_the_wall_clock() -> None:
    """The log's times are from 2026-01-01, long before this test's wall clock: only log time may count."""
    member = [started("m0", group="m", size=2), turn([1], [2]), RewardAssigned(value=1.0),
              EpisodeFinished(termination="done")]  # fmt: skip
    log = fold_rows([*(("episode-m0", event) for event in member), ("episode-soon", started("soon"))])
    fold = Fold(MaterializerConfig(group_timeout_s=600.0, batch_samples=1, advantage="none"))
    for row in log:
        fold.apply(row)
    assert fold.writes.batches == []  # one log second after the member: the group still waits for its second
    (late,) = fold_rows([("episode-late", started("late"))])
    fold.apply(replace(late, position=len(log) + 1, recorded_at=log[3].recorded_at + timedelta(seconds=601)))
    assert len(fold.writes.batches) == 1  # 601 log seconds later it goes out without its missing member


async def random_log(store: EventStore, groups: int, seed: int = 7, policy: str = "main") -> None:
    """``groups`` groups of 4 episodes, 1-3 turns each, interleaved as a busy runner records them."""
    rng = random.Random(seed)
    streams: list[tuple[str, list[Event]]] = []
    for g in range(groups):
        for slot in range(4):
            episode_id = f"e{g}-{slot}"
            events: list[Event] = [started(episode_id, group=f"g{g}", size=4, policy=policy)]
            prompt = [1, g % 900, slot, 2]
            for _ in range(rng.randint(1, 3)):
                completion = [rng.randrange(3, 999) for _ in range(rng.randint(1, 5))] + [2]
                events.append(turn(prompt, completion, version=g // 10))
                prompt = [*prompt, *completion, 1, rng.randrange(3, 999), 2]
            events += [RewardAssigned(value=rng.random()), EpisodeFinished(termination="done")]
            streams.append((episode_id, events))
    cursors = {episode_id: 0 for episode_id, _ in streams}
    pending = dict(streams)
    while pending:
        episode_id = rng.choice(sorted(pending))
        events = pending[episode_id]
        version = cursors[episode_id]
        await store.append(f"episode-{episode_id}", [events[version]], version)
        cursors[episode_id] += 1
        if cursors[episode_id] == len(events):
            del pending[episode_id]


def read_models(database_url: str, schema: str) -> dict[str, list[tuple[Any, ...]]]:
    return {
        "samples": rows(
            database_url,
            f"SELECT sample_id, advantage, stale, arrays, ready_position, batch_id FROM {schema}.samples "
            "ORDER BY sample_id",
        ),
        "batches": rows(
            database_url,
            f"SELECT batch_id, samples, groups, tokens, position, created_at FROM {schema}.batches "
            "ORDER BY batch_id",
        ),
        "outbox": rows(
            database_url, f"SELECT batch_id, payload FROM {schema}.batch_outbox ORDER BY batch_id"
        ),
        "turns": rows(
            database_url, f"SELECT turn_id, discounted_return FROM {schema}.turns ORDER BY turn_id"
        ),
    }


async def test_restarting_at_every_position_gives_what_one_uninterrupted_run_gives(
    store: EventStore, database_url: str
) -> None:
    await random_log(store, groups=6)
    config = dict(discount=0.8, batch_samples=1)
    await materialize(database_url, MaterializerConfig(name="whole", **config), create=True)  # type: ignore[arg-type]

    stepwise = Materializer(database_url, MaterializerConfig(name="steps", step_events=1, **config))  # type: ignore[arg-type]
    await stepwise.open(create=True)
    while await stepwise.step():
        await stepwise.close()  # a restart after every event: state comes back from the tables
        stepwise = Materializer(database_url, MaterializerConfig(name="steps", step_events=1, **config))  # type: ignore[arg-type]
        await stepwise.open()
    await stepwise.close()

    whole, steps = read_models(database_url, "rm_whole"), read_models(database_url, "rm_steps")
    assert len(whole["batches"]) >= 5
    assert whole == steps


async def test_a_materializer_killed_20_times_ends_with_the_batches_of_an_uninterrupted_run(
    store: EventStore, database_url: str
) -> None:
    await random_log(store, groups=60)
    options = ["--discount", "0.9", "--batch-samples", "8", "--step-events", "2"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TURNSTILE_")}
    env["TURNSTILE_DATABASE_URL"] = database_url
    head = rows(database_url, "SELECT max(position) FROM events")[0][0]

    def checkpoint() -> int:
        found = rows(database_url, "SELECT position FROM checkpoints WHERE name = 'materializer:main'")
        return int(found[0][0]) if found else 0

    # Each run is killed after a random number of its commits (1 to 3, seen by polling, so often more):
    # never after a wall-clock delay, so a slow machine kills at as many points as a fast one.
    rng = random.Random(3)
    kills, positions = 0, []
    while kills < 20 and checkpoint() < head:
        async with running(
            *TURNSTILE, "serve", "materializer", *options, env=env,
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
        ) as process:  # fmt: skip
            commits, seen = rng.randint(1, 3), [checkpoint()]
            deadline = asyncio.get_running_loop().time() + 120
            while len(seen) <= commits and seen[-1] < head:
                assert asyncio.get_running_loop().time() < deadline, "the materializer made no progress"
                await asyncio.sleep(0.005)
                if (now := checkpoint()) != seen[-1]:
                    seen.append(now)
            process.send_signal(signal.SIGKILL)
            await process.wait()
        kills += 1
        positions.append(checkpoint())
    assert kills >= 10, f"the log ended after {kills} kills: make it longer"

    survivor = Materializer(database_url, MaterializerConfig(discount=0.9, batch_samples=8, step_events=2))
    await survivor.open()
    await survivor.catch_up()
    await survivor.close()
    await materialize(
        database_url, MaterializerConfig(name="reference", discount=0.9, batch_samples=8), create=True
    )

    live, reference = read_models(database_url, "public"), read_models(database_url, "rm_reference")
    assert len(live["batches"]) >= 10
    assert live == reference
    assert len(set(positions)) == len(positions)  # each kill at a later point: every run committed


async def test_rebuilds_are_byte_identical_and_a_config_change_is_refused(
    store: EventStore, database_url: str
) -> None:
    await random_log(store, groups=3)
    await materialize(database_url, MaterializerConfig(name="one", batch_samples=4), create=True)
    await materialize(
        database_url, MaterializerConfig(name="two", batch_samples=4, step_events=7), create=True
    )
    await materialize(
        database_url, MaterializerConfig(name="other", batch_samples=4, discount=0.5), create=True
    )
    one, two = read_models(database_url, "rm_one"), read_models(database_url, "rm_two")
    assert one["outbox"] == two["outbox"]
    assert one["outbox"]
    other = read_models(database_url, "rm_other")
    assert {b for b, _ in other["outbox"]}.isdisjoint({b for b, _ in one["outbox"]})

    with pytest.raises(ConfigError, match="cannot go on with"):
        await materialize(database_url, MaterializerConfig(name="one", batch_samples=1))
    with pytest.raises(ConfigError, match="exists already"):
        await materialize(database_url, MaterializerConfig(name="one", batch_samples=4), create=True)
    with pytest.raises(ConfigError, match="--discount"):
        MaterializerConfig(discount=2.0)


async def test_a_rebuild_in_another_process_gives_the_same_batch_ids_and_bytes(
    store: EventStore, database_url: str
) -> None:
    """Batch ids and payloads are a function of the log and the options alone: not of the process (its
    hash seed, its memory), so a rebuild by `turnstile rematerialize` elsewhere matches one made here."""
    await random_log(store, groups=3)
    await materialize(database_url, MaterializerConfig(name="here", batch_samples=4), create=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TURNSTILE_")}
    env.update(TURNSTILE_DATABASE_URL=database_url, PYTHONHASHSEED="12345")
    async with running(
        *TURNSTILE, "rematerialize", "--name", "elsewhere", "--batch-samples", "4", env=env,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    ) as elsewhere:  # fmt: skip
        _, stderr = await asyncio.wait_for(elsewhere.communicate(), 300)
    assert elsewhere.returncode == 0, stderr.decode()
    here, there = read_models(database_url, "rm_here"), read_models(database_url, "rm_elsewhere")
    assert here["outbox"]
    assert there["outbox"] == here["outbox"]


def test_rematerialize_command_and_its_bad_options(database_url: str, tmp_path: Path) -> None:
    import subprocess

    env = {k: v for k, v in os.environ.items() if not k.startswith("TURNSTILE_")}
    env["TURNSTILE_DATABASE_URL"] = database_url
    done = subprocess.run(
        [*TURNSTILE, "rematerialize", "--name", "cli", "--style", "concat"], env=env, capture_output=True,
        text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "schema rm_cli" in " ".join(done.stderr.split())
    bad = subprocess.run(
        [*TURNSTILE, "rematerialize", "--name", "x", "--style", "zigzag"], env=env, capture_output=True,
        text=True, timeout=120,
    )  # fmt: skip
    assert bad.returncode == 2
    refused = " ".join(bad.stderr.split())  # the CLI names the option, what was given and the choices
    assert "Invalid value for '--style'" in refused
    assert all(word in refused for word in ("'zigzag'", "'individual'", "'concat'"))
    main = subprocess.run(
        [*TURNSTILE, "rematerialize", "--name", "main"], env=env, capture_output=True, text=True, timeout=120
    )
    assert main.returncode == 2
    assert "live materializer" in main.stderr


async def test_render_drift_and_the_chat_template_reach_the_turns_and_their_view(
    store: EventStore, database_url: str
) -> None:
    def drifting(
        prompt: list[int], completion: list[int], drift: bool | None, template: str
    ) -> TurnCompleted:
        return turn(prompt, completion).model_copy(update={"render_drift": drift, "chat_template": template})

    t1 = drifting([1, 10, 2], [20, 2], False, "aaaaaaaaaaaa")
    t2 = drifting([1, 10, 2, 20, 2, 1, 11, 2], [21, 2], True, "aaaaaaaaaaaa")
    t3 = drifting([1, 10, 2, 20, 2, 1, 11, 2, 21, 2, 1, 12, 2], [22, 2], None, "aaaaaaaaaaaa")
    other = drifting([1, 30, 2], [31, 2], False, "bbbbbbbbbbbb")
    await record(store, "a", [started("a"), t1, t2, t3, EpisodeFinished(termination="done")])
    await record(store, "b", [started("b"), other, EpisodeFinished(termination="done")])
    await materialize(database_url, MaterializerConfig())
    assert rows(database_url, "SELECT turn_id, render_drift, chat_template FROM turns ORDER BY position") == [
        (t1.turn_id, False, "aaaaaaaaaaaa"), (t2.turn_id, True, "aaaaaaaaaaaa"),
        (t3.turn_id, None, "aaaaaaaaaaaa"), (other.turn_id, False, "bbbbbbbbbbbb"),
    ]  # fmt: skip
    view = rows(
        database_url,
        "SELECT chat_template, turns, continued_turns, drifted_turns, checked_turns, render_drift_rate "
        "FROM render_drift_by_agent ORDER BY chat_template",
    )
    # a: 3 turns, 2 continue the one before (token-level parents), 1 drifted of the 2 checked
    assert view == [("aaaaaaaaaaaa", 3, 2, 1, 2, 0.5), ("bbbbbbbbbbbb", 1, 0, 0, 1, 0.0)]


def branching_group() -> list[tuple[str, Event]]:
    """A group of two: episode "a" branches after its first turn (t2 earns 1, its sibling t3 earns 0);
    episode "b" is a chain of two turns earning 0."""
    t1 = turn([1, 10, 2], [20, 2])
    t2 = turn([1, 10, 2, 20, 2, 1, 30, 2], [21, 2])  # both extend t1: a branch
    t3 = turn([1, 10, 2, 20, 2, 1, 31, 2], [22, 2])
    u1 = turn([1, 11, 2], [23, 2])
    u2 = turn([1, 11, 2, 23, 2, 1, 32, 2], [24, 2])
    a = [started("a", group="g", size=2), t1, t2, RewardAssigned(turn_id=t2.turn_id, value=1.0), t3,
         RewardAssigned(turn_id=t3.turn_id, value=0.0), EpisodeFinished(termination="done")]  # fmt: skip
    b = [started("b", group="g", size=2), u1, u2, RewardAssigned(turn_id=u2.turn_id, value=0.0),
         EpisodeFinished(termination="done")]  # fmt: skip
    return [*(("episode-a", e) for e in a), *(("episode-b", e) for e in b)]


def advantages_of(config: MaterializerConfig) -> dict[tuple[str, tuple[int, ...]], float]:
    fold = Fold(config)
    for row in fold_rows(branching_group()):
        fold.apply(row)
    [payload] = [entry[2] for entry in fold.writes.outbox]
    batch = decode_batch(payload)
    # keyed by episode and the sample's completion tokens (the trained ones), which name its turn or path
    return {
        (s.episode_id, tuple(t for t, m in zip(s.input_ids, s.loss_mask, strict=True) if m)): s.advantage
        for s in batch.samples
    }


@pytest.mark.parametrize("style", ["concat", "individual"])
def test_advantages_on_a_branching_group_compare_like_with_like_hand_computed(style: str) -> None:
    config = MaterializerConfig(discount=1.0, style=style, batch_samples=1)  # type: ignore[arg-type]
    got = advantages_of(config)
    if style == "concat":
        # Paths: a/t1-t2 and a/t1-t3 both carry a's return 0 + mean(1, 0) = 0.5 (a branch averages its
        # branches); b's path carries 0. Each episode weighs 1, so a's two paths weigh 1/2 each: weighted
        # mean (0.25 + 0.25 + 0) / 2 = 0.25, std 0.25, and both of a's paths get +1, b's gets -1.
        assert got == pytest.approx(
            {("a", (20, 2, 21, 2)): 1.0, ("a", (20, 2, 22, 2)): 1.0, ("b", (23, 2, 24, 2)): -1.0}, abs=1e-4
        )
    else:
        # Depth 0: t1 (value 0.5) against u1 (value 0): +1, -1. Depth 1: t2 (1) and t3 (0) weigh 1/2 each,
        # u2 (0) weighs 1: mean (0.5 + 0 + 0) / 2 = 0.25; variance (0.5 * 0.5625 + 0.5 * 0.0625 + 0.0625) / 2
        # = 0.1875, std 0.4330: t2 +1.7321, t3 and u2 -0.5774.
        assert got == pytest.approx(
            {("a", (20, 2)): 1.0, ("b", (23, 2)): -1.0, ("a", (21, 2)): 1.7320508, ("a", (22, 2)): -0.5773503,
             ("b", (24, 2)): -0.5773503},
            abs=1e-4,
        )  # fmt: skip


def test_the_slot_rule_stays_available_and_shows_what_it_got_wrong_on_trees() -> None:
    concat = advantages_of(MaterializerConfig(style="concat", advantage_peers="slot", batch_samples=1))
    # the second sibling path has no peer in its slot: 0, while its twin gets +1 for the same return
    assert concat == pytest.approx(
        {("a", (20, 2, 21, 2)): 1.0, ("a", (20, 2, 22, 2)): 0.0, ("b", (23, 2, 24, 2)): -1.0}, abs=1e-4
    )
    individual = advantages_of(
        MaterializerConfig(style="individual", advantage_peers="slot", batch_samples=1)
    )
    # a's branch turn t3 (index 2) has no peer; t2 (index 1) is compared with b's chain turn u2
    assert individual[("a", (22, 2))] == 0.0
    assert individual[("a", (21, 2))] == pytest.approx(1.0, abs=1e-4)
    # and its configuration hashes as before the choice existed (a live materializer goes on with it)
    before = MaterializerConfig(style="individual", advantage_peers="slot").semantics()
    assert "advantage_peers" not in before


async def test_batched_samples_and_published_payloads_leave_only_references_and_rebuild_byte_identical(
    store: EventStore, database_url: str, servers: Servers
) -> None:
    """A sample's arrays leave its row once it is in a batch; a published payload leaves the outbox after
    the relay's retention; the size and sha256 kept in `batches` show a rebuild is byte-identical."""
    await random_log(store, groups=3)
    live = MaterializerConfig(name="live", batch_samples=4)
    await materialize(database_url, live, create=True)
    batched = rows(
        database_url, "SELECT count(*), count(arrays) FROM rm_live.samples WHERE batch_id IS NOT NULL"
    )
    pending = rows(database_url, "SELECT count(*), count(arrays) FROM rm_live.samples WHERE batch_id IS NULL")
    assert batched[0][0] > 0
    assert batched[0][1] == 0  # no copy of what the batch holds
    assert pending[0][0] == pending[0][1]  # not batched yet: kept, a restart needs them
    published = dict(rows(database_url, "SELECT batch_id, payload FROM rm_live.batch_outbox"))
    kept = rows(database_url, "SELECT batch_id, payload_bytes, payload_sha256 FROM rm_live.batches")
    assert {b: (len(p), hashlib.sha256(p).digest()) for b, p in published.items()} == {
        b: (n, bytes(h)) for b, n, h in kept
    }

    engine = create_engine(database_url, pool_size=2)
    connection = await nats.connect(servers.nats_url)
    try:
        relay = OutboxRelay(engine, connection, schema="rm_live", retention=0.0)
        assert await relay.publish_pending() == len(published)
        assert relay.released == len(published)
    finally:
        await connection.drain()
        await engine.dispose()
    assert rows(database_url, "SELECT count(*) FROM rm_live.batch_outbox") == [(0,)]
    assert rows(database_url, "SELECT count(*) FROM rm_live.batches WHERE published_at IS NULL") == [(0,)]

    await materialize(database_url, MaterializerConfig(name="again", batch_samples=4), create=True)
    rebuilt = dict(rows(database_url, "SELECT batch_id, payload FROM rm_again.batch_outbox"))
    assert {b: (len(p), hashlib.sha256(p).digest()) for b, p in rebuilt.items()} == {
        b: (n, bytes(h)) for b, n, h in kept
    }
    with pytest.raises(ConfigError, match="retention"):
        OutboxRelay(engine, connection, retention=-1.0)


# ---- episodes with several lineages (pipeline/materialize/lineages.py) -------------------------------


def lineage_group() -> tuple[list[tuple[str, Event]], dict[str, TurnCompleted]]:
    """A group of two, each episode holding several lineages, as a black-box agent records them.

    Episode "a" (reward 1.0): the agent's loop m1 -> m2 -> m3, a subagent k1 (its own root), and a title
    call s1 marked not for training, recorded last (under the old rule the episode's reward went to the
    episode's last turn: the title call). Episode "b" (reward 0.0): the loop b1 -> b2 and an unmarked side
    call sb (its own root, trained)."""
    t = {
        "m1": turn([1, 10, 2], [20, 2]),
        "m2": turn([1, 10, 2, 20, 2, 1, 30, 2], [21, 2]),
        "k1": turn([1, 60, 2], [61, 2]),
        "m3": turn([1, 10, 2, 20, 2, 1, 30, 2, 21, 2, 1, 31, 2], [22, 2]),
        "s1": turn([1, 50, 2], [51, 2]).model_copy(update={"train": False}),
        "b1": turn([1, 11, 2], [23, 2]),
        "sb": turn([1, 52, 2], [53, 2]),
        "b2": turn([1, 11, 2, 23, 2, 1, 32, 2], [24, 2]),
    }
    a = [started("a", group="g", size=2), t["m1"], t["m2"], t["k1"], t["m3"], t["s1"],
         RewardAssigned(value=1.0), EpisodeFinished(termination="done")]  # fmt: skip
    b = [started("b", group="g", size=2), t["b1"], t["sb"], t["b2"], RewardAssigned(value=0.0),
         EpisodeFinished(termination="done")]  # fmt: skip
    return [*(("episode-a", e) for e in a), *(("episode-b", e) for e in b)], t


def lineage_fold(style: str) -> tuple[Fold, dict[str, TurnCompleted]]:
    config = MaterializerConfig(discount=0.5, style=style, advantage="mean", batch_samples=1)  # type: ignore[arg-type]
    fold = Fold(config)
    events, turns = lineage_group()
    for row in fold_rows(events):
        fold.apply(row)
    return fold, turns


@pytest.mark.parametrize("style", ["individual", "concat"])
def test_the_episode_reward_reaches_every_trained_lineage_and_marked_calls_make_no_sample(style: str) -> None:
    fold, t = lineage_fold(style)
    [payload] = [entry[2] for entry in fold.writes.outbox]
    samples = {
        (s.episode_id, tuple(tok for tok, m in zip(s.input_ids, s.loss_mask, strict=True) if m)): s
        for s in decode_batch(payload).samples
    }
    got = {key: (s.reward, s.advantage) for key, s in samples.items()}
    if style == "individual":
        # a: the reward 1.0 goes to m3 (the loop's last turn) and to k1 (the subagent's only turn); with
        # discount 0.5: m3 1.0, m2 0.5, m1 0.25, k1 1.0; the title call s1 gets nothing and no sample.
        # b: everything 0. Peers ("mean" advantages): the loop's turns by depth (slots 0, 1, 2), the side
        # lineages' turns with each other (slot -1): k1 against sb, never against b1.
        #   slot 0: m1 0.25 vs b1 0 -> +0.125 / -0.125; slot 1: m2 0.5 vs b2 0 -> +0.25 / -0.25;
        #   slot 2: only a reaches it -> 0; slot -1: k1 1.0 vs sb 0 -> +0.5 / -0.5.
        assert got == (  # binary fractions: exact
            {("a", (20, 2)): (0.25, 0.125), ("a", (21, 2)): (0.5, 0.25), ("a", (22, 2)): (1.0, 0.0),
             ("a", (61, 2)): (1.0, 0.5), ("b", (23, 2)): (0.0, -0.125), ("b", (24, 2)): (0.0, -0.25),
             ("b", (53, 2)): (0.0, -0.5)}
        )  # fmt: skip
    else:
        # One sample per root-to-leaf path of the trained tree: a's loop carries m1's value 0.25, a's
        # subagent 1.0; b's two paths 0. Loops against loops (slot 0), side paths against side paths (-1).
        assert got == (  # binary fractions: exact
            {("a", (20, 2, 21, 2, 22, 2)): (0.25, 0.125), ("a", (61, 2)): (1.0, 0.5),
             ("b", (23, 2, 24, 2)): (0.0, -0.125), ("b", (53, 2)): (0.0, -0.5)}
        )  # fmt: skip
    slots = {s.sample_id: row[SAMPLE_COLUMNS.index("slot")] for s in samples.values() for row in
             [fold.writes.samples[s.sample_id]]}  # fmt: skip
    assert sorted(slots.values()) == ([-1, -1, 0, 0, 1, 1, 2] if style == "individual" else [-1, -1, 0, 0])
    # the turns read model keeps every turn, the marked one too, with what it was given
    turn_rows = {row[0]: row for row in fold.writes.turns}
    reward, value = TURN_COLUMNS.index("reward"), TURN_COLUMNS.index("discounted_return")
    given = [
        (turn_rows[t[n].turn_id][reward], turn_rows[t[n].turn_id][value]) for n in ("m1", "m3", "k1", "s1")
    ]
    assert given == [(0.0, 0.25), (1.0, 1.0), (1.0, 1.0), (0.0, 0.0)]


def test_lineages_main_is_the_longest_and_a_turn_under_an_untrained_one_starts_a_lineage() -> None:
    from pipeline.materialize.lineages import (
        episode_reward_targets,
        main_root,
        peer_slot,
        roots,
        trained_tree,
    )
    from pipeline.materialize.trajectory import Turn

    ids = {name: uuid.uuid4() for name in ("s", "a1", "a2", "c", "b1", "b2", "b3")}
    # s: a side root; a1 -> a2 -> c (a compaction call, untrained) -> b1 -> b2 -> b3 (the restart, which
    # does not extend c token for token in real life; here it does, to show the cut)
    tree = {ids["s"]: None, ids["a1"]: None, ids["a2"]: ids["a1"], ids["c"]: ids["a2"], ids["b1"]: ids["c"],
            ids["b2"]: ids["b1"], ids["b3"]: ids["b2"]}  # fmt: skip
    kept = trained_tree(tree, {ids["c"]})
    assert ids["c"] not in kept
    assert kept[ids["b1"]] is None  # a trained turn under an untrained one: a root
    lineage = roots(kept)
    assert {lineage[ids[n]] for n in ("b1", "b2", "b3")} == {ids["b1"]}
    assert (lineage[ids["a2"]], lineage[ids["s"]]) == (ids["a1"], ids["s"])
    order = ["s", "a1", "a2", "c", "b1", "b2", "b3"]
    turns = [Turn(ids[n], "e", order.index(n), (1,), (2,), (-0.5,), 0) for n in order if n != "c"]
    assert main_root(turns, lineage) == ids["b1"]  # 3 turns against 2 and 1
    assert main_root(turns[:4], lineage) == ids["a1"]  # before the restart outlasts it: a 2, b 1, s 1
    assert main_root(turns[:2], lineage) == ids["s"]  # a tie (1 and 1): the earliest root
    assert episode_reward_targets(turns, lineage) == [ids["s"], ids["a2"], ids["b3"]]
    assert [peer_slot(0, main=True), peer_slot(2, main=True)] == [0, 2]
    assert [peer_slot(0, main=False), peer_slot(1, main=False)] == [-1, -2]


async def test_the_turns_view_shows_each_turns_train_mark_from_its_event(
    store: EventStore, database_url: str
) -> None:
    """``turns.train`` is the event's own mark (migration 0014): NULL where trained (not marked), false for a
    call marked not for training, in the live read models and in a rebuild's schema alike."""
    loop = turn([1, 10, 2], [20, 2])
    title = turn([1, 50, 2], [51, 2]).model_copy(update={"train": False})
    marked = turn([1, 10, 2, 20, 2, 1, 30, 2], [21, 2]).model_copy(update={"train": True})
    await record(store, "a", [started("a"), loop, title, marked, EpisodeFinished(termination="done")])
    await materialize(database_url, MaterializerConfig())
    await materialize(database_url, MaterializerConfig(name="again"), create=True)
    expected = [(loop.turn_id, None), (title.turn_id, False), (marked.turn_id, True)]
    for schema in ("public", "rm_again"):
        assert rows(database_url, f"SELECT turn_id, train FROM {schema}.turns ORDER BY position") == expected
    # the marked call is in the turns, but no sample
    assert {r[0] for r in rows(database_url, "SELECT sample_id FROM samples")} == {
        str(loop.turn_id),
        str(marked.turn_id),
    }


async def test_the_lineage_rules_version_is_part_of_the_configuration_hash(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A materializer built under one lineage rule refuses to go on under another (its batches would mix
    them); rule 1 hashes as configurations did before the rule was recorded, so they go on."""
    from pipeline.materialize import lineages

    config = MaterializerConfig(name="ruled")
    assert config.semantics()["lineage_rule"] == lineages.RULE == 2  # rule 2: side calls and delivery
    assert config.semantics()["side_calls"] == "skip"
    assert MaterializerConfig(name="ruled", side_calls="train").config_hash() != config.config_hash()
    monkeypatch.setattr(lineages, "RULE", 1)
    assert "lineage_rule" not in config.semantics()
    assert "side_calls" not in config.semantics()
    await materialize(database_url, config, create=True)
    rule_1 = config.config_hash()
    monkeypatch.setattr(lineages, "RULE", 2)
    assert config.semantics()["lineage_rule"] == 2
    assert config.config_hash() != rule_1
    with pytest.raises(ConfigError, match='"lineage_rule": 2'):
        await materialize(database_url, config)
    monkeypatch.setattr(lineages, "RULE", 1)
    await materialize(database_url, config)


def test_replace_works_with_the_login_turnstile_up_prints(database_url: str) -> None:
    """``rematerialize --replace`` as the services' login (``make_logins``, what ``turnstile up`` exports as
    TURNSTILE_DATABASE_URL) failed with "permission denied for table materializers"; it goes through
    ``turnstile_drop_rebuild``, which drops a rebuild and refuses the live materializer."""
    import subprocess

    from pipeline.log.db import make_logins

    services = make_logins(database_url, services="ops_services", reader="ops_reader").services
    env = {k: v for k, v in os.environ.items() if not k.startswith("TURNSTILE_")}
    env["TURNSTILE_DATABASE_URL"] = services
    command = [*TURNSTILE, "rematerialize", "--name", "asup"]
    for extra in ([], ["--replace"], ["--replace"]):
        done = subprocess.run([*command, *extra], env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert "Traceback" not in done.stderr
    assert rows(database_url, "SELECT count(*) FROM materializers WHERE name = 'asup'") == [(1,)]
    with psycopg.connect(libpq_url(services), autocommit=True) as connection:
        with pytest.raises(psycopg.errors.InsufficientPrivilege, match="live materializer 'main'"):
            connection.execute("SELECT turnstile_drop_rebuild('main')")
        with pytest.raises(psycopg.errors.InsufficientPrivilege):  # nor directly, the live one's checkpoint
            connection.execute("DELETE FROM checkpoints WHERE name = 'materializer:main'")


async def test_the_turns_view_shows_delivery_training_lineage_and_why_each_root_started(
    store: EventStore, database_url: str
) -> None:
    """Migration 0018 and lineage rule 2: a turn recorded undelivered is delivered once a TurnDelivered names
    it (or a later turn continues it), else it makes no sample; side calls (a root without tools beside
    calls with tools, or another model) are not trained; each root says why it started."""
    tools = [ToolSpec.model_validate({"function": {"name": "bash", "parameters": {"type": "object"}}})]
    asked = TurnRequest(messages=[ChatMessage(role="user", content="q")], tools=tools)

    def loop(prompt: list[int], completion: list[int], **update: Any) -> TurnCompleted:
        return turn(prompt, completion).model_copy(update={"request": asked, "model": "big", **update})

    first = loop([1, 10, 2], [20, 2], delivered=False)  # continued below: seen
    title = turn([1, 50, 2], [51, 2]).model_copy(update={"model": "big"})  # no tools: a side call
    second = loop([1, 10, 2, 20, 2, 1, 30, 2], [21, 2], delivered=False)  # confirmed by TurnDelivered
    lost = loop([1, 10, 2, 20, 2, 1, 31, 2], [22, 2], delivered=False)  # never handed over
    small = loop([1, 60, 2], [61, 2], model="small")  # another model: a side call
    edited = loop([1, 10, 2, 20, 3, 1, 32, 2], [23, 2])
    edited = edited.model_copy(
        update={"edit": TurnEdit(turn_id=first.turn_id, changes=["command 'a' -> 'b'"])}
    )
    events: list[Event] = [started("lv"), first, title, second, lost, small, edited]
    events += [TurnDelivered(turn_ids=[second.turn_id]), EpisodeFinished(termination="done")]
    await record(store, "lv", events)
    await materialize(database_url, MaterializerConfig())
    found = rows(
        database_url,
        "SELECT turn_id, delivered, trained, lineage, root_reason, model, edit FROM turns ORDER BY position",
    )
    assert found == [
        (first.turn_id, True, True, first.turn_id, "first call", "big", None),
        (title.turn_id, True, False, title.turn_id, "side call", "big", None),
        (second.turn_id, True, True, first.turn_id, None, "big", None),
        (lost.turn_id, False, False, first.turn_id, None, "big", None),
        (small.turn_id, True, False, small.turn_id, "side call", "small", None),
        (
            edited.turn_id, True, True, edited.turn_id, "edit", "big",
            {"turn_id": str(first.turn_id), "changes": ["command 'a' -> 'b'"]},
        ),
    ]  # fmt: skip
    samples = {r[0] for r in rows(database_url, "SELECT sample_id FROM samples")}
    assert samples == {str(first.turn_id), str(second.turn_id), str(edited.turn_id)}
