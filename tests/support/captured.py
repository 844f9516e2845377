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
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from pipeline.gateway import create_gateway
from pipeline.inference.backends import Generation
from pipeline.log import InMemoryStore, Store
from pipeline.materialize import MaterializerConfig, TurnLineage, lineages_of_records
from schemas import FunctionCall, LLMRequest, LLMResponse, ToolCall, TurnCompleted
from tests.support.backends import prompt_ids, text_ids

FIXTURES = Path(__file__).parent / "fixtures" / "captured"
ADMIN = {"Authorization": "Bearer admin-key"}


def fixture(name: str) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((FIXTURES / f"{name}.json").read_text(encoding="utf-8"))
    return loaded


def tool_call(spec: dict[str, Any]) -> ToolCall:
    arguments = spec["arguments"]
    text = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return ToolCall(id=spec["id"], function=FunctionCall(name=spec["name"], arguments=text))


def scripted_reply(reply: dict[str, Any]) -> tuple[str, list[ToolCall], list[int]]:
    """A fixture's reply: its text, its tool calls (with the ids the engine minted) and made-up completion
    ids ending on the end token."""
    calls = [tool_call(spec) for spec in reply.get("tool_calls", [])]
    text = reply.get("text", "")
    return text, calls, [*text_ids(text + json.dumps([c.model_dump() for c in calls])), 2]


@dataclass
class ScriptedLLM:
    """An in-process LLM client answering each request with the next reply of ``replies`` (text, reasoning
    and tool calls), with token ids as an engine would give them: the prefix's exact ids, then made-up ids
    for the new messages (``tests.support.backends.prompt_ids``)."""

    replies: list[dict[str, Any]]
    requests: list[LLMRequest] = field(default_factory=list)

    async def __call__(self, request: LLMRequest) -> LLMResponse:
        self.requests.append(request)
        reply = self.replies.pop(0)
        text, calls, completion = scripted_reply(reply)
        return LLMResponse(
            request_id=request.request_id,
            text=text,
            tool_calls=calls,
            reasoning=reply.get("reasoning"),
            finish_reason="tool_calls" if calls else "stop",
            prompt_token_ids=prompt_ids(request),
            completion_token_ids=completion,
            completion_logprobs=[-0.5] * len(completion),
            policy_version=1,
            consumer_id="scripted",
        )


@dataclass
class FixtureBackend:
    """The same replies from behind a real inference consumer (over NATS): each request gets the next."""

    replies: list[dict[str, Any]]
    policy_version: int = 0

    async def generate(self, request: LLMRequest) -> Generation:
        reply = self.replies.pop(0)
        text, calls, completion = scripted_reply(reply)
        return Generation(
            prompt_token_ids=prompt_ids(request),
            completion_token_ids=completion,
            completion_logprobs=[-0.5] * len(completion),
            text=text,
            finish_reason="stop",
            policy_version=self.policy_version,
            tool_calls=calls,
            reasoning=reply.get("reasoning"),
        )

    async def load_version(self, version: int, checkpoint: str) -> None:
        self.policy_version = version

    async def close(self) -> None:
        pass


@dataclass
class Replayed:
    turns: list[TurnCompleted]
    lineages: list[TurnLineage]
    statuses: list[int]

    def groups(self) -> list[list[int]]:
        return expected(self.lineages)["lineages"]

    def reasons(self) -> list[str | None]:
        return expected(self.lineages)["reasons"]

    def trained(self) -> list[bool]:
        return expected(self.lineages)["trained"]


def expected(lineages: list[TurnLineage]) -> dict[str, Any]:
    """The lineage report as a fixture's ``expect`` holds it: the lineages as lists of turn indexes (first
    root first), and per turn why its root started (None: not a root) and whether it is trained."""
    ordered = sorted(lineages, key=lambda turn: turn.index)
    found: dict[str, list[int]] = {}
    for turn in ordered:
        found.setdefault(turn.lineage, []).append(turn.index)
    return {
        "lineages": list(found.values()),
        "reasons": [turn.root_reason for turn in ordered],
        "trained": [turn.trained for turn in ordered],
    }


async def replay(captured: dict[str, Any], config: MaterializerConfig | None = None) -> Replayed:
    """Send the fixture's calls through a gateway in order, end the session, and report its lineages."""
    store = InMemoryStore()
    llm = ScriptedLLM([call["reply"] for call in captured["calls"]])
    app = create_gateway(store, llm, admin_key="admin-key", policy_default="main")
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
        created = await client.post("/admin/sessions", json=captured.get("session", {}), headers=ADMIN)
        assert created.status_code == 201, created.text
        session = created.json()
        statuses = await send_calls(client, store, session, captured["calls"])
    records = await store.read_stream(f"episode-{session['session_id']}")
    turns = [r.event for r in records if isinstance(r.event, TurnCompleted)]
    return Replayed(turns, lineages_of_records(records, config or MaterializerConfig()), statuses)


async def send_calls(
    client: httpx.AsyncClient, store: Store, session: dict[str, Any], calls: list[dict[str, Any]]
) -> list[int]:
    """Post ``calls`` in order with the session's key (each must answer 200), then end the session."""
    key = {"Authorization": f"Bearer {session['api_key']}", "x-api-key": session["api_key"]}
    statuses = []
    for call in calls:
        headers = {**key, **call.get("headers", {})}
        body = await with_turn_ids(call["body"], store, session["session_id"])
        answered = await client.post(call["route"], json=body, headers=headers)
        statuses.append(answered.status_code)
        assert answered.status_code == 200, (call["route"], answered.text)
    ended = await client.post("/v1/session/end", json={}, headers=key)
    assert ended.status_code == 200, ended.text
    return statuses


TURN_ID = re.compile(r"@turn(\d+)@")
"""Where a fixture's body holds a recorded turn's id (hex): ``previous_response_id``, Responses item ids."""


async def with_turn_ids(body: dict[str, Any], store: Store, session_id: str) -> dict[str, Any]:
    """``body`` with each ``@turn<N>@`` written as the id (hex) of the session's N-th turn."""
    text = json.dumps(body, ensure_ascii=False)
    if not TURN_ID.search(text):
        return body
    records = await store.read_stream(f"episode-{session_id}")
    turns = [r.event for r in records if isinstance(r.event, TurnCompleted)]
    replaced: dict[str, Any] = json.loads(TURN_ID.sub(lambda m: turns[int(m.group(1))].turn_id.hex, text))
    return replaced
