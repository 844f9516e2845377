"""Capturing what the pinned agent CLIs send: the exact request bodies, as fixtures the main suite replays.

A gateway app (real log, real inference consumer over NATS) is served behind ``Recorder``, an ASGI wrapper
that keeps each model call's route, the headers that decide how a call is taken, and its body as the CLI
sent it, and lets one call through at a time (a CLI's concurrent side calls then land in the log in the
order they were recorded, so the n-th recorded call is the n-th turn). The policy is a ``Script`` answered
by ``RuleBackend`` (text and hermes tool calls, made-up token ids: the CLIs only need replies that make
them do something). ``fixture_of`` pairs each call with the turn it recorded: the reply the policy gave
(text, reasoning, tool calls with the ids the gateway handed out, which later bodies send back), and
writes a recorded turn's id where a body holds it as ``@turn<N>@`` (``previous_response_id``, Responses
item ids), which the replay puts back as the replayed turn's id.

Re-capture: ``TURNSTILE_RECAPTURE=1 pytest -m agent_cli tests/e2e/test_cli_captures.py`` (docs/lineages.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from consumers.inference import InferenceConfig
from pipeline.gateway import create_gateway, serving_http
from pipeline.inference.client import NatsLLMClient
from pipeline.inference.script import Script
from pipeline.log import EventStore
from schemas import LLMRequest, TurnCompleted
from tests.support.backends import RuleBackend
from tests.support.serving import serving

CLI_CAPTURES = Path(__file__).parent / "fixtures" / "cli_captures"
MODEL_ROUTES = ("/v1/messages", "/v1/chat/completions", "/v1/responses")
"""The routes whose calls record a turn (``count_tokens`` records nothing and is not kept)."""
KEPT_HEADERS = ("x-stainless-retry-count", "idempotency-key", "x-turnstile-train")
"""The headers that change how the gateway takes a call; the rest (keys, user agents) are left out."""

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


@dataclass
class Recorder:
    """ASGI wrapper around the gateway: records each model call and serves one at a time."""

    app: Any
    calls: list[dict[str, Any]] = field(default_factory=list)
    _one_at_a_time: asyncio.Lock = field(default_factory=asyncio.Lock)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "").replace("/v1/v1/", "/v1/")
        if scope["type"] != "http" or path not in MODEL_ROUTES:
            await self.app(scope, receive, send)
            return
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        body = b"".join(chunks)
        headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
        query = scope.get("query_string", b"").decode()
        call: dict[str, Any] = {
            "route": scope["path"] + (f"?{query}" if query else ""),
            "headers": {name: headers[name] for name in KEPT_HEADERS if name in headers},
            "body": json.loads(body),
        }
        status: list[int] = []

        async def replay_body() -> MutableMapping[str, Any]:
            return {"type": "http.request", "body": body, "more_body": False}

        async def watch(message: MutableMapping[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        async with self._one_at_a_time:  # the n-th recorded call is the n-th turn appended
            await self.app(scope, replay_body, watch)
        if status == [200]:
            self.calls.append(call)


def script_rule(script: Script) -> Callable[[LLMRequest], str]:
    """The text of the first rule that holds (hermes tool calls in it); none: a refusal naming the call."""

    def rule(request: LLMRequest) -> str:
        matched = script.match(request)
        if matched is None:
            raise ValueError(f"no rule of the capture script holds for {request.messages[-1].content!r:.200}")
        return matched.reply.text()

    return rule


@dataclass
class CaptureGateway:
    url: str
    """The gateway's base URL, without /v1."""
    admin: httpx.AsyncClient
    recorder: Recorder
    store: EventStore

    async def session(self, **spec: Any) -> dict[str, Any]:
        created = await self.admin.post("/admin/sessions", json=spec)
        assert created.status_code == 201, created.text
        body: dict[str, Any] = created.json()
        return body

    async def fixture(self, session_id: str, **extra: Any) -> dict[str, Any]:
        """What was recorded of ``session_id`` as a fixture (its calls and their replies), plus ``extra``."""
        turns = await session_turns(self.store, session_id)
        return fixture_of(self.recorder.calls, turns) | extra


@contextlib.asynccontextmanager
async def capture_gateway(nats_url: str, store: EventStore, script: Script) -> AsyncIterator[CaptureGateway]:
    """A recording gateway on a free port, for a policy of its own answered by ``script``."""
    policy = f"capture-{uuid.uuid4().hex[:8]}"
    admin_key = "admin-" + uuid.uuid4().hex
    config = InferenceConfig(nats_url, policy, backend="scripted", heartbeat_interval=0.5)
    async with serving(config, RuleBackend(script_rule(script))):
        llm = await NatsLLMClient.connect(nats_url, heartbeat_timeout=5.0, wait_for_consumer=10.0)
        try:
            app = create_gateway(store, llm, admin_key=admin_key, policy_default=policy, gone_after=None)
            recorder = Recorder(app)
            headers = {"Authorization": f"Bearer {admin_key}"}
            async with (
                serving_http(recorder) as url,
                httpx.AsyncClient(base_url=url, headers=headers, timeout=60) as admin,
            ):
                yield CaptureGateway(url, admin, recorder, store)
        finally:
            await llm.close()


async def session_turns(store: EventStore, session_id: str) -> list[TurnCompleted]:
    records = await store.read_stream(f"episode-{session_id}")
    return [r.event for r in records if isinstance(r.event, TurnCompleted)]


def reply_of(turn: TurnCompleted) -> dict[str, Any]:
    """A recorded turn's reply as a fixture holds it: text, reasoning and tool calls with their ids."""
    reply: dict[str, Any] = {"text": turn.reply.text or ""}
    if turn.reply.reasoning:
        reply["reasoning"] = turn.reply.reasoning
    calls = [
        {"id": call.id, "name": call.function.name, "arguments": call.function.arguments}
        for call in turn.reply.tool_calls
    ]
    return reply | ({"tool_calls": calls} if calls else {})


def fixture_of(calls: list[dict[str, Any]], turns: list[TurnCompleted]) -> dict[str, Any]:
    """Each recorded call with the reply of the turn it recorded; a recorded turn's id in a body as
    ``@turn<N>@``."""
    assert len(calls) == len(turns), (
        f"{len(calls)} calls recorded, {len(turns)} turns: a call recorded no turn"
    )
    hexes = {turn.turn_id.hex: index for index, turn in enumerate(turns)}
    kept = []
    for call, turn in zip(calls, turns, strict=True):
        text = json.dumps(call["body"], ensure_ascii=False)
        for turn_hex, index in hexes.items():
            text = text.replace(turn_hex, f"@turn{index}@")
        kept.append({**call, "body": json.loads(text), "reply": reply_of(turn)})
    return {"calls": kept}


def write_fixture(name: str, captured: dict[str, Any]) -> Path:
    path = CLI_CAPTURES / f"{name}.json"
    path.write_text(json.dumps(captured, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return path
