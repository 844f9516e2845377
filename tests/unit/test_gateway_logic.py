"""Gateway logic on the in-memory store and an in-process LLM client (no PostgreSQL, no NATS, no socket):
admission, keys, both dialects' routes and error shapes, turns recorded. The real servers and the official
SDKs are in test_gateway.py."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.dialects.anthropic import signature
from pipeline.gateway import create_gateway, gateway_of
from pipeline.gateway.http import _storable, parse_json
from pipeline.gateway.http_error import GatewayError
from pipeline.inference.client import QueueLLMClient
from pipeline.log import InMemoryStore
from schemas import ToolChoice, TurnCompleted
from tests.support.backends import PrefixEcho
from tests.support.waiting import wait_until

ADMIN = {"Authorization": "Bearer admin-key"}


@pytest.fixture
async def gateway() -> AsyncIterator[tuple[httpx.AsyncClient, InMemoryStore]]:
    store = InMemoryStore()
    app = create_gateway(store, PrefixEcho(), admin_key="admin-key", capacity=1, policy_default="main")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as client:
        yield client, store


async def test_sessions_need_the_admin_key_and_stop_at_capacity(
    gateway: tuple[httpx.AsyncClient, InMemoryStore],
) -> None:
    client, store = gateway
    refused = await client.post("/admin/sessions", json={})
    assert refused.status_code == 401
    assert refused.json()["error"]["type"] == "invalid_request_error"
    created = await client.post("/admin/sessions", json={"task": {"id": 1}}, headers=ADMIN)
    assert created.status_code == 201
    assert created.json()["api_key"].startswith("ts-")
    full = await client.post("/admin/sessions", json={}, headers=ADMIN)
    assert (full.status_code, full.headers["retry-after"]) == (429, "1")
    assert full.json()["error"]["code"] == "rate_limit_exceeded"
    assert await store.head() == 1  # one EpisodeStarted


async def test_both_dialects_record_turns_and_answer_errors_in_their_own_shape(
    gateway: tuple[httpx.AsyncClient, InMemoryStore],
) -> None:
    client, store = gateway
    session = (await client.post("/admin/sessions", json={}, headers=ADMIN)).json()
    key = {"Authorization": f"Bearer {session['api_key']}"}

    chat = await client.post(
        "/v1/chat/completions",
        json={"model": "main", "messages": [{"role": "user", "content": "hi"}]},
        headers=key,
    )
    assert chat.status_code == 200
    assert chat.json()["object"] == "chat.completion"
    message = await client.post(
        "/v1/v1/messages",
        json={"model": "main", "max_tokens": 8, "messages": [{"role": "user", "content": "hello"}]},
        headers={"x-api-key": session["api_key"]},
    )
    assert message.status_code == 200
    assert (message.json()["type"], message.json()["content"][0]["text"]) == ("message", "reply 2")
    turns = [r.event for r in await store.read_all() if isinstance(r.event, TurnCompleted)]
    assert [str(t.turn_id) for t in turns] == [
        *chat.json()["turnstile"]["turn_ids"],
        *message.json()["turnstile"]["turn_ids"],
    ]

    anthropic_error = await client.post("/v1/messages", json={"messages": []}, headers=key)
    assert anthropic_error.status_code == 400
    assert anthropic_error.json()["type"] == "error"
    assert "max_tokens" in anthropic_error.json()["error"]["message"]
    openai_error = await client.post("/v1/chat/completions", json={"messages": "hi"}, headers=key)
    assert (openai_error.status_code, openai_error.json()["error"]["param"]) == (400, "messages")
    assert (await client.post("/v2/messages", json={})).json()["type"] == "error"  # Anthropic's shape
    assert (await client.get("/v1/embeddings")).json()["error"]["code"] == "not_found"  # OpenAI's

    ended = await client.post("/v1/session/end", headers=key)
    assert ended.json()["termination"] == "done"
    assert (await store.read_all())[-1].type == "EpisodeFinished"
    head = await store.head()
    # after the end, its key and its id get 409 saying it ended and what to do; nothing more is recorded
    for method, path, body, headers in [
        ("POST", "/v1/chat/completions", {}, key),
        ("POST", "/v1/session/reward", {"value": 1.0}, key),
        ("POST", "/v1/session/end", {}, key),
        ("GET", "/v1/session", None, key),
        ("POST", f"/admin/sessions/{session['session_id']}/reward", {"value": 1.0}, ADMIN),
        ("POST", f"/admin/sessions/{session['session_id']}/end", {}, ADMIN),
        ("GET", f"/admin/sessions/{session['session_id']}", None, ADMIN),
    ]:
        late = await client.request(method, path, json=body, headers=headers)
        assert late.status_code == 409, (path, late.text)
        message = late.json()["error"]["message"]
        assert f"session {session['session_id']} ended (done)" in message
        assert "post the reward first, then end it" in message
    assert await store.head() == head
    unknown = await client.post("/admin/sessions/nosuch/reward", json={"value": 1.0}, headers=ADMIN)
    assert unknown.status_code == 404
    assert (await client.post("/v1/session/end", headers={"x-api-key": "ts-made-up"})).status_code == 401


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({"group_size": 10**12}, "group_size"),
        ({"policy": "has space"}, "policy"),
        ({"policy": "*"}, "policy"),
        ({"policy": ">"}, "policy"),
        ({"policy": "a.>"}, "policy"),
        ({"sampling": {"seed": 2**70}}, "seed"),
        ({"sampling": {"max_tokens": 10**12}}, "max_tokens"),
    ],
)
async def test_a_session_nothing_downstream_could_serve_or_store_is_refused_up_front(
    gateway: tuple[httpx.AsyncClient, InMemoryStore], spec: dict[str, object], field: str
) -> None:
    client, store = gateway
    refused = await client.post("/admin/sessions", json=spec, headers=ADMIN)
    assert refused.status_code == 400, refused.text
    assert field in refused.json()["error"]["message"]
    assert await store.head() == 0  # nothing recorded
    created = await client.post("/admin/sessions", json={}, headers=ADMIN)
    assert created.status_code == 201  # the gateway goes on


@pytest.mark.parametrize(
    ("body", "said"),
    [
        ('{"model": "m", "messages": [{"role": "user", "content": "\\ud800"}]}', "lone surrogate"),
        ('{"model": "m", "messages": [{"role": "user", "content": "a\\uDFFF"}]}', "lone surrogate"),
        (  # a surrogate in UTF-8 bytes, which json.loads takes
            '{"model": "m", "messages": [{"role": "user", "content": "\ud800"}]}'.encode(
                "utf-8", "surrogatepass"
            ),
            "lone surrogate",
        ),
        (  # UTF-16, which json.loads detects
            '{"model": "m", "messages": [{"role": "user", "content": "x\\u0000"}]}'.encode("utf-16"),
            "NUL character",
        ),
        (
            '{"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", '
            '"function": {"name": "f\\u0000", "parameters": {}}}]}',
            "NUL character",
        ),
        (
            '{"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", '
            '"function": {"name": "f", "parameters": {"\\u0000": 1}}}]}',
            "NUL character",
        ),
        ("[" * 50_000 + "]" * 50_000, "nests JSON too deeply"),
    ],
)
async def test_what_the_log_cannot_hold_is_refused_before_inference_runs(
    gateway: tuple[httpx.AsyncClient, InMemoryStore], body: str | bytes, said: str
) -> None:
    client, store = gateway
    session = (await client.post("/admin/sessions", json={}, headers=ADMIN)).json()
    key = {"Authorization": f"Bearer {session['api_key']}", "Content-Type": "application/json"}
    refused = await client.post("/v1/chat/completions", content=body, headers=key)
    assert refused.status_code == 400, refused.text
    assert said in refused.json()["error"]["message"]
    assert await store.head() == 1  # only the session's EpisodeStarted: no turn, and no inference call
    fine = await client.post(
        "/v1/chat/completions",
        json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
        headers=key,
    )
    assert fine.status_code == 200  # the gateway goes on


@pytest.mark.parametrize(
    ("path", "tools", "param"),
    [
        (
            "/v1/chat/completions",
            [{"type": "function", "function": {"name": "ok", "parameters": {"type": "object"}}},
             {"type": "function",
              "function": {"name": "f", "parameters": {"type": "objectx", "properties": 5}}}],
            "tools[1].function.parameters",
        ),
        (
            "/v1/messages",
            [{"name": "f", "input_schema": {"type": "object", "required": "x"}}],
            None,  # Anthropic's error shape has no param; the message names the tool
        ),
    ],
)  # fmt: skip
async def test_a_tool_whose_parameters_is_not_a_json_schema_is_refused_in_both_apis(
    gateway: tuple[httpx.AsyncClient, InMemoryStore], path: str, tools: list[object], param: str | None
) -> None:
    client, store = gateway
    session = (await client.post("/admin/sessions", json={}, headers=ADMIN)).json()
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], "tools": tools}
    refused = await client.post(path, json=body, headers={"x-api-key": session["api_key"]})
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert "'f') is not a valid JSON Schema" in error["message"]
    assert ("at properties: 5 is not of type 'object'" in error["message"]) or (
        "at required: 'x' is not of type 'array'" in error["message"]
    )
    if param is not None:
        assert error["param"] == param
    assert await store.head() == 1  # nothing but the session's start


async def test_tool_choice_is_recorded_with_the_turn_in_both_apis(
    gateway: tuple[httpx.AsyncClient, InMemoryStore],
) -> None:
    client, store = gateway
    session = (await client.post("/admin/sessions", json={}, headers=ADMIN)).json()
    key = {"x-api-key": session["api_key"]}
    messages = [{"role": "user", "content": "hi"}]
    openai_tool = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
    anthropic_tool = {"name": "add", "input_schema": {"type": "object"}}
    calls = [
        ("/v1/chat/completions", {"tools": [openai_tool], "tool_choice": "required"}),
        ("/v1/chat/completions", {"tools": [openai_tool], "tool_choice": "none"}),
        ("/v1/messages", {"tools": [anthropic_tool], "tool_choice": {"type": "tool", "name": "add"}}),
        ("/v1/messages", {"tools": [anthropic_tool]}),
    ]
    for path, extra in calls:
        body = {"model": "m", "max_tokens": 8, "messages": messages, **extra}
        answered = await client.post(path, json=body, headers=key)
        assert answered.status_code == 200, answered.text
    turns = [r.event for r in await store.read_all() if isinstance(r.event, TurnCompleted)]
    assert [t.request.tool_choice for t in turns] == [
        ToolChoice(mode="required"),
        ToolChoice(mode="none"),
        ToolChoice(mode="function", name="add"),
        None,
    ]


async def test_reasoning_comes_back_in_each_apis_field_and_continues_whether_sent_back_or_dropped() -> None:
    store, backend = InMemoryStore(), PrefixEcho(reasoning="Think first.")
    app = create_gateway(store, backend, admin_key="admin-key", policy_default="main")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as client:
        session = (await client.post("/admin/sessions", json={}, headers=ADMIN)).json()
        key = {"x-api-key": session["api_key"]}
        question = {"role": "user", "content": "2+2?"}
        first = (
            await client.post(
                "/v1/chat/completions", json={"model": "m", "messages": [question]}, headers=key
            )
        ).json()
        message = first["choices"][0]["message"]
        assert message["reasoning_content"] == "Think first."
        follow_up = {"role": "user", "content": "and 3+3?"}
        without = {"role": "assistant", "content": message["content"]}  # a client that drops it
        for sent_back in (message, without):
            body = {"model": "m", "messages": [question, sent_back, follow_up]}
            assert (await client.post("/v1/chat/completions", json=body, headers=key)).status_code == 200
            assert backend.requests[-1].prefix is not None  # continued from the recorded tokens
            assert backend.requests[-1].prefix.message_count == 2
        anthropic = (
            await client.post(
                "/v1/messages", json={"model": "m", "max_tokens": 8, "messages": [question]}, headers=key
            )
        ).json()
        assert anthropic["content"][0] == {
            "type": "thinking",
            "thinking": "Think first.",
            "signature": signature("Think first."),  # the reasoning's text, restorable
        }
        history = [question, {"role": "assistant", "content": anthropic["content"]}, follow_up]
        body = {"model": "m", "max_tokens": 8, "messages": history}
        assert (await client.post("/v1/messages", json=body, headers=key)).status_code == 200
        assert backend.requests[-1].prefix is not None
    turns = [r.event for r in await store.read_all() if isinstance(r.event, TurnCompleted)]
    assert {t.reply.reasoning for t in turns} == {"Think first."}


async def test_side_calls_are_marked_not_for_training_by_header_or_by_the_sessions_model_rule() -> None:
    store = InMemoryStore()
    app = create_gateway(store, PrefixEcho(), admin_key="admin-key", policy_default="main")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as client:
        spec = {"untrained_models": ["claude-haiku-*", "title-?"]}
        session = (await client.post("/admin/sessions", json=spec, headers=ADMIN)).json()
        key = {"x-api-key": session["api_key"]}

        async def messages(model: str, text: str, **headers: str) -> httpx.Response:
            body = {"model": model, "max_tokens": 8, "messages": [{"role": "user", "content": text}]}
            return await client.post("/v1/messages", json=body, headers={**key, **headers})

        async def chat(model: str, text: str, **headers: str) -> httpx.Response:
            body = {"model": model, "messages": [{"role": "user", "content": text}]}
            return await client.post("/v1/chat/completions", json=body, headers={**key, **headers})

        answered = [
            await messages("claude-sonnet-4-5", "the task"),  # the agent's loop: trained
            await messages("claude-haiku-4-5-20251001", "is this a new topic?"),  # matches: a side call
            await chat("title-1", "name this chat"),  # matches title-?
            await chat("title-10", "name it again"),  # ? is one character: trained
            await chat("main", "a summary", **{"x-turnstile-train": "false"}),  # the header marks it
            await messages(
                "claude-haiku-4-5", "trained anyway", **{"x-turnstile-train": "True"}
            ),  # overrides
        ]
        assert [r.status_code for r in answered] == [200] * 6
        bad = await chat("main", "x", **{"x-turnstile-train": "maybe"})
        assert bad.status_code == 400
        assert bad.json()["error"]["param"] == "x-turnstile-train"
        assert "must be true or false, got 'maybe'" in bad.json()["error"]["message"]
    turns = [r.event for r in await store.read_all() if isinstance(r.event, TurnCompleted)]
    # None: the materializer's lineage rule decides; True: asked for; the bad call: not recorded
    assert [t.train for t in turns] == [None, False, False, None, False, True]
    assert [t.model for t in turns] == [
        "claude-sonnet-4-5",
        "claude-haiku-4-5-20251001",
        "title-1",
        "title-10",
        "main",
        "claude-haiku-4-5",
    ]


async def test_the_whole_prompt_ids_come_back_only_when_asked_for(
    gateway: tuple[httpx.AsyncClient, InMemoryStore],
) -> None:
    client, store = gateway
    session = (await client.post("/admin/sessions", json={}, headers=ADMIN)).json()
    key = {"Authorization": f"Bearer {session['api_key']}"}
    history = [{"role": "user", "content": "hi"}]
    first = await client.post("/v1/chat/completions", json={"model": "m", "messages": history}, headers=key)
    history += [first.json()["choices"][0]["message"], {"role": "user", "content": "more"}]
    whole = {**key, "x-turnstile-prompt-ids": "whole"}
    second = await client.post(
        "/v1/chat/completions", json={"model": "m", "messages": history}, headers=whole
    )
    turns = [r.event for r in await store.read_all() if isinstance(r.event, TurnCompleted)]
    assert "prompt_token_ids" not in first.json()["turnstile"]
    assert first.json()["turnstile"]["added_prompt_token_ids"] == turns[0].prompt_token_ids
    extra = second.json()["turnstile"]
    assert extra["parent_turn_id"] == str(turns[0].turn_id)
    assert extra["prompt_token_ids"] == [*turns[0].prompt_token_ids, *turns[0].completion_token_ids, 104]
    assert second.json()["usage"]["prompt_tokens"] == len(extra["prompt_token_ids"])


async def test_a_call_in_flight_when_its_session_is_closed_gets_409_and_so_does_its_retry() -> None:
    llm = QueueLLMClient()
    app = create_gateway(InMemoryStore(), llm, admin_key="admin-key", policy_default="main")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as client:
        session = (await client.post("/admin/sessions", json={}, headers=ADMIN)).json()
        key = {"Authorization": f"Bearer {session['api_key']}"}
        body = {"model": "main", "messages": [{"role": "user", "content": "hi"}]}
        call = asyncio.create_task(client.post("/v1/chat/completions", json=body, headers=key))
        await llm.next_call()  # the call is in flight: its request waits for a reply that never comes
        retry = asyncio.create_task(
            client.post("/v1/chat/completions", json=body, headers={**key, "x-stainless-retry-count": "1"})
        )
        gateway = gateway_of(app)
        entry = gateway.registry.get(session["session_id"])
        assert entry is not None
        (answer,) = entry.answers.values()  # the call, by its body (no Idempotency-Key)
        await wait_until(lambda: len(answer.listeners) == 2, 10, "the retry to join the call")
        await gateway.registry.close(session["session_id"], cancel=True)
        for reply in await asyncio.gather(call, retry):
            assert reply.status_code == 409
            assert "closed while this call was in flight" in reply.json()["error"]["message"]
        assert not entry.calls
        assert not entry.answers  # the cancelled call is forgotten: a retry now runs again


_TEXT = st.text(
    st.sampled_from(["a", "é", "\x00", "\ud800", "\udfff", "\U0001f600", "\\", "u", '"']), max_size=6
)


@settings(max_examples=400, deadline=None)
@given(
    value=st.recursive(
        _TEXT,
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_TEXT, inner, max_size=3),
        max_leaves=8,
    ),
    ascii_only=st.booleans(),
    encoding=st.sampled_from(["utf-8", "utf-16", "utf-32"]),
)
def test_a_body_is_refused_exactly_when_a_string_of_it_cannot_be_stored(
    value: object, ascii_only: bool, encoding: str
) -> None:
    """The quick look at the raw bytes (``parse_json``) agrees with the walk over every string."""
    raw = json.dumps({"v": value}, ensure_ascii=ascii_only).encode(encoding, "surrogatepass")
    if _storable(json.loads(raw)):
        assert parse_json(raw) == json.loads(raw)
    else:
        with pytest.raises(GatewayError, match=r"NUL character|lone surrogate") as refused:
            parse_json(raw)
        assert refused.value.status == 400
