"""Retries and disconnects: a retry of a call the gateway already answered is answered from the recorded
turn (never generated and recorded again); a turn whose client left before the reply is recorded as never
delivered and makes no training sample. Real HTTP, real consumers over NATS, the real log."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest

from consumers.inference import InferenceConfig
from pipeline.episodes import EpisodeSession
from pipeline.log import EventStore, InMemoryStore
from pipeline.log.appends import encode_event
from pipeline.materialize.columns import SAMPLE_COLUMNS
from pipeline.materialize.config import MaterializerConfig
from pipeline.materialize.fold import Fold
from pipeline.materialize.records import LogRow
from schemas import TurnDelivered
from tests.conftest import Servers
from tests.integration.test_gateway import Gateway, gateway_for, llm, new_policy, turns_of  # noqa: F401 (fixtures)
from tests.support.backends import PrefixEcho, RuleBackend, calculator_rule
from tests.support.serving import serving
from tests.support.waiting import wait_until

QUESTION = [{"role": "user", "content": "What is 2 + 2?"}]


@pytest.fixture
async def slow(request: pytest.FixtureRequest) -> RuleBackend:
    """A consumer that takes 1 s per call (``delay`` by indirect parameter): longer than a 0.3 s timeout,
    shorter than the openai SDK's third attempt begins (after about 0.3 + 0.5 + 0.3 + 1 s)."""
    return RuleBackend(calculator_rule, delay=getattr(request, "param", 1.0))


@pytest.fixture
async def slow_gateway(
    servers: Servers,
    store: EventStore,
    llm: Any,  # noqa: F811
    slow: RuleBackend,
) -> AsyncIterator[Gateway]:
    policy = new_policy()
    config = InferenceConfig(servers.nats_url, policy, backend="scripted", heartbeat_interval=0.5)
    async with serving(config, slow), gateway_for(store, llm, policy) as served:
        yield served


async def test_sdk_retries_after_timeouts_get_the_one_recorded_turn(
    slow_gateway: Gateway, store: EventStore, slow: RuleBackend
) -> None:
    session = await slow_gateway.session()
    client = openai.AsyncOpenAI(
        base_url=f"{slow_gateway.url}/v1", api_key=session["api_key"], timeout=0.3, max_retries=2
    )
    completion = await client.chat.completions.create(model="main", messages=QUESTION)  # type: ignore[arg-type]
    response = await client.responses.create(model="main", input="What is 3 + 3?")
    turns = await turns_of(store, session["session_id"])
    assert len(turns) == 2  # one per logical call, though each was sent up to three times
    assert slow.requests_seen == 2
    assert completion.model_extra is not None
    assert completion.model_extra["turnstile"]["turn_ids"] == [str(turns[0].turn_id)]
    assert response.id == "resp_" + turns[1].turn_id.hex


@pytest.mark.parametrize("slow", [5.0], indirect=True)  # the retry comes well before the reply
async def delivered_in_log(store: EventStore, session_id: str) -> set[uuid.UUID]:
    """The turns a ``TurnDelivered`` of the session's stream names."""
    records = await store.read_stream(f"episode-{session_id}")
    return {t for r in records if isinstance(r.event, TurnDelivered) for t in r.event.turn_ids}


async def test_a_retry_while_the_call_runs_joins_it_and_the_turn_counts_as_delivered(
    slow_gateway: Gateway, store: EventStore, slow: RuleBackend
) -> None:
    session = await slow_gateway.session()
    headers = {"Authorization": f"Bearer {session['api_key']}"}
    body = {"model": "main", "messages": QUESTION}
    async with httpx.AsyncClient(base_url=slow_gateway.url, headers=headers) as http:
        with pytest.raises(httpx.ReadTimeout):
            await http.post("/v1/chat/completions", json=body, timeout=0.3)
        retried = await http.post(
            "/v1/chat/completions", json=body, headers={"x-stainless-retry-count": "1"}, timeout=30
        )
        assert (await http.post("/v1/session/end", json={}, timeout=30)).status_code == 200
    assert retried.status_code == 200, retried.text
    turns = await turns_of(store, session["session_id"])
    assert [str(t.turn_id) for t in turns] == retried.json()["turnstile"]["turn_ids"]
    assert turns[0].delivered is False  # recorded before its reply was handed over ...
    assert await delivered_in_log(store, session["session_id"]) == {turns[0].turn_id}  # ... to the retry
    assert slow.requests_seen == 1


async def test_a_client_that_leaves_gets_its_turn_recorded_as_never_delivered(
    slow_gateway: Gateway, store: EventStore, slow: RuleBackend
) -> None:
    session = await slow_gateway.session()
    headers = {"Authorization": f"Bearer {session['api_key']}"}
    body = {"model": "main", "messages": QUESTION}
    async with httpx.AsyncClient(base_url=slow_gateway.url, headers=headers, timeout=30) as http:
        with pytest.raises(httpx.ReadTimeout):
            await http.post("/v1/chat/completions", json=body, timeout=0.3)

        async def recorded() -> bool:
            return len(await turns_of(store, session["session_id"])) == 1

        await wait_until(recorded, 30, "the abandoned call's turn is recorded")
        (turn,) = await turns_of(store, session["session_id"])
        assert turn.delivered is False
        # sent again by a client that does not say it retries: its reply reached nobody, so this is the retry
        again = await http.post("/v1/chat/completions", json=body)
        assert again.json()["turnstile"]["turn_ids"] == [str(turn.turn_id)]
        # once delivered, the same body is a new call (an agent sampling again) ...
        fresh = await http.post("/v1/chat/completions", json=body, headers={"x-stainless-retry-count": "0"})
        # ... unless the client says it retries, or names the same Idempotency-Key
        retried = await http.post("/v1/chat/completions", json=body, headers={"x-stainless-retry-count": "2"})
        keyed = [
            await http.post(
                "/v1/chat/completions", json=body | {"seed": 1}, headers={"Idempotency-Key": "k1"}
            )
            for _ in range(2)
        ]
    fresh_id = fresh.json()["turnstile"]["turn_ids"]
    assert fresh_id != [str(turn.turn_id)]
    assert retried.json()["turnstile"]["turn_ids"] == fresh_id
    assert keyed[0].json()["turnstile"]["turn_ids"] == keyed[1].json()["turnstile"]["turn_ids"]
    turns = await turns_of(store, session["session_id"])
    assert len(turns) == 3
    assert [t.delivered for t in turns] == [False, False, False]  # recorded before each was handed over
    # the abandoned turn was delivered to the retry, the fresh one to its call (each recorded with the
    # session's next event: the last one's is still waiting for one)
    assert await delivered_in_log(store, session["session_id"]) == {turns[0].turn_id, turns[1].turn_id}
    assert slow.requests_seen == 3


async def test_a_failed_call_is_not_remembered_and_its_retry_runs_again(
    slow_gateway: Gateway, store: EventStore
) -> None:
    session = await slow_gateway.session()
    headers = {"Authorization": f"Bearer {session['api_key']}", "x-stainless-retry-count": "1"}
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": 7}}}
    bad = {"model": "main", "messages": QUESTION, "tools": [tool]}
    async with httpx.AsyncClient(base_url=slow_gateway.url, headers=headers, timeout=30) as http:
        answers = [await http.post("/v1/chat/completions", json=bad) for _ in range(2)]
        good = await http.post("/v1/chat/completions", json={"model": "main", "messages": QUESTION})
    assert [a.status_code for a in answers] == [400, 400]
    assert good.status_code == 200
    assert len(await turns_of(store, session["session_id"])) == 1


# ---- what the materializer makes of undelivered turns ------------------------------------------------


async def never(*_: Any) -> bool:
    return False


@pytest.mark.parametrize("style", ["individual", "concat"])
async def test_undelivered_turns_make_no_samples_unless_a_later_turn_continues_them(style: str) -> None:
    store = InMemoryStore()
    session = EpisodeSession(store, PrefixEcho(), policy="main")
    await session.start()
    question = [{"role": "user", "content": "q"}]
    lost = await session.chat(question, listening=never)  # its client left: never seen
    seen_late = await session.chat(question, listening=never)  # never delivered at first ...
    child = await session.chat([*question, seen_late.message, {"role": "user", "content": "more"}])
    await session.reward(1.0)
    await session.finish("done")
    turns = session.episode().turns
    assert [t.delivered for t in turns] == [False, False, None]

    fold = Fold(MaterializerConfig(batch_samples=10_000, style=style))  # type: ignore[arg-type]
    for event in await store.read_all(0, limit=1000):
        assert event.event is not None
        encoded = encode_event(event.event)
        data = json.loads(encoded.data)
        fold.apply(LogRow(event.position, event.stream, event.type, data, encoded.tokens, event.recorded_at))
    turn_ids, own = SAMPLE_COLUMNS.index("turn_ids"), SAMPLE_COLUMNS.index("turn_id")
    # a sample row names its turns, or is NULL there when its only turn is its own (``turn_id``)
    sampled = {turn for row in fold.writes.samples.values() for turn in _listed(row[turn_ids] or [row[own]])}
    assert str(lost.turn_id) not in sampled
    assert {str(seen_late.turn_id), str(child.turn_id)} <= sampled


def _listed(value: Any) -> list[str]:
    return [str(turn) for turn in (json.loads(value) if isinstance(value, str) else value)]
