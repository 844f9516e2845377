"""Codex CLI (``@openai/codex``, pinned in ``tests/e2e/agent_clis``), unmodified, headless through
``turnstile serve gateway`` on the long-context tiny model answering with
``tests/e2e/agent_clis/codex.script.json``.

``codex exec`` reads its provider from ``$CODEX_HOME/config.toml`` (never ``OPENAI_BASE_URL``) and speaks only
the Responses API, streamed: ``developer`` messages, function tools plus a ``namespace`` tool and
``web_search``, ``reasoning``, ``store: false``, ``include``, ``prompt_cache_key``. It runs as root in a
container with ``--dangerously-bypass-approvals-and-sandbox`` (its own sandbox needs what containers lack)
and outside a git repository with ``--skip-git-repo-check``. Offline: every proxy variable points nowhere.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pipeline.log import EventStore
from tests.conftest import Servers
from tests.support.agent_gateway import (
    CLIS,
    FOLLOW_UP,
    PROMPT,
    PROOF_FILE,
    PROOF_TEXT,
    REASONING,
    agent_gateway,
    assert_rewarded,
    assert_scripted_engine_turns,
    assert_shell_then_answer,
    cli_binary,
    main_and_side,
    offline_env,
    recorded_turns,
    run_cli,
    token_counts,
)

pytestmark = pytest.mark.agent_cli

SCRIPT = CLIS / "codex.script.json"
CODEX_SHELL_TOOL = "exec_command"
"""Codex 0.169's shell tool: ``{"cmd": "<a shell command line>"}`` (older versions: ``shell``)."""
CODEX_FLAGS = [
    "--json",
    "--strict-config",
    "--skip-git-repo-check",
    "--dangerously-bypass-approvals-and-sandbox",
]
"""Events as JSON lines (the usage of its calls), the config checked (an unknown key fails: the docs'
config stays right for the pinned version), outside a git repository, no approvals and no sandbox of its
own (as root in a container; the test's directory is the sandbox)."""


def codex_config(base_url: str) -> str:
    """``config.toml`` as the docs give it: a provider of its own, the key read from an env variable; no
    usage analytics (otherwise it resolves chatgpt.com to send them)."""
    return f"""\
model = "main"
model_provider = "turnstile"

[analytics]
enabled = false

[model_providers.turnstile]
name = "turnstile"
base_url = "{base_url}"
env_key = "TURNSTILE_SESSION_KEY"
wire_api = "responses"
"""


def codex_usage(stdout: str) -> tuple[int, int]:
    """Input and output tokens of all the model calls of the thread so far (``codex exec --json``: its
    ``turn.completed``; a resumed thread counts from its first call), as the gateway's replies said."""
    events = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    (usage,) = [event["usage"] for event in events if event.get("type") == "turn.completed"]
    return usage["input_tokens"], usage["output_tokens"]


async def test_codex_exec_runs_a_shell_command_and_a_resumed_thread_continues_its_lineage(
    servers: Servers, database_url: str, store: EventStore, long_model_dir: Path, tmp_path: Path
) -> None:
    codex = str(cli_binary("codex"))
    async with agent_gateway(servers.nats_url, database_url, long_model_dir, SCRIPT) as gateway:
        session: dict[str, Any] = await gateway.session()
        codex_home, work = tmp_path / "codex", tmp_path / "work"
        codex_home.mkdir()
        work.mkdir()
        (codex_home / "config.toml").write_text(codex_config(f"{gateway.url}/v1"))
        key = session["api_key"]
        env = offline_env(tmp_path / "home", CODEX_HOME=str(codex_home), TURNSTILE_SESSION_KEY=key)

        finished = await run_cli([codex, "exec", *CODEX_FLAGS, PROMPT], cwd=work, env=env)
        assert finished.returncode == 0, finished
        assert (work / PROOF_FILE).read_text() == PROOF_TEXT + "\n"
        turns = await recorded_turns(store, session["session_id"])
        # every call Codex made is a recorded turn, and no other: its own count of tokens is the turns'
        assert codex_usage(finished.stdout) == token_counts(turns)
        main, side = main_and_side(turns)
        assert (len(main), side) == (2, [])
        assert_shell_then_answer(main, CODEX_SHELL_TOOL)
        assert main[0].request.messages[0].role == "system"  # its developer messages
        assert len(main[0].prompt_token_ids) >= 10_000, "Codex's instructions and tools, whole"

        # the same thread resumed by a second invocation: its history comes back and is continued
        resume = [codex, "exec", "resume", "--last", *CODEX_FLAGS, FOLLOW_UP]
        resumed = await run_cli(resume, cwd=work, env=env)
        assert resumed.returncode == 0, resumed
        turns = await recorded_turns(store, session["session_id"])
        assert codex_usage(resumed.stdout) == token_counts(turns)  # the thread's, from its first call
        main, side = main_and_side(turns)
        assert (len(main), side) == (3, [])
        assert_shell_then_answer(main, CODEX_SHELL_TOOL, prompts=2)
        assert main[-1].request.messages[-1].content == FOLLOW_UP
        # the answer's reasoning came back in the next invocation (reasoning item: text, encrypted_content)
        assert main[1].reply.reasoning == REASONING
        assert [m.reasoning_content for m in main[2].request.messages if m.role == "assistant"] == [
            None, REASONING,
        ]  # fmt: skip
        assert_scripted_engine_turns(turns, gateway, SCRIPT)
        await assert_rewarded(gateway, store, session["session_id"])
