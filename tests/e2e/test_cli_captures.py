"""The pinned agent CLIs' own request bodies, captured (``tests/support/cli_capture.py``) on sessions that
exercise what real clients send back changed: Claude Code's Write, Edit and MultiEdit (sent back with the
schema's defaults filled in), its system reminders and a subagent; opencode's title call and ``--continue``;
Codex and ``codex exec resume``. Each captured session must show one lineage per conversation and the
expected side lineages. With ``TURNSTILE_RECAPTURE=1`` the captures replace the fixtures in
``tests/support/fixtures/cli_captures`` that the main suite replays
(``tests/integration/test_cli_replays.py``).
Marker ``agent_cli``: run by its own step in .ci/run.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from pipeline.inference.script import Script
from pipeline.log import EventStore
from pipeline.materialize import MaterializerConfig, lineages_of_records
from tests.conftest import Servers
from tests.e2e.test_agent_claude_code import CLAUDE_ENV
from tests.e2e.test_agent_codex import CODEX_FLAGS, codex_config
from tests.e2e.test_agent_opencode import OPENCODE_OFFLINE, opencode_config
from tests.support.agent_gateway import CLIS, FOLLOW_UP, PROMPT, cli_binary, offline_env, run_cli
from tests.support.captured import expected
from tests.support.cli_capture import CLI_CAPTURES, CaptureGateway, capture_gateway, write_fixture

pytestmark = pytest.mark.agent_cli

NOTES = "notes.txt"
CLAUDE_PROMPT = (
    f"Write {NOTES} with four lines, alpha to delta, edit it, then have a subagent check it. "
    "Use the Write and Edit tools."
)


def claude_script(work: Path) -> Script:
    """Write a file, Edit it (no ``replace_all``: Claude Code adds its default), show it with Bash, have a
    subagent (Agent, haiku) Read it, then answer. (The pinned version offers no MultiEdit.)"""
    path = str(work / NOTES)
    agent = {
        "description": "Check the notes",
        "prompt": "SUBAGENT-TASK: read notes.txt and say what it holds.",
        "subagent_type": "general-purpose",
        "model": "haiku",
        "run_in_background": False,
    }
    edit = {"file_path": path, "old_string": "alpha", "new_string": "ALPHA"}
    rules: list[dict[str, Any]] = [
        {
            "when": {"contains": "SUBAGENT-TASK"},
            "reply": {"tool_calls": [{"name": "Read", "arguments": {"file_path": path}}]},
        },
        {"when": {"contains": "1\tALPHA"}, "reply": {"content": "SUBAGENT-DONE: it holds ALPHA to delta."}},
        {"when": {"contains": "SUBAGENT-DONE"}, "reply": {"content": "The notes are written and checked."}},
        {
            "when": {"tool": "Write", "tool_result": False},
            "reply": {
                "content": "I will write the notes.",
                "tool_calls": [{"name": "Write", "arguments": {"file_path": path, "content": CONTENT}}],
            },
        },
        {
            "when": {"contains": "created successfully"},
            "reply": {"tool_calls": [{"name": "Edit", "arguments": edit}]},
        },
        {
            "when": {"contains": "updated successfully"},
            "reply": {
                "tool_calls": [
                    {
                        "name": "Bash",
                        "arguments": {"command": f"cat {NOTES}", "description": "Show the notes"},
                    }
                ]
            },
        },
        {
            "when": {"contains": "ALPHA"},
            "reply": {
                "content": "A subagent checks it.",
                "tool_calls": [{"name": "Agent", "arguments": agent}],
            },
        },
    ]
    return Script.model_validate({"rules": rules})


CONTENT = "alpha\nbeta\ngamma\ndelta\n"


async def run_claude(gateway: CaptureGateway, api_key: str, home: Path, work: Path) -> None:
    env = offline_env(
        home,
        CLAUDE_CONFIG_DIR=str(home / ".claude"),
        ANTHROPIC_BASE_URL=gateway.url,
        ANTHROPIC_API_KEY=api_key,
        **CLAUDE_ENV,
    )
    flags = ["--allowedTools", "Write", "Edit", "Bash", "Agent", "Read", "--max-turns", "10"]
    finished = await run_cli([str(cli_binary("claude")), "-p", CLAUDE_PROMPT, *flags], cwd=work, env=env)
    assert finished.returncode == 0, finished


async def test_claude_code_edits_reminders_and_a_subagent(
    servers: Servers, store: EventStore, tmp_path: Path
) -> None:
    """Edit comes back with ``"replace_all": false``, the first call's system message (blocks) comes back as
    a string, the subagent's second call carries a system message at its end: still one lineage for the
    main loop and one for the subagent (a side call: another model), which is not trained."""
    cli_binary("claude")
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    async with capture_gateway(servers.nats_url, store, claude_script(work)) as gateway:
        session = await gateway.session()
        await run_claude(gateway, session["api_key"], home, work)
        captured = await captured_session(gateway, session["session_id"])
    assert (work / NOTES).read_text() == "ALPHA\nbeta\ngamma\ndelta\n"
    sent_back = [
        block["input"]
        for block in captured["calls"][-1]["body"]["messages"][4]["content"]
        if "input" in block
    ]
    assert sent_back == [
        {**json.loads(captured["calls"][1]["reply"]["tool_calls"][0]["arguments"]), "replace_all": False}
    ]
    assert captured["expect"] == {
        "lineages": [[0, 1, 2, 3, 6], [4, 5]],
        "reasons": ["first call", None, None, None, "side call", None, None],
        "trained": [True, True, True, True, False, False, True],
    }
    keep("claude_code_edits", captured)


OPENCODE_SCRIPT = CLIS / "opencode.script.json"
CODEX_SCRIPT = CLIS / "codex.script.json"


async def test_opencode_title_call_and_continue(servers: Servers, store: EventStore, tmp_path: Path) -> None:
    """The title call (no tools) is a side lineage, not trained; ``--continue`` extends the main lineage."""
    opencode = str(cli_binary("opencode"))
    work = tmp_path / "work"
    work.mkdir()
    async with capture_gateway(servers.nats_url, store, Script.load(OPENCODE_SCRIPT)) as gateway:
        session = await gateway.session()
        env = offline_env(tmp_path / "home", TURNSTILE_SESSION_KEY=session["api_key"], **OPENCODE_OFFLINE)
        config = Path(env["XDG_CONFIG_HOME"]) / "opencode" / "opencode.json"
        config.parent.mkdir(parents=True)
        config.write_text(json.dumps(opencode_config(f"{gateway.url}/v1"), indent=2))
        for argv in (["run", PROMPT], ["run", "--continue", FOLLOW_UP]):
            finished = await run_cli([opencode, *argv], cwd=work, env=env)
            assert finished.returncode == 0, finished
        captured = await captured_session(gateway, session["session_id"])
    titles = [i for i, call in enumerate(captured["calls"]) if not call["body"].get("tools")]
    assert len(titles) == 1
    main = [i for i in range(len(captured["calls"])) if i not in titles]
    assert sorted(captured["expect"]["lineages"]) == sorted([main, titles])
    assert [captured["expect"]["trained"][i] for i in titles] == [False]
    assert all(captured["expect"]["trained"][i] for i in main)
    keep("opencode_title", captured)


async def test_codex_exec_and_resume(servers: Servers, store: EventStore, tmp_path: Path) -> None:
    """``codex exec resume --last`` sends the thread again (its reasoning as ``encrypted_content``): one
    lineage."""
    codex = str(cli_binary("codex"))
    codex_home, work = tmp_path / "codex", tmp_path / "work"
    codex_home.mkdir()
    work.mkdir()
    async with capture_gateway(servers.nats_url, store, Script.load(CODEX_SCRIPT)) as gateway:
        session = await gateway.session()
        (codex_home / "config.toml").write_text(codex_config(f"{gateway.url}/v1"))
        env = offline_env(
            tmp_path / "home", CODEX_HOME=str(codex_home), TURNSTILE_SESSION_KEY=session["api_key"]
        )
        for argv in (["exec", *CODEX_FLAGS, PROMPT], ["exec", "resume", "--last", *CODEX_FLAGS, FOLLOW_UP]):
            finished = await run_cli([codex, *argv], cwd=work, env=env)
            assert finished.returncode == 0, finished
        captured = await captured_session(gateway, session["session_id"])
    assert captured["expect"] == {
        "lineages": [[0, 1, 2]],
        "reasons": ["first call", None, None],
        "trained": [True, True, True],
    }
    keep("codex_resume", captured)


async def captured_session(gateway: CaptureGateway, session_id: str) -> dict[str, Any]:
    """The session's calls and replies, and what the lineage report made of them live (``expect``)."""
    ended = await gateway.admin.post(f"/admin/sessions/{session_id}/end", json={})
    assert ended.status_code == 200, ended.text
    records = await gateway.store.read_stream(f"episode-{session_id}")
    expect = expected(lineages_of_records(records, MaterializerConfig()))
    return await gateway.fixture(session_id, expect=expect)


def keep(name: str, captured: dict[str, Any]) -> None:
    """Write the capture as the fixture ``name`` when asked to (``TURNSTILE_RECAPTURE=1``); otherwise check
    that the stored fixture still stands for what the pinned CLI sends: the same calls (routes, models,
    whether tools are offered) and the same lineages."""
    if os.environ.get("TURNSTILE_RECAPTURE") == "1":
        write_fixture(name, captured)
        return
    stored = json.loads((CLI_CAPTURES / f"{name}.json").read_text(encoding="utf-8"))
    assert shape(stored) == shape(captured), f"re-capture {name}: TURNSTILE_RECAPTURE=1 (docs/lineages.md)"
    assert stored["expect"] == captured["expect"]


def shape(captured: dict[str, Any]) -> list[tuple[str, str | None, bool]]:
    return [(c["route"], c["body"].get("model"), bool(c["body"].get("tools"))) for c in captured["calls"]]
