"""Turns record what they add (TurnCompleted version 2), the wire stops echoing history, and a log written
by the version-1 code (every turn whole) still reads, folds and materializes exactly as before.

The version-1 fixture (``tests/support/legacy/``) was written by the old code;
``tests/support/legacy/scenario.py`` says how.
"""

from __future__ import annotations

import base64
import itertools
import json
import sys
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.types.json import Jsonb

from pipeline.batches.format import unpack_arrays
from pipeline.episodes import EpisodeSession, expand_turns, fold_episode, turn_delta, whole_events
from pipeline.inference import InferenceService, raise_for_error
from pipeline.inference.held import TOKEN_ID_BYTES, TURN_BYTES, HeldPrefixes
from pipeline.log import EventStore, InMemoryStore
from pipeline.log.appends import decode_event, encode_event
from pipeline.log.store import APPEND_LOCK
from pipeline.log.turns import UnfoldableTurn, expand_turn
from pipeline.materialize.config import MaterializerConfig
from pipeline.materialize.writer import Materializer
from pipeline.settings import libpq_url
from schemas import LLMError, LLMRequest, LLMResponse, ToolSpec, TurnCompleted, parse_wire
from tests.support.backends import RuleBackend
from tests.support.legacy.scenario import DISCOUNT, expected, record

LEGACY = Path(__file__).parents[1] / "support" / "legacy"


class Published:
    async def __call__(self, subject: str, body: bytes, headers: dict[str, str]) -> None:
        pass


class Wire:
    """An LLM client over in-process inference services (the consumer's own request handling), counting the
    bytes each way; ``route`` picks the service of each request (a sticky consumer, or another one)."""

    def __init__(self, *services: InferenceService) -> None:
        self.services = services
        self.route = 0
        self.sent: list[int] = []
        self.received: list[int] = []
        self.requests: list[LLMRequest] = []
        self.unknown = 0

    async def __call__(self, request: LLMRequest) -> LLMResponse:
        data = request.model_dump_json(exclude_none=True).encode()  # as NatsLLMClient sends it
        self.requests.append(request)
        body = await self.services[self.route].handle(data, None)
        self.sent.append(len(data))
        self.received.append(len(body))
        reply = parse_wire(body)
        if isinstance(reply, LLMError):
            self.unknown += reply.code == "prefix_unknown"
            raise_for_error(reply)
        assert isinstance(reply, LLMResponse)
        return reply


def service(consumer_id: str = "c1", held_bytes: int = 64 * 2**20) -> InferenceService:
    backend = RuleBackend(lambda request: f"reply to {len(request.messages)} messages")
    return InferenceService(
        backend, policy="p", consumer_id=consumer_id, publish=Published(), held_bytes=held_bytes
    )


TOOLS = [{"type": "function", "function": {"name": "run", "parameters": {"type": "object"}}}]


async def conversation(session: EpisodeSession, turns: int, wire: Wire | None = None) -> None:
    messages: list[Any] = [{"role": "system", "content": "s" * 100}, {"role": "user", "content": "start"}]
    for k in range(turns):
        if wire is not None and k == turns // 2:
            wire.route = 1  # the sticky consumer is gone: another one answers from here on
        reply = await session.chat(messages, tools=TOOLS)
        messages += [reply.message, {"role": "user", "content": f"observation {k} " + "x" * 40}]


async def turns_of(store: InMemoryStore, session: EpisodeSession) -> list[Any]:
    return [r.event for r in await store.read_stream(session.stream) if isinstance(r.event, TurnCompleted)]


def legacy_rows() -> list[dict[str, Any]]:
    return [json.loads(line) for line in (LEGACY / "v1_log.jsonl").read_text().splitlines()]


def legacy_events() -> dict[str, list[Any]]:
    """The fixture as today's reader reads it."""
    by_episode: dict[str, list[Any]] = {}
    for row in legacy_rows():
        tokens = base64.b64decode(row["tokens"]) if row["tokens"] else None
        event = decode_event(row["type"], json.loads(row["data"]), tokens)
        by_episode.setdefault(row["stream"].removeprefix("episode-"), []).append(event)
    return by_episode


# -- version 1 ------------------------------------------------------------------------------------------


def test_a_version_1_log_folds_to_what_the_version_1_code_folded() -> None:
    events = legacy_events()
    stored = [json.loads(row["data"]) for row in legacy_rows() if row["type"] == "TurnCompleted"]
    assert {turn["schema_version"] for turn in stored} == {1}
    turns = [e for episode in events.values() for e in episode if isinstance(e, TurnCompleted)]
    assert {(t.schema_version, t.is_delta) for t in turns} == {(2, False)}  # upcast: nothing inherited
    assert expected(events) == json.loads((LEGACY / "v1_expected.json").read_text())


async def test_todays_session_records_the_same_episodes_as_deltas_that_fold_the_same() -> None:
    store = InMemoryStore()
    ids = await record(store)
    events = {i: [r.event for r in await store.read_stream(f"episode-{i}")] for i in ids}
    assert expected(events) == json.loads((LEGACY / "v1_expected.json").read_text())
    turns = [e for i in ids for e in events[i] if isinstance(e, TurnCompleted)]
    continued = [t for t in turns if t.parent_turn_id is not None]
    assert continued
    assert all(t.prefix_messages > 0 and t.tools_from_parent and not t.request.tools for t in continued)
    # the agent that dropped its reply's reasoning sent that reply again: it is recorded, not inherited
    dropped = [t for t in events["legacy-2"] if isinstance(t, TurnCompleted) and t.parent_turn_id]
    by_id = {t.turn_id: t for t in events["legacy-2"] if isinstance(t, TurnCompleted)}
    for turn in dropped:
        parent = by_id[turn.parent_turn_id]  # type: ignore[index]
        resent = turn.request.messages[0]
        if parent.reply.reasoning is None:  # nothing dropped: the reply is the parent's
            assert resent.role == "tool"
        else:
            assert (resent.role, resent.content, resent.reasoning_content) == (
                "assistant",
                parent.reply.text,
                None,
            )
    assert {by_id[t.parent_turn_id].reply.reasoning for t in dropped} == {None, "let me think"}  # type: ignore[index]


# -- the delta ------------------------------------------------------------------------------------------


async def test_a_40_turn_conversation_records_and_sends_what_each_turn_adds() -> None:
    store, consumer = InMemoryStore(), service()
    wire = Wire(consumer)
    session = EpisodeSession(store, wire, policy="p")
    await session.start()
    await conversation(session, 40)
    await session.finish("done")

    recorded = [
        r.event for r in await store.read_stream(session.stream) if isinstance(r.event, TurnCompleted)
    ]
    whole = expand_turns(recorded)
    for parent, turn, full in zip(whole, recorded[1:], whole[1:], strict=False):
        assert turn.parent_turn_id == parent.turn_id
        assert turn.prefix_tokens == len(parent.prompt_token_ids) + len(parent.completion_token_ids)
        assert turn.prefix_messages == len(parent.request.messages) + 1
        assert [m.content for m in turn.request.messages] == [full.request.messages[-1].content]
        assert full.prompt_token_ids[: turn.prefix_tokens] == [
            *parent.prompt_token_ids,
            *parent.completion_token_ids,
        ]
        assert turn_delta(full, parent) == turn  # the writer's delta is the inverse of the reader's expansion
        assert expand_turn(turn, parent) == full
    # what a turn stores and what travels stay flat while the history grows tenfold
    stored = [len(e.data) + len(e.tokens or b"") for e in map(encode_event, recorded)]
    assert len(whole[-1].prompt_token_ids) > 10 * len(whole[1].prompt_token_ids)
    assert max(stored[1:]) <= 1.2 * min(stored[1:])
    assert max(wire.sent[1:]) <= 1.2 * min(wire.sent[1:])
    assert max(wire.received[1:]) <= 1.2 * min(wire.received[1:])
    assert all(r.prefix is not None and r.prefix.held and not r.tools for r in wire.requests[1:])
    assert consumer.held.hits == 39
    # what the agent saw is the whole prompt, the engine's own
    assert session.turns[-1].prompt_token_ids == whole[-1].prompt_token_ids


async def test_a_consumer_without_the_prefix_gets_everything_and_the_turn_is_still_exact() -> None:
    store = InMemoryStore()
    first, second = service("c1"), service("c2")
    wire = Wire(first, second)
    session = EpisodeSession(store, wire, policy="p")
    await session.start()
    await conversation(session, 8, wire)
    await session.finish("done")

    assert wire.unknown == 1  # once: the second consumer then holds the turns it answered
    assert second.held.misses == 1
    assert second.held.hits == 3
    recorded = [
        r.event for r in await store.read_stream(session.stream) if isinstance(r.event, TurnCompleted)
    ]
    assert [t.engine_id for t in recorded] == ["c1"] * 4 + ["c2"] * 4
    whole = expand_turns(recorded)
    for parent, turn in itertools.pairwise(whole):
        assert turn.prompt_token_ids[: len(parent.prompt_token_ids) + len(parent.completion_token_ids)] == [
            *parent.prompt_token_ids,
            *parent.completion_token_ids,
        ]
    assert all(t.prefix_tokens > 0 for t in recorded[1:])  # the fallback turn is a delta too
    # the request sent again after prefix_unknown carried the tokens and the whole conversation
    resent = wire.requests[5]
    assert resent.prefix is not None
    assert resent.prefix.token_ids is not None
    assert len(resent.messages) == len(whole[4].request.messages)


def test_held_prefixes_keep_a_byte_budget_least_recently_used_first() -> None:
    tools: list[ToolSpec] = []
    held = HeldPrefixes(budget_bytes=10 * TOKEN_ID_BYTES + 2 * TURN_BYTES + sys.getsizeof(tools))  # 2 turns
    a = held.keep([1, 2, 3, 4], [], tools)
    b = held.keep([5, 6, 7, 8], [], tools)
    assert a is not None
    assert b is not None
    assert held.take(a, 4, 0) is not None  # a is now the most recently used
    c = held.keep([9, 9, 9], [], tools)  # over budget: b goes
    assert held.tokens == 7
    assert held.take(b, 4, 0) is None
    assert held.take(a, 4, 1) is None  # the wrong message count is not the turn that was kept
    assert held.take(a, 4, 0) is not None
    assert c is not None
    assert held.keep(list(range(40)), [], tools) is None  # alone over the budget: not kept
    assert held.take(a, 4, 0) is not None  # and nothing else was evicted for it


def test_a_turn_that_takes_more_than_its_parent_has_is_refused_by_the_fold() -> None:
    events = legacy_events()["legacy-0"]
    whole = expand_turns([e for e in events if isinstance(e, TurnCompleted)])
    parent, child = whole[0], whole[1]
    delta = turn_delta(child, parent)
    greedy = delta.model_copy(update={"prefix_tokens": delta.prefix_tokens + 1})
    with pytest.raises(UnfoldableTurn, match="takes"):
        expand_turn(greedy, parent)
    orphan = delta.model_copy(update={"parent_turn_id": uuid.uuid4()})
    with pytest.raises(UnfoldableTurn, match="not recorded before it"):
        whole_events([events[0], orphan])


# -- the materializer on PostgreSQL: version 1, version 2 and both in one log ------------------------------


def insert_legacy(database_url: str) -> None:
    """The fixture's rows as the version-1 code stored them (the append path would store version 2)."""
    with psycopg.connect(libpq_url(database_url)) as connection:
        connection.execute("SELECT pg_advisory_xact_lock(%s)", (APPEND_LOCK,))
        head = connection.execute("SELECT coalesce(max(position), 0) FROM events").fetchone()
        assert head is not None
        versions: dict[str, int] = {}
        for n, row in enumerate(legacy_rows(), start=head[0] + 1):
            versions[row["stream"]] = versions.get(row["stream"], 0) + 1
            tokens = base64.b64decode(row["tokens"]) if row["tokens"] else None
            connection.execute(
                "INSERT INTO events (position, stream, version, event_id, type, data, tokens, content_hash) "
                "VALUES (%s, %s, %s, %s, %s, %s, %s, %s)",
                (n, row["stream"], versions[row["stream"]], row["event_id"], row["type"],
                 Jsonb(json.loads(row["data"])), tokens, b"\0"),
            )  # fmt: skip


def samples_of(database_url: str, schema: str) -> dict[str, list[tuple[Any, ...]]]:
    with psycopg.connect(libpq_url(database_url)) as connection:
        rows = connection.execute(
            f"SELECT episode_id, arrays, reward FROM {schema}.samples ORDER BY episode_id, slot, sample_id"
        ).fetchall()
    out: dict[str, list[tuple[Any, ...]]] = {}
    for episode_id, arrays, reward in rows:
        ids, mask, logprobs, _ = unpack_arrays(bytes(arrays))
        out.setdefault(episode_id, []).append((ids, mask, [round(x, 6) for x in logprobs], round(reward, 6)))
    return out


async def test_a_log_mixing_version_1_and_version_2_materializes_each_episode_as_before(
    store: EventStore, database_url: str
) -> None:
    insert_legacy(database_url)  # version 1, as the old code wrote it
    memory = InMemoryStore()
    ids = await record(memory)  # the same episodes, recorded today (version 2 deltas), under other ids
    for episode_id in ids:
        events = [r.event for r in await memory.read_stream(f"episode-{episode_id}")]
        events[0] = events[0].model_copy(update={"episode_id": f"v2-{episode_id}", "group_id": "v2-group"})
        await store.append(f"episode-v2-{episode_id}", [e for e in events if e is not None], 0)
    # side_calls train: the log's side calls were trained when v1_expected.json was made (lineage rule 1);
    # what is checked here is that version 1 events read as version 2, not the rule
    config = MaterializerConfig(
        name="mixed", discount=DISCOUNT, style="individual", batch_samples=1000, side_calls="train"
    )
    materializer = Materializer(database_url, config)
    await materializer.open(create=True)
    await materializer.catch_up()
    await materializer.close()
    samples = samples_of(database_url, config.schema)
    want = json.loads((LEGACY / "v1_expected.json").read_text())
    for episode_id in ids:
        assert sorted(samples[episode_id]) == sorted(samples[f"v2-{episode_id}"])
        wanted = sorted((s["input_ids"], s["loss_mask"]) for s in want[episode_id]["individual"])
        assert sorted((s[0], s[1]) for s in samples[episode_id]) == wanted
    again = MaterializerConfig(
        name="again",
        discount=DISCOUNT,
        style="individual",
        batch_samples=4,
        step_events=3,
        side_calls="train",
    )
    first = MaterializerConfig(
        name="first", discount=DISCOUNT, style="individual", batch_samples=4, side_calls="train"
    )
    for rebuild in (first, again):
        materializer = Materializer(database_url, rebuild)
        await materializer.open(create=True)
        await materializer.catch_up()
        await materializer.close()
    with psycopg.connect(libpq_url(database_url)) as connection:
        skipped = connection.execute(f"SELECT count(*) FROM {config.schema}.skipped_events").fetchone()
        payloads = [
            connection.execute(f"SELECT batch_id, payload FROM {c.schema}.batch_outbox ORDER BY 1").fetchall()
            for c in (first, again)
        ]
    assert skipped == (0,)
    assert payloads[0]
    assert payloads[0] == payloads[1]  # a rebuild of the mixed log is byte-identical
    assert fold_episode(legacy_events()["legacy-1"]).turns[3].parent_turn_id is not None
