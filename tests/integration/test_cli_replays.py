"""The pinned agent CLIs' own requests, replayed: one lineage per conversation, side lineages apart.

``tests/support/fixtures/cli_captures`` holds what Claude Code, opencode and Codex sent, call by call, as
captured by ``tests/e2e/test_cli_captures.py`` (marker ``agent_cli``, the only step that needs the CLIs; it
re-captures them with ``TURNSTILE_RECAPTURE=1``). Here each capture goes through a real gateway over HTTP,
recording into the real PostgreSQL log, its calls answered by a real inference consumer over NATS with the
reply the capture holds for each (the tool-call ids the CLI sent back included). The lineage report
(``turnstile episodes --lineages --json``) must show what the live session showed: each conversation one
lineage whose turns continue each other, the side calls (opencode's title, Claude Code's subagent on
another model) lineages of their own and not trained, no edit and no template break.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from typing import Any

import httpx
import pytest

from consumers.inference import InferenceConfig
from pipeline.gateway import create_gateway, serving_http
from pipeline.inference.client import NatsLLMClient
from pipeline.log import EventStore
from tests.conftest import Servers
from tests.support.captured import FixtureBackend, send_calls
from tests.support.cli_capture import CLI_CAPTURES
from tests.support.serving import serving

ADMIN_KEY = "admin-" + uuid.uuid4().hex
CAPTURES = sorted(path.stem for path in CLI_CAPTURES.glob("*.json"))


def lineage_report(database_url: str) -> dict[str, Any]:
    """The newest episode as ``turnstile episodes --lineages --json`` prints it."""
    env = {"PATH": "/usr/bin:/bin", "TURNSTILE_DATABASE_URL": database_url}
    listed = subprocess.run(
        [sys.executable, "-m", "consumers.cli", "episodes", "--lineages", "--json", "--limit", "1"],
        capture_output=True, text=True, env=env, timeout=180,
    )  # fmt: skip
    assert listed.returncode == 0, listed.stderr
    (row,) = json.loads(listed.stdout)
    assert isinstance(row, dict)
    return row


def as_expected(lineages: list[dict[str, Any]]) -> dict[str, Any]:
    """The report's lineages in the form of a capture's ``expect`` (``tests.support.captured.expected``)."""
    turns = sorted(
        ((turn, lineage["started_because"] if i == 0 else None) for lineage in lineages
         for i, turn in enumerate(lineage["turns"])),
        key=lambda pair: pair[0]["index"],
    )  # fmt: skip
    return {
        "lineages": [[turn["index"] for turn in lineage["turns"]] for lineage in lineages],
        "reasons": [reason for _, reason in turns],
        "trained": [turn["trained"] for turn, _ in turns],
    }


async def replay_through_gateway(captured: dict[str, Any], servers: Servers, store: EventStore) -> str:
    """Send the capture's calls through a gateway on a free port; the session's id."""
    policy = f"replay-{uuid.uuid4().hex[:8]}"
    config = InferenceConfig(servers.nats_url, policy, backend="scripted", heartbeat_interval=0.5)
    async with serving(config, FixtureBackend([call["reply"] for call in captured["calls"]])):
        llm = await NatsLLMClient.connect(servers.nats_url, heartbeat_timeout=5.0, wait_for_consumer=10.0)
        try:
            app = create_gateway(store, llm, admin_key=ADMIN_KEY, policy_default=policy)
            admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
            async with serving_http(app) as url, httpx.AsyncClient(base_url=url, timeout=120) as client:
                created = await client.post(
                    "/admin/sessions", json=captured.get("session", {}), headers=admin
                )
                assert created.status_code == 201, created.text
                session: dict[str, Any] = created.json()
                await send_calls(client, store, session, captured["calls"])
        finally:
            await llm.close()
    return str(session["session_id"])


def test_every_capture_is_there() -> None:
    assert CAPTURES == ["claude_code_edits", "codex_resume", "opencode_title"]


@pytest.mark.parametrize("name", CAPTURES)
async def test_a_captured_cli_session_replays_as_one_lineage_per_conversation(
    name: str, servers: Servers, store: EventStore, database_url: str
) -> None:
    captured = json.loads((CLI_CAPTURES / f"{name}.json").read_text(encoding="utf-8"))
    session_id = await replay_through_gateway(captured, servers, store)

    row = lineage_report(database_url)
    assert row["episode_id"] == session_id
    lineages = row["lineages"]
    assert as_expected(lineages) == captured["expect"]  # what the live session with the CLI showed
    # one lineage per conversation: the first call's, trained, each turn continuing the one before it
    [main] = [lineage for lineage in lineages if lineage["started_because"] == "first call"]
    assert all(turn["trained"] for turn in main["turns"])
    for lineage in lineages:
        turns = lineage["turns"]
        assert [turn["parent_turn_id"] for turn in turns[1:]] == [turn["turn_id"] for turn in turns[:-1]]
        assert lineage["edit"] == []
        assert all(turn["delivered"] for turn in turns)
    # the others are side calls (a title without tools, a subagent on another model): apart, not trained
    for side in lineages:
        if side is not main:
            assert side["started_because"] == "side call"
            assert not any(turn["trained"] for turn in side["turns"])


def test_the_captures_hold_what_the_clients_change_when_they_send_a_reply_back() -> None:
    """What makes these captures worth replaying: Claude Code's Edit sent back with ``"replace_all":
    false`` added and system messages in the middle of a conversation; Codex's reasoning sent back as
    ``encrypted_content``; opencode's title call offered no tools."""
    claude = json.loads((CLI_CAPTURES / "claude_code_edits.json").read_text(encoding="utf-8"))
    sent_back = [
        block["input"] for call in claude["calls"] for message in call["body"]["messages"]
        if message["role"] == "assistant" for block in message["content"] if block.get("name") == "Edit"
    ]  # fmt: skip
    assert sent_back
    assert all(edit["replace_all"] is False for edit in sent_back)
    edits = [
        c for call in claude["calls"] for c in call["reply"].get("tool_calls", []) if c["name"] == "Edit"
    ]
    assert all("replace_all" not in json.loads(call["arguments"]) for call in edits)  # the model wrote none
    roles = [[m["role"] for m in call["body"]["messages"]] for call in claude["calls"]]
    assert any("system" in r[r.index("assistant") :] for r in roles if "assistant" in r)
    codex = json.loads((CLI_CAPTURES / "codex_resume.json").read_text(encoding="utf-8"))
    items = [item for call in codex["calls"] for item in call["body"].get("input", [])]
    assert any(item.get("type") == "reasoning" and item.get("encrypted_content") for item in items)
    opencode = json.loads((CLI_CAPTURES / "opencode_title.json").read_text(encoding="utf-8"))
    assert [bool(call["body"].get("tools")) for call in opencode["calls"]].count(False) == 1
