"""Delivered means delivered: a gateway turn is delivered only when its reply was handed to a live
connection after the turn was recorded; a reply whose client had gone is no sample, a retry that gets it
marks it delivered then, and a session whose client is gone ends ``aborted`` soon after."""

from __future__ import annotations

import json
from typing import Any

import httpx

from pipeline.gateway import create_gateway, gateway_of
from pipeline.log import InMemoryStore
from pipeline.materialize import MaterializerConfig, lineages_of_records
from schemas import EpisodeFinished, TurnCompleted, TurnDelivered
from tests.support.captured import ADMIN, ScriptedLLM
from tests.support.waiting import wait_until

BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


async def gone_client_call(
    app: Any, api_key: str, body: dict[str, Any], **headers: str
) -> list[dict[str, Any]]:
    """A chat completions call whose client disconnects before the reply is ready (a timed-out SDK): what
    the app sent back to it."""
    raw = json.dumps(body).encode()
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
        "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions", "root_path": "",
        "query_string": b"",
        "server": ("gateway", 80), "client": ("127.0.0.1", 5000),
        "headers": [(b"authorization", f"Bearer {api_key}".encode()), (b"content-type", b"application/json"),
                    *[(k.encode(), v.encode()) for k, v in headers.items()]],
    }  # fmt: skip
    messages = [{"type": "http.request", "body": raw, "more_body": False}]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app(scope, receive, send)
    return sent


async def test_a_reply_whose_client_had_gone_is_not_delivered_until_a_retry_gets_it() -> None:
    store = InMemoryStore()
    app = create_gateway(store, ScriptedLLM([{"text": "hello"}]), admin_key="admin-key", policy_default="p")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as client:
        session = (await client.post("/admin/sessions", json={}, headers=ADMIN)).json()
        key = session["api_key"]
        sent = await gone_client_call(app, key, BODY, **{"x-stainless-retry-count": "0"})
        assert sent == []  # nothing was handed to a closed connection
        entry = gateway_of(app).registry.get(session["session_id"])
        assert entry is not None
        assert entry.disconnected_at is not None
        # the SDK retries: the recorded reply, not a new turn, and now it reached the client
        retry = await client.post(
            "/v1/chat/completions",
            content=json.dumps(BODY).encode(),  # the same bytes: a retry is known by its body
            headers={
                "Authorization": f"Bearer {key}",
                "content-type": "application/json",
                "x-stainless-retry-count": "1",
            },
        )
        assert retry.status_code == 200
        assert retry.json()["choices"][0]["message"]["content"] == "hello"
        assert entry.disconnected_at is None
        ended = await client.post("/v1/session/end", json={}, headers={"Authorization": f"Bearer {key}"})
        assert ended.status_code == 200
    records = await store.read_stream(f"episode-{session['session_id']}")
    events = [r.event for r in records]
    turns = [e for e in events if isinstance(e, TurnCompleted)]
    assert len(turns) == 1
    assert turns[0].delivered is False  # recorded before it was handed over
    delivered = [e for e in events if isinstance(e, TurnDelivered)]
    assert [d.turn_ids for d in delivered] == [[turns[0].turn_id]]
    assert isinstance(events[-1], EpisodeFinished)
    (report,) = lineages_of_records(records, MaterializerConfig())
    assert (report.delivered, report.trained) == (True, True)


async def test_a_session_whose_client_is_gone_ends_aborted_and_its_undelivered_turn_is_no_sample() -> None:
    store = InMemoryStore()
    llm = ScriptedLLM([{"text": "hello"}])
    app = create_gateway(store, llm, admin_key="admin-key", policy_default="p", gone_after=0.2)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as client:
        session = (await client.post("/admin/sessions", json={}, headers=ADMIN)).json()
    gateway = gateway_of(app)
    assert await gateway.reap_gone() == []  # no client went away yet
    await gone_client_call(app, session["api_key"], BODY)

    async def reaped() -> bool:
        return session["session_id"] in await gateway.reap_gone()

    await wait_until(reaped, 30.0, "the session to end after its client went away")
    records = await store.read_stream(f"episode-{session['session_id']}")
    finished = records[-1].event
    assert isinstance(finished, EpisodeFinished)
    assert finished.termination == "aborted"
    assert "went away" in (finished.error or "")
    assert not any(isinstance(r.event, TurnDelivered) for r in records)
    (report,) = lineages_of_records(records, MaterializerConfig())
    assert (report.delivered, report.trained, report.why_not) == (False, False, "not delivered")
