"""Two ``turnstile serve gateway --shared-sessions`` processes behind Debian's HAProxy on deploy/haproxy.cfg
(round-robin, no affinity), an openai-SDK agent through the balancer: the replica that holds a call in flight
is killed with SIGKILL; the SDK's retry lands on the other replica and the episode completes with every turn
recorded once, in one token-exact lineage."""

from __future__ import annotations

import asyncio
import itertools
import uuid
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from consumers.inference import InferenceConfig
from pipeline.log import EventStore
from schemas import EpisodeFinished, LLMRequest, TurnDelivered
from tests.conftest import Servers
from tests.integration.test_gateway import assert_token_exact_child, events_of, new_policy, turns_of
from tests.support.agent_gateway import lineages
from tests.support.backends import Generation, RuleBackend, calculator_rule
from tests.support.load_balancer import Replica, gateway_replicas, kill_holding_replica, sessions_held
from tests.support.serving import serving
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow  # two gateway processes start (about 20 s on an idle machine)

ADMIN = "admin-" + uuid.uuid4().hex
QUESTIONS = ["What is 2 + 2?", "What is 3 + 4?", "What is 5 + 6?"]


class HeldBackend(RuleBackend):
    """The calculator, holding the call after ``hold()`` until ``release`` is set."""

    def __init__(self) -> None:
        super().__init__(calculator_rule)
        self.holding = False
        self.arrived = asyncio.Event()
        self.release = asyncio.Event()

    def hold(self) -> None:
        self.holding = True

    async def generate(self, request: LLMRequest) -> Generation:
        if self.holding:
            self.holding = False
            self.arrived.set()
            await self.release.wait()
        return await super().generate(request)


async def test_killing_the_replica_that_holds_a_call_loses_no_turn(
    servers: Servers, database_url: str, store: EventStore, tmp_path: Path
) -> None:
    policy = new_policy()
    backend = HeldBackend()
    config = InferenceConfig(servers.nats_url, policy, backend="scripted", heartbeat_interval=0.5)
    async with (
        serving(config, backend),
        gateway_replicas(database_url, servers.nats_url, policy, ADMIN, tmp_path) as (url, replicas),
        httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {ADMIN}"}) as admin,
    ):
        created = await admin.post("/admin/sessions", json={"task": {"q": QUESTIONS}}, timeout=30)
        assert created.status_code == 201, created.text
        session = created.json()
        assert session["base_url"] == f"{url}/v1"  # handed out as the client reached it: the balancer
        client = openai.AsyncOpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=5)
        messages: list[dict[str, Any]] = []
        killed: Replica | None = None
        for round_, question in enumerate(QUESTIONS):
            messages.append({"role": "user", "content": question})
            if round_ == 1:  # round-robin, no affinity: both replicas have served the session by now
                for replica in replicas:
                    assert session["session_id"] in {
                        s["session_id"] for s in await sessions_held(replica, ADMIN)
                    }

                async def recorded_delivered() -> bool:
                    turns = await turns_of(store, session["session_id"])
                    return await delivered(store, session["session_id"]) == {t.turn_id for t in turns}

                await wait_until(recorded_delivered, 30, "the first round's deliveries are recorded")
                backend.hold()
            call = asyncio.create_task(client.chat.completions.create(model="main", messages=messages))  # type: ignore[arg-type]
            if round_ == 1:
                await asyncio.wait_for(backend.arrived.wait(), 60)
                killed = await kill_holding_replica(replicas, ADMIN, session["session_id"])
                backend.release.set()
            completion = await call
            reply = completion.choices[0].message
            assert reply.tool_calls, reply
            messages.append(reply.model_dump(exclude_none=True))
            messages.append({"role": "tool", "tool_call_id": reply.tool_calls[0].id, "content": "4"})
            answer = await client.chat.completions.create(model="main", messages=messages)  # type: ignore[arg-type]
            messages.append(answer.choices[0].message.model_dump(exclude_none=True))
        ended = await admin.post(f"/admin/sessions/{session['session_id']}/end", json={}, timeout=30)
        assert ended.status_code == 200, ended.text
    assert killed is not None
    turns = await turns_of(store, session["session_id"])
    assert len(turns) == 2 * len(QUESTIONS)  # none lost, none twice
    [lineage] = lineages(turns)  # no fork
    for parent, child in itertools.pairwise(lineage):  # on the test backend: the right prefix was sent
        assert_token_exact_child(parent, child)
    assert [bool(turn.reply.tool_calls) for turn in turns] == [True, False] * len(QUESTIONS)
    assert backend.requests_seen == len(turns) + 1  # the killed replica's call was generated, never recorded
    events = await events_of(store, session["session_id"])
    assert [e.termination for e in events if isinstance(e, EpisodeFinished)] == ["done"]
    assert await delivered(store, session["session_id"]) == {turn.turn_id for turn in turns}


async def delivered(store: EventStore, session_id: str) -> set[uuid.UUID]:
    """The turns a ``TurnDelivered`` of the session names (each replica records its deliveries at once)."""
    events = await events_of(store, session_id)
    return {turn_id for e in events if isinstance(e, TurnDelivered) for turn_id in e.turn_ids}
