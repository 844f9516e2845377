"""The OpenAI Agents SDK (``openai-agents``), unmodified, through the gateway:
``examples/openai_agents_shell.py`` run as its user would run it, with the SDK's default model (Responses
API) at ``OPENAI_BASE_URL``. In the main suite: it needs no npm and takes a few seconds."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from pipeline.inference.client import NatsLLMClient
from pipeline.log import EventStore
from tests.agent_cli import (
    FINAL_ANSWER,
    PROMPT,
    PROOF_FILE,
    PROOF_TEXT,
    SHELL_COMMAND,
    assert_recorded,
    assert_reward_recorded,
    offline_env,
    run_cli,
    scripted_gateway,
    shell_script,
)
from tests.conftest import Servers
from tests.test_gateway import llm  # noqa: F401 (fixture)

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "openai_agents_shell.py"


async def test_an_agents_sdk_agent_with_its_default_model_runs_a_shell_command_recorded(
    servers: Servers,
    store: EventStore,
    llm: NatsLLMClient,  # noqa: F811
    long_model_dir: Path,
    tmp_path: Path,
) -> None:
    pytest.importorskip("agents")
    script = shell_script("run_shell", {"command": SHELL_COMMAND})
    async with scripted_gateway(servers, store, llm, long_model_dir, script) as gateway:
        session: dict[str, Any] = await gateway.session()
        env = offline_env(
            tmp_path / "home",
            OPENAI_BASE_URL=session["base_url"],
            OPENAI_API_KEY=session["api_key"],
            OPENAI_AGENTS_DISABLE_TRACING="1",
        )
        finished = await run_cli([sys.executable, str(EXAMPLE), PROMPT], cwd=tmp_path, env=env)

        assert finished.returncode == 0, finished.output
        assert finished.output.strip().endswith(FINAL_ANSWER)
        assert (tmp_path / PROOF_FILE).read_text().strip() == PROOF_TEXT
        recording = await assert_recorded(store, session["session_id"], side_calls=0)
        assert len(recording.main) == 2
        await assert_reward_recorded(gateway, store, session["session_id"], recording.main[-1])
