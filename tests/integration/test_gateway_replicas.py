"""Gateway replicas sharing their sessions (``--shared-sessions``, docs/gateway.md#replicas): two gateways in
this process on one log and one NATS KV bucket, real HTTP, real consumers over NATS. A conversation whose
calls alternate between them is one token-exact lineage; two calls racing on one session cannot fork it;
a retry on the other replica is answered from the turn the first recorded; the idle timeout ends a session
once whichever replicas try; a replica that stops leaves its sessions to the other.

The same with gateway processes behind HAProxy, one killed with -9 mid-call: test_gateway_replicas_lb.py."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
import nats
import openai
import pytest

from consumers.inference import InferenceConfig
from pipeline.gateway import SharedSessions, create_gateway, gateway_of, serving_http
from pipeline.inference import NatsLLMClient
from pipeline.log import EventStore
from schemas import EpisodeFinished, TurnDelivered
from tests.conftest import Servers
from tests.integration.test_gateway import (
    ADMIN,
    Gateway,
    assert_token_exact_child,
    events_of,
    new_policy,
    turns_of,
)
from tests.support.agent_gateway import lineages
from tests.support.backends import RuleBackend, calculator_rule
from tests.support.serving import serving
from tests.support.waiting import wait_until

QUESTION = [{"role": "user", "content": "What is 2 + 2?"}]


@pytest.fixture
async def llm(servers: Servers) -> AsyncIterator[NatsLLMClient]:
    client = await NatsLLMClient.connect(servers.nats_url, heartbeat_timeout=2.0, wait_for_consumer=5.0)
    yield client
    await client.close()


@pytest.fixture
async def bucket(servers: Servers) -> AsyncIterator[str]:
    """A KV bucket of this test's own (replicas share one by name)."""
    connection = await nats.connect(servers.nats_url)
    name = f"GATEWAY_SESSIONS_{uuid.uuid4().hex[:8]}"
    yield name
    with contextlib.suppress(Exception):
        await connection.jetstream().delete_key_value(name)
    await connection.close()


@pytest.fixture
async def backend(servers: Servers) -> AsyncIterator[tuple[str, RuleBackend]]:
    policy = new_policy()
    rules = RuleBackend(calculator_rule)
    config = InferenceConfig(servers.nats_url, policy, backend="scripted", heartbeat_interval=0.5)
    async with serving(config, rules):
        yield policy, rules


@contextlib.asynccontextmanager
async def replica(
    servers: Servers, store: EventStore, llm: NatsLLMClient, bucket: str, policy: str, **options: Any
) -> AsyncIterator[Gateway]:
    """One gateway replica on a free port, sharing ``bucket``; stopped (its lifespan ends) after the block."""
    connection = await nats.connect(servers.nats_url)
    try:
        shared = await SharedSessions.open(connection.jetstream(), bucket)
        app = create_gateway(store, llm, admin_key=ADMIN, policy_default=policy, shared=shared, **options)
        headers = {"Authorization": f"Bearer {ADMIN}"}
        async with serving_http(app) as url, httpx.AsyncClient(base_url=url, headers=headers) as admin:
            served = Gateway(url, admin, policy)
            served.app = app  # type: ignore[attr-defined]
            yield served
    finally:
        await connection.close()


@pytest.fixture
async def pair(
    servers: Servers, store: EventStore, llm: NatsLLMClient, bucket: str, backend: tuple[str, RuleBackend]
) -> AsyncIterator[tuple[Gateway, Gateway]]:
    policy, _ = backend
    async with (
        replica(servers, store, llm, bucket, policy) as first,
        replica(servers, store, llm, bucket, policy) as second,
    ):
        yield first, second


async def complete(
    replica: Gateway, api_key: str, messages: list[dict[str, Any]], **headers: str
) -> httpx.Response:
    async with httpx.AsyncClient(
        base_url=replica.url, headers={"Authorization": f"Bearer {api_key}", **headers}, timeout=30
    ) as http:
        return await http.post("/v1/chat/completions", json={"model": "main", "messages": messages})


async def test_calls_alternating_between_replicas_make_one_token_exact_lineage(
    pair: tuple[Gateway, Gateway], store: EventStore
) -> None:
    first, second = pair
    session = await first.session()
    messages: list[dict[str, Any]] = []
    for round_, question in enumerate(["What is 2 + 2?", "What is 3 + 4?"]):
        messages.append({"role": "user", "content": question})
        for step, served_by in enumerate((first, second)):
            client = openai.AsyncOpenAI(base_url=f"{served_by.url}/v1", api_key=session["api_key"])
            completion = await client.chat.completions.create(model="main", messages=messages)  # type: ignore[arg-type]
            reply = completion.choices[0].message
            messages.append(reply.model_dump(exclude_none=True))
            if step == 0:
                assert reply.tool_calls, (round_, reply)
                messages.append({"role": "tool", "tool_call_id": reply.tool_calls[0].id, "content": "7"})
    ended = await second.admin.post(f"/admin/sessions/{session['session_id']}/end", json={})
    assert ended.status_code == 200, ended.text
    turns = await turns_of(store, session["session_id"])
    assert len(turns) == 4
    [lineage] = lineages(turns)
    for parent, child in itertools.pairwise(lineage):  # on the test backend: the right prefix was sent
        assert_token_exact_child(parent, child)
    assert [bool(turn.reply.tool_calls) for turn in turns] == [True, False, True, False]
    # the end reached every replica: the key gets 409 on both
    for replica_ in pair:
        refused = await complete(replica_, session["api_key"], QUESTION)
        assert refused.status_code == 409, refused.text
        assert "ended (done)" in refused.text


async def test_two_replicas_racing_on_one_session_do_not_fork_it(
    pair: tuple[Gateway, Gateway], store: EventStore, backend: tuple[str, RuleBackend]
) -> None:
    first, second = pair
    session = await first.session()
    answered = await complete(second, session["api_key"], QUESTION)  # the second replica holds it too
    assert answered.status_code == 200
    _, rules = backend
    rules.delay = 0.5  # both calls are generated before either is recorded
    follow_up = [*QUESTION, answered.json()["choices"][0]["message"]]
    follow_up.append({"role": "tool", "tool_call_id": "x", "content": "4"})
    racing = await asyncio.gather(
        complete(first, session["api_key"], follow_up), complete(second, session["api_key"], follow_up)
    )
    statuses = sorted(response.status_code for response in racing)
    assert statuses == [200, 409], [response.text for response in racing]
    winner, loser = sorted(racing, key=lambda response: response.status_code)
    assert "send it again" in loser.json()["error"]["message"]
    assert loser.headers["retry-after"] == "0"
    turns = await turns_of(store, session["session_id"])
    assert len(turns) == 2  # one lineage, no sibling
    assert turns[1].parent_turn_id == turns[0].turn_id
    # the loser's replica caught up: sent again there, the call continues the recorded turn
    continued = [*follow_up, winner.json()["choices"][0]["message"], {"role": "user", "content": "Thanks."}]
    again = await complete(first, session["api_key"], continued)
    assert again.status_code == 200, again.text
    turns = await turns_of(store, session["session_id"])
    assert [turn.parent_turn_id for turn in turns] == [None, turns[0].turn_id, turns[1].turn_id]


async def test_a_retry_on_the_other_replica_gets_the_turn_the_first_recorded(
    pair: tuple[Gateway, Gateway], store: EventStore, backend: tuple[str, RuleBackend]
) -> None:
    first, second = pair
    session = await first.session()
    _, rules = backend
    rules.delay = 1.0
    async with httpx.AsyncClient(
        base_url=first.url, headers={"Authorization": f"Bearer {session['api_key']}"}
    ) as http:
        with pytest.raises(httpx.ReadTimeout):  # the client leaves before its reply (a replica that died)
            await http.post("/v1/chat/completions", json={"model": "main", "messages": QUESTION}, timeout=0.3)

    async def recorded() -> bool:
        return len(await turns_of(store, session["session_id"])) == 1

    await wait_until(recorded, 30, "the first replica records the call's turn")
    retried = await complete(second, session["api_key"], QUESTION, **{"x-stainless-retry-count": "1"})
    assert retried.status_code == 200, retried.text
    (turn,) = await turns_of(store, session["session_id"])
    assert retried.json()["turnstile"]["turn_ids"] == [str(turn.turn_id)]
    assert turn.delivered is False
    assert rules.requests_seen == 1  # not generated again
    # the delivery is recorded with the session's next event (its end, here)
    assert (
        await second.admin.post(f"/admin/sessions/{session['session_id']}/end", json={})
    ).status_code == 200
    events = await events_of(store, session["session_id"])
    assert [e.turn_ids for e in events if isinstance(e, TurnDelivered)] == [[turn.turn_id]]


async def test_the_idle_timeout_ends_a_session_once_across_replicas(
    servers: Servers, store: EventStore, llm: NatsLLMClient, bucket: str, backend: tuple[str, RuleBackend]
) -> None:
    policy, _ = backend
    async with (
        replica(servers, store, llm, bucket, policy, idle_timeout=0.5) as first,
        replica(servers, store, llm, bucket, policy, idle_timeout=0.5) as second,
    ):
        session = await first.session()
        assert (await complete(second, session["api_key"], QUESTION)).status_code == 200

        async def ended() -> bool:
            events = await events_of(store, session["session_id"])
            return isinstance(events[-1], EpisodeFinished)

        await wait_until(ended, 30, "an idle session ends")
        for served in (first, second):  # both replicas try, every pass: give them a few
            reaped = await gateway_of(served.app).reap_idle()  # type: ignore[attr-defined]
            assert reaped == []
    events = await events_of(store, session["session_id"])
    finished = [e for e in events if isinstance(e, EpisodeFinished)]
    assert [e.termination for e in finished] == ["timeout"]


async def test_a_replica_that_stops_leaves_its_sessions_to_the_others(
    servers: Servers, store: EventStore, llm: NatsLLMClient, bucket: str, backend: tuple[str, RuleBackend]
) -> None:
    policy, _ = backend
    async with replica(servers, store, llm, bucket, policy) as second:
        async with replica(servers, store, llm, bucket, policy) as first:
            session = await first.session()
            assert (await complete(first, session["api_key"], QUESTION)).status_code == 200
        # the first replica stopped: the session is open, and the second serves it
        events = await events_of(store, session["session_id"])
        assert not any(isinstance(e, EpisodeFinished) for e in events)
        assert "runner" not in (await store.read_stream(f"episode-{session['session_id']}"))[0].metadata
        listed = await second.admin.get(f"/admin/sessions/{session['session_id']}")
        assert listed.status_code == 200
        assert listed.json()["turns"] == 1
        answered = await complete(second, session["api_key"], QUESTION, **{"x-stainless-retry-count": "0"})
        assert answered.status_code == 200, answered.text
        assert len(await turns_of(store, session["session_id"])) == 2
    events = await events_of(store, session["session_id"])
    assert not any(isinstance(e, EpisodeFinished) for e in events)  # nor when the last one stops


async def test_an_unknown_key_is_refused_on_every_replica(pair: tuple[Gateway, Gateway]) -> None:
    for served in pair:
        refused = await complete(served, "ts-made-up", QUESTION)
        assert refused.status_code == 401
        missing = await served.admin.get(f"/admin/sessions/{uuid.uuid4().hex}")
        assert missing.status_code == 404
