"""The OpenAI Agents SDK (``openai-agents``), unmodified, through ``turnstile serve gateway``:
``examples/openai_agents_shell.py`` run as its user would run it, with the SDK's default model (Responses
API) at ``OPENAI_BASE_URL``, on the long-context tiny model answering with
``tests/e2e/agent_clis/openai-agents.script.json``. In the main suite: it needs no npm and takes seconds."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import pytest

from pipeline.log import EventStore
from tests.conftest import Servers
from tests.support.agent_gateway import (
    CLIS,
    FINAL_ANSWER,
    PROMPT,
    PROOF_FILE,
    PROOF_TEXT,
    agent_gateway,
    assert_rewarded,
    assert_scripted_engine_turns,
    assert_shell_then_answer,
    main_and_side,
    offline_env,
    recorded_turns,
    run_cli,
    token_counts,
)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "openai_agents_shell.py"
SCRIPT = CLIS / "openai-agents.script.json"


async def test_an_agents_sdk_agent_with_its_default_model_runs_a_shell_command_recorded(
    servers: Servers, database_url: str, store: EventStore, long_model_dir: Path, tmp_path: Path
) -> None:
    pytest.importorskip("agents")
    async with agent_gateway(servers.nats_url, database_url, long_model_dir, SCRIPT) as gateway:
        session: dict[str, Any] = await gateway.session()
        env = offline_env(
            tmp_path / "home",
            OPENAI_BASE_URL=f"{gateway.url}/v1",
            OPENAI_API_KEY=session["api_key"],
            OPENAI_AGENTS_DISABLE_TRACING="1",  # or it uploads traces to OpenAI with the session's key
        )
        finished = await run_cli([sys.executable, str(EXAMPLE), PROMPT], cwd=tmp_path, env=env)

        assert finished.returncode == 0, finished
        assert finished.stdout.splitlines()[0] == FINAL_ANSWER
        assert (tmp_path / PROOF_FILE).read_text() == PROOF_TEXT + "\n"
        turns = await recorded_turns(store, session["session_id"])
        # every call the SDK made is a recorded turn, and no other: its own count of calls and tokens
        counted = re.search(r"(\d+) model calls: (\d+) input, (\d+) output tokens", finished.stdout)
        assert counted is not None, finished
        assert tuple(map(int, counted.groups())) == (len(turns), *token_counts(turns))
        main, side = main_and_side(turns)
        assert (len(main), side) == (2, [])
        assert_shell_then_answer(main, "run_shell")
        assert_scripted_engine_turns(turns, gateway, SCRIPT)
        await assert_rewarded(gateway, store, session["session_id"])
