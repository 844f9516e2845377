"""Codex CLI (``@openai/codex``, pinned in ``tests/agent_clis``), unmodified, headless through the gateway.

``codex exec`` reads its provider from ``$CODEX_HOME/config.toml`` (never ``OPENAI_BASE_URL``) and speaks only
the Responses API, streamed: ``developer`` messages, function tools plus hosted ones (``web_search``),
``reasoning``, ``store: false``, ``include``, ``prompt_cache_key``. It runs as root in a container with
``--dangerously-bypass-approvals-and-sandbox`` (its Landlock/seccomp sandbox needs what containers lack) and
outside a git repository with ``--skip-git-repo-check``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pipeline.inference.client import NatsLLMClient
from pipeline.log import EventStore
from tests.agent_cli import (
    FOLLOW_UP,
    PROMPT,
    PROOF_FILE,
    PROOF_TEXT,
    SHELL_COMMAND,
    assert_recorded,
    assert_reward_recorded,
    cli,
    offline_env,
    run_cli,
    scripted_gateway,
    shell_script,
)
from tests.conftest import Servers
from tests.test_gateway import llm  # noqa: F401 (fixture)

pytestmark = pytest.mark.agent_cli

CODEX_SHELL_TOOL = "exec_command"
"""Codex 0.169's shell tool: ``{"cmd": "<a shell command line>"}`` (older versions: ``shell``)."""

CODEX_FLAGS = ["--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox"]
"""Outside a git repository, no approvals and no sandbox of its own (as root in a container; the test's
directory is the sandbox)."""


def codex_config(base_url: str) -> str:
    """``config.toml`` as the README gives it: a provider of its own, the key read from an env variable."""
    return f"""\
model = "main"
model_provider = "turnstile"

[model_providers.turnstile]
name = "turnstile"
base_url = "{base_url}"
env_key = "TURNSTILE_SESSION_KEY"
wire_api = "responses"
"""


async def test_codex_exec_runs_a_shell_command_and_a_resumed_thread_continues_its_lineage(
    servers: Servers,
    store: EventStore,
    llm: NatsLLMClient,  # noqa: F811
    long_model_dir: Path,
    tmp_path: Path,
) -> None:
    script = shell_script(CODEX_SHELL_TOOL, {"cmd": SHELL_COMMAND})
    async with scripted_gateway(servers, store, llm, long_model_dir, script) as gateway:
        session: dict[str, Any] = await gateway.session()
        codex_home, work = tmp_path / "codex", tmp_path / "work"
        codex_home.mkdir()
        work.mkdir()
        (codex_home / "config.toml").write_text(codex_config(session["base_url"]))
        key = session["api_key"]
        env = offline_env(tmp_path / "home", CODEX_HOME=str(codex_home), TURNSTILE_SESSION_KEY=key)
        codex = str(cli("codex"))
        finished = await run_cli([codex, "exec", *CODEX_FLAGS, PROMPT], cwd=work, env=env)

        assert finished.returncode == 0, finished.output
        assert (work / PROOF_FILE).read_text().strip() == PROOF_TEXT
        recording = await assert_recorded(store, session["session_id"], side_calls=0)
        assert len(recording.main) == 2
        assert recording.main[0].request.messages[0].role == "system"  # its developer messages

        # the same thread resumed by a second invocation: its history comes back and is continued
        resume = [codex, "exec", "resume", "--last", *CODEX_FLAGS, FOLLOW_UP]
        resumed = await run_cli(resume, cwd=work, env=env)
        assert resumed.returncode == 0, resumed.output
        recording = await assert_recorded(store, session["session_id"], side_calls=0)
        assert len(recording.main) == 3
        assert recording.main[-1].request.messages[-1].content == FOLLOW_UP
        await assert_reward_recorded(gateway, store, session["session_id"], recording.main[-1])
