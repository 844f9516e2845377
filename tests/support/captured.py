"""Captured request sequences of the agent CLIs, replayed through the gateway (no servers: the gateway app
over an in-memory store, with a scripted LLM client that answers each call with the reply the fixture
recorded for it), and the lineage report the materializer's rule makes of what was recorded.

A fixture (``tests/support/fixtures/captured/<name>.json``) holds what a CLI sent, call by call, modelled on
what the pinned CLIs send (``tests/e2e/test_agent_*.py``, ``docs/agent-clis.md``): the route, the body (as
the CLI sends it back: schema defaults filled in, keys reordered, arguments re-serialized, system messages
mid-conversation) and the reply the policy gave (text and tool calls, with the ids the engine minted, which
later bodies send back), and what the lineage report must show (``expect``).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from pipeline.gateway import create_gateway
from pipeline.log import InMemoryStore
from pipeline.materialize import MaterializerConfig, TurnLineage, lineages_of_records
from schemas import FunctionCall, LLMRequest, LLMResponse, ToolCall, TurnCompleted

FIXTURES = Path(__file__).parent / "fixtures" / "captured"
ADMIN = {"Authorization": "Bearer admin-key"}


def fixture(name: str) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((FIXTURES / f"{name}.json").read_text(encoding="utf-8"))
    return loaded


def tool_call(spec: dict[str, Any]) -> ToolCall:
    arguments = spec["arguments"]
    text = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return ToolCall(id=spec["id"], function=FunctionCall(name=spec["name"], arguments=text))


def _ids(text: str) -> list[int]:
    return [3 + byte % 990 for byte in text.encode()] or [3]


@dataclass
class ScriptedLLM:
    """An in-process LLM client answering each request with the next reply of ``replies`` (text and tool
    calls), with token ids as an engine would give them: the prefix's exact ids, then made-up ids for the
    new messages (as ``tests.support.backends.PrefixEcho``)."""

    replies: list[dict[str, Any]]
    requests: list[LLMRequest] = field(default_factory=list)

    async def __call__(self, request: LLMRequest) -> LLMResponse:
        self.requests.append(request)
        reply = self.replies.pop(0)
        prefix = list(request.prefix.ids) if request.prefix else []
        skipped = request.prefix.message_count if request.prefix else 0
        new = [i for m in request.messages[skipped:] for i in (1, *_ids(m.content or m.role), 2)]
        calls = [tool_call(spec) for spec in reply.get("tool_calls", [])]
        text = reply.get("text", "")
        completion = [*_ids(text + json.dumps([c.model_dump() for c in calls])), 2]
        return LLMResponse(
            request_id=request.request_id,
            text=text,
            tool_calls=calls,
            finish_reason="tool_calls" if calls else "stop",
            prompt_token_ids=prefix + new,
            completion_token_ids=completion,
            completion_logprobs=[-0.5] * len(completion),
            policy_version=1,
            consumer_id="scripted",
        )


@dataclass
class Replayed:
    turns: list[TurnCompleted]
    lineages: list[TurnLineage]
    statuses: list[int]

    def groups(self) -> list[list[int]]:
        """The lineages as lists of turn indexes, first root first."""
        found: dict[str, list[int]] = {}
        for turn in sorted(self.lineages, key=lambda turn: turn.index):
            found.setdefault(turn.lineage, []).append(turn.index)
        return list(found.values())

    def reasons(self) -> list[str | None]:
        return [turn.root_reason for turn in sorted(self.lineages, key=lambda turn: turn.index)]

    def trained(self) -> list[bool]:
        return [turn.trained for turn in sorted(self.lineages, key=lambda turn: turn.index)]


async def replay(captured: dict[str, Any], config: MaterializerConfig | None = None) -> Replayed:
    """Send the fixture's calls through a gateway in order, end the session, and report its lineages."""
    store = InMemoryStore()
    llm = ScriptedLLM([call["reply"] for call in captured["calls"]])
    app = create_gateway(store, llm, admin_key="admin-key", policy_default="main")
    statuses = []
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
        spec = captured.get("session", {})
        created = await client.post("/admin/sessions", json=spec, headers=ADMIN)
        assert created.status_code == 201, created.text
        session = created.json()
        key = {"Authorization": f"Bearer {session['api_key']}", "x-api-key": session["api_key"]}
        for call in captured["calls"]:
            headers = {**key, **call.get("headers", {})}
            body = _with_previous(call["body"], store, session["session_id"])
            answered = await client.post(call["route"], json=await body, headers=headers)
            statuses.append(answered.status_code)
            assert answered.status_code == 200, (call["route"], answered.text)
        ended = await client.post("/v1/session/end", json={}, headers=key)
        assert ended.status_code == 200, ended.text
    records = await store.read_stream(f"episode-{session['session_id']}")
    turns = [r.event for r in records if isinstance(r.event, TurnCompleted)]
    return Replayed(turns, lineages_of_records(records, config or MaterializerConfig()), statuses)


async def _with_previous(body: dict[str, Any], store: InMemoryStore, session_id: str) -> dict[str, Any]:
    """``previous_response_id`` given as ``"turn:<index>"`` becomes that recorded turn's response id."""
    previous = body.get("previous_response_id")
    if not (isinstance(previous, str) and previous.startswith("turn:")):
        return body
    records = await store.read_stream(f"episode-{session_id}")
    turns = [r.event for r in records if isinstance(r.event, TurnCompleted)]
    turn_id: uuid.UUID = turns[int(previous.removeprefix("turn:"))].turn_id
    return {**body, "previous_response_id": f"resp_{turn_id.hex}"}
