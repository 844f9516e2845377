"""The NATS request path with an instant scripted backend: routing, affinity, retries, refusals."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, AsyncExitStack
from typing import Any

import pytest

from consumers.inference import InferenceConfig
from pipeline.inference.backends import Backend
from pipeline.inference.backends.scripted import ScriptedBackend
from pipeline.inference.client import (
    CONSUMER_HEADER,
    HEARTBEAT_HEADER,
    NatsLLMClient,
    NoInferenceConsumer,
    QueueLLMClient,
    RequestRejected,
    raise_for_error,
)
from pipeline.inference.service import InferenceService
from schemas import ChatMessage, LLMError, LLMRequest, LLMResponse, ToolChoice, parse_wire
from tests.conftest import Servers
from tests.support.serving import serving
from tests.support.waiting import wait_until


def new_policy() -> str:
    return f"p{uuid.uuid4().hex[:10]}"


def ask(policy: str, episode: str | None = None, content: str = "hi") -> LLMRequest:
    return LLMRequest(policy=policy, episode_id=episode, messages=[ChatMessage(role="user", content=content)])


def consumer(
    nats_url: str, policy: str, consumer_id: str, backend: Backend | None = None
) -> AbstractAsyncContextManager[InferenceService]:
    config = InferenceConfig(
        nats_url, policy, backend="scripted", consumer_id=consumer_id, heartbeat_interval=0.2
    )
    return serving(config, backend or ScriptedBackend())


@pytest.fixture
async def client(servers: Servers) -> AsyncIterator[NatsLLMClient]:
    llm = await NatsLLMClient.connect(
        servers.nats_url, heartbeat_timeout=1.0, timeout=30, wait_for_consumer=1.0
    )
    yield llm
    await llm.close()


async def test_many_episodes_spread_over_two_consumers_and_stick_to_the_first_server(
    servers: Servers, client: NatsLLMClient
) -> None:
    policy = new_policy()
    async with consumer(servers.nats_url, policy, "a") as a, consumer(servers.nats_url, policy, "b") as b:
        episodes = [f"e{i}" for i in range(60)]
        first = await asyncio.gather(*(client(ask(policy, e)) for e in episodes))
        assert Counter(r.consumer_id for r in first).keys() == {"a", "b"}  # the queue group spreads them
        later = await asyncio.gather(*(client(ask(policy, e)) for e in episodes for _ in range(3)))
        served_by = {r.consumer_id for r in first}
        assert served_by == {"a", "b"}
        for index, episode in enumerate(episodes):
            turns = later[index * 3 : index * 3 + 3]
            assert {r.consumer_id for r in turns} == {first[index].consumer_id}, episode
        assert a.requests_served + b.requests_served == 240


async def test_affinity_falls_back_to_the_queue_group_when_its_consumer_is_gone(
    servers: Servers, client: NatsLLMClient
) -> None:
    policy = new_policy()
    async with AsyncExitStack() as outlives:
        async with consumer(servers.nats_url, policy, "leaves") as leaving:
            assert (await client(ask(policy, "e1"))).consumer_id == "leaves"  # the only one: e1 sticks to it
            await outlives.enter_async_context(consumer(servers.nats_url, policy, "stays"))
            assert (await client(ask(policy, "e1"))).consumer_id == "leaves"
            served_before = leaving.requests_served
        response = await client(ask(policy, "e1"))
        assert response.consumer_id == "stays"
        assert client.consumer_for("e1") == "stays"
        assert served_before == 2


async def test_a_consumer_killed_mid_request_is_replaced_by_a_retry(
    servers: Servers, client: NatsLLMClient
) -> None:
    policy = new_policy()
    doomed = subprocess.Popen(  # noqa: ASYNC220  (starting a process does not block for long)
        [sys.executable, "-m", "tests.support.consumer_process", servers.nats_url, policy, "doomed", "60"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert doomed.stdout is not None
        assert (await asyncio.to_thread(doomed.stdout.readline)).strip() == "ready"
        request = ask(policy, "e1")
        pending = asyncio.create_task(client(request))
        await wait_until(lambda: client.heartbeats >= 1, 60, "a heartbeat: the doomed consumer has it")
        assert not pending.done()
        async with consumer(servers.nats_url, policy, "survivor") as survivor:
            doomed.kill()
            response = await pending
        assert response.consumer_id == "survivor"
        assert response.request_id == request.request_id
        assert survivor.requests_served == 1
    finally:
        doomed.kill()
        doomed.wait()


async def test_a_slow_consumer_that_sends_heartbeats_is_waited_for(
    servers: Servers, client: NatsLLMClient
) -> None:
    policy = new_policy()
    slow = ScriptedBackend(delay=2.5)  # longer than the client's heartbeat_timeout of 1 s
    async with consumer(servers.nats_url, policy, "slow", slow):
        response = await client(ask(policy, "e1"))
    assert response.consumer_id == "slow"
    assert slow.requests_seen == 1
    assert client.heartbeats >= 1
    assert client.silent_consumers == 0  # never given up on: the heartbeats kept the wait alive


async def test_no_consumer_for_a_policy_is_a_clear_error(client: NatsLLMClient) -> None:
    policy = new_policy()
    with pytest.raises(NoInferenceConsumer, match=f"no inference consumer for policy '{policy}'"):
        await client(ask(policy))


async def test_malformed_requests_get_an_error_naming_the_field_and_the_consumer_stays_up(
    servers: Servers, client: NatsLLMClient
) -> None:
    policy = new_policy()
    good = ask(policy).model_dump(mode="json")
    async with consumer(servers.nats_url, policy, "c"):
        cases = {
            "messages": {**good, "messages": []},
            "messages.0.role": {**good, "messages": [{"role": "wizard", "content": "hi"}]},
            "sampling.temperature": {**good, "sampling": {"temperature": -1}},
            "policy": {**good, "policy": "someone-else"},
        }
        for field, body in cases.items():
            reply = await client.connection.request(
                f"llm.{policy}.requests", json.dumps(body).encode(), timeout=5
            )
            error = json.loads(reply.data)
            assert (error["type"], error["code"], error["field"]) == ("LLMError", "invalid_request", field)
        not_json = await client.connection.request(f"llm.{policy}.requests", b"{not json", timeout=5)
        assert json.loads(not_json.data)["code"] == "invalid_request"
        assert (await client(ask(policy))).text == "ok"


async def test_payloads_over_max_payload_are_refused_with_a_clear_error(
    servers: Servers, client: NatsLLMClient
) -> None:
    policy = new_policy()
    huge = ask(policy, content="x" * (client.connection.max_payload + 1))
    with pytest.raises(RequestRejected, match="over the NATS server's max_payload"):
        await client(huge)
    async with consumer(servers.nats_url, policy, "c") as service:
        service.max_payload = 100  # a reply cannot fit
        with pytest.raises(
            RequestRejected, match=r"sampling\.max_tokens.*over the NATS server's max_payload"
        ):
            await client(ask(policy))


async def test_the_queue_client_hands_requests_to_a_driver() -> None:
    llm = QueueLLMClient()
    request = ask("main", "e1")
    pending = asyncio.create_task(llm(request))
    call = await llm.next_call()
    assert call.request == request
    response = LLMResponse(
        request_id=request.request_id,
        text="hello",
        finish_reason="stop",
        prompt_token_ids=[1],
        completion_token_ids=[2],
        completion_logprobs=[-0.1],
        policy_version=0,
        consumer_id="driver",
    )
    call.reply(response)
    assert await pending == response


async def test_the_same_request_sent_twice_in_sequence_or_at_once_is_generated_once(
    servers: Servers, client: NatsLLMClient
) -> None:
    policy, backend = new_policy(), ScriptedBackend()
    async with consumer(servers.nats_url, policy, "dedupe", backend):
        request = ask(policy, "e1")
        first = await client(request)
        again = await client(request)  # a retry after a lost reply: the consumer answers from its memory
        assert backend.requests_seen == 1
        assert again == first
        twice = ask(policy, "e2")
        together = await asyncio.gather(client(twice), client(twice))
        assert backend.requests_seen == 2
        assert together[0] == together[1]
        assert together[0].request_id == twice.request_id


# -- the service itself, without NATS: what it answers for one message ---------------------------------------


class Published:
    """The service's publish port, recording what it sends (heartbeats)."""

    def __init__(self) -> None:
        self.messages: list[tuple[str, bytes, dict[str, str]]] = []

    async def __call__(self, subject: str, payload: bytes, headers: dict[str, str]) -> None:
        self.messages.append((subject, payload, headers))


class Held(ScriptedBackend):
    """Generates only once released: the test decides when a request finishes."""

    def __init__(self) -> None:
        super().__init__()
        self.release = asyncio.Event()
        self.arrived = 0

    async def generate(self, request: LLMRequest) -> Any:
        self.arrived += 1
        await self.release.wait()
        return await super().generate(request)


async def test_a_request_with_fields_from_a_newer_client_is_answered() -> None:
    service = InferenceService(ScriptedBackend(), policy="p", consumer_id="c", publish=Published())
    request = ask("p", "e1")
    newer = json.loads(request.model_dump_json()) | {"added_in_a_later_version": {"x": 1}}
    reply = parse_wire(await service.handle(json.dumps(newer).encode(), None))
    assert isinstance(reply, LLMResponse)
    assert reply.request_id == request.request_id


async def test_a_request_for_another_policy_is_refused_with_its_request_id() -> None:
    service = InferenceService(ScriptedBackend(), policy="p", consumer_id="c", publish=Published())
    request = ask("other", "e1")
    reply = parse_wire(await service.handle(request.model_dump_json().encode(), None))
    assert isinstance(reply, LLMError)
    assert (reply.request_id, reply.code, reply.field) == (request.request_id, "invalid_request", "policy")


async def test_heartbeats_go_to_the_reply_subject_while_a_request_runs_and_stop_after() -> None:
    backend, published = Held(), Published()
    service = InferenceService(
        backend, policy="p", consumer_id="c", publish=published, heartbeat_interval=0.01
    )
    request = ask("p", "e1").model_dump_json().encode()
    with_reply = asyncio.create_task(service.handle(request, "_INBOX.me.1"))
    await wait_until(lambda: len(published.messages) >= 2, 60, "two heartbeats")
    assert service.in_flight == 1
    again = asyncio.create_task(service.handle(request, None))  # the same request, no reply subject
    await asyncio.sleep(0)  # `again` runs up to its first wait: it has joined the request in flight
    backend.release.set()
    first, second = await with_reply, await again
    assert first == second
    assert backend.arrived == backend.requests_seen == 1
    assert service.in_flight == 0  # finished requests leave the in-flight table
    sent = len(published.messages)
    assert {(subject, headers[HEARTBEAT_HEADER], headers[CONSUMER_HEADER]) for subject, _, headers in
            published.messages} == {("_INBOX.me.1", "1", "c")}  # fmt: skip
    await asyncio.sleep(0.05)  # five heartbeat intervals: a heartbeat left running would send here
    assert len(published.messages) == sent


async def test_a_request_id_reused_with_other_content_is_refused_and_never_gets_the_first_reply() -> None:
    backend = Held()
    service = InferenceService(backend, policy="p", consumer_id="c", publish=Published())
    mine = ask("p", "e1", content="my secret question")
    theirs = mine.model_copy(update={"messages": [ChatMessage(role="user", content="another question")]})
    running = asyncio.create_task(service.handle(mine.model_dump_json().encode(), None))
    await wait_until(lambda: backend.arrived == 1, 60, "the first request at the backend")
    while_running = parse_wire(await service.handle(theirs.model_dump_json().encode(), None))
    backend.release.set()
    first = parse_wire(await running)
    after = parse_wire(await service.handle(theirs.model_dump_json().encode(), None))
    assert isinstance(first, LLMResponse)
    for refused in (while_running, after):
        assert isinstance(refused, LLMError)
        assert (refused.code, refused.field) == ("invalid_request", "request_id")
        assert "already used for a request with other content" in refused.message
    retried = parse_wire(await service.handle(mine.model_dump_json().encode(), None))
    assert retried == first  # the same request again is still answered from memory
    assert backend.requests_seen == 1


async def test_a_request_the_backend_rejects_gets_an_error_naming_its_id_field_and_reason() -> None:
    class Rejecting(ScriptedBackend):
        async def generate(self, request: LLMRequest) -> Any:
            raise RequestRejected("messages", "the prompt is 5000 tokens; the model's context is 4096")

    service = InferenceService(Rejecting(), policy="p", consumer_id="c", publish=Published())
    request = ask("p", "e1")
    reply = parse_wire(await service.handle(request.model_dump_json().encode(), None))
    assert isinstance(reply, LLMError)
    assert (reply.request_id, reply.code, reply.field, reply.consumer_id) == (
        request.request_id, "invalid_request", "messages", "c",
    )  # fmt: skip
    assert reply.message == "the prompt is 5000 tokens; the model's context is 4096"
    with pytest.raises(RequestRejected) as raised:  # what the caller sees: said once, not twice
        raise_for_error(reply)
    assert str(raised.value) == (
        "LLM request rejected because messages: the prompt is 5000 tokens; the model's context is 4096"
    )


async def test_tool_choice_none_leaves_tool_call_blocks_as_text_and_auto_parses_them() -> None:
    block = '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    service = InferenceService(
        ScriptedBackend(f"sure {block}"), policy="p", consumer_id="c", publish=Published()
    )
    replies = {}
    for mode in ("auto", "none"):
        request = ask("p", "e1").model_copy(update={"tool_choice": ToolChoice(mode=mode)})
        reply = parse_wire(await service.handle(request.model_dump_json().encode(), None))
        assert isinstance(reply, LLMResponse)
        replies[mode] = reply
    assert (replies["auto"].text, replies["auto"].finish_reason) == ("sure", "tool_calls")
    assert [call.function.name for call in replies["auto"].tool_calls] == ["add"]
    assert (replies["none"].text, replies["none"].finish_reason, replies["none"].tool_calls) == (
        f"sure {block}",
        "stop",
        [],
    )


async def test_reasoning_is_split_off_before_tool_calls_are_parsed() -> None:
    block = '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    backend = ScriptedBackend(f"<think>\nI should add.\n</think>\n\nsure {block}")
    service = InferenceService(backend, policy="p", consumer_id="c", publish=Published())
    reply = parse_wire(await service.handle(ask("p", "e1").model_dump_json().encode(), None))
    assert isinstance(reply, LLMResponse)
    assert (reply.reasoning, reply.text, reply.finish_reason) == ("I should add.", "sure", "tool_calls")
    assert [call.function.name for call in reply.tool_calls] == ["add"]
    plain = InferenceService(
        backend, policy="p", consumer_id="c", publish=Published(), reasoning_markers=None
    )
    kept = parse_wire(await plain.handle(ask("p", "e2").model_dump_json().encode(), None))
    assert isinstance(kept, LLMResponse)
    assert kept.reasoning is None
    assert kept.text.startswith("<think>")  # a model without a reasoning channel keeps its text as written
