"""opencode (``opencode-ai``, pinned in ``tests/agent_clis``), unmodified, headless through the gateway.

``opencode run`` reaches the gateway through an ``@ai-sdk/openai-compatible`` provider in its config
(chat completions, streamed, ``max_tokens: 32000``). Besides the agent's own calls it makes a side call in
the same session: the session's title, asked of ``small_model`` with no tools; it extends no turn, so it is
a lineage of its own. Offline, the ``OPENCODE_DISABLE_*`` variables below stop what it would fetch (the
models.dev catalogue, updates, LSP servers, plugins); a fetch that still fails only logs an error. It also
tries registry.npmjs.org once per run, which fails harmlessly here (the proxy variables point nowhere).
"""

from __future__ import annotations

import json
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
    TITLE,
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

OPENCODE_SHELL_TOOL = "bash"
"""opencode's shell tool: ``{"command": ..., "description": ...}``."""

OPENCODE_OFFLINE = {
    "OPENCODE_DISABLE_MODELS_FETCH": "1",  # the models.dev catalogue (the provider is in the config)
    "OPENCODE_DISABLE_AUTOUPDATE": "1",
    "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
    "OPENCODE_DISABLE_DEFAULT_PLUGINS": "1",
    "OPENCODE_DISABLE_SHARE": "1",
    "OPENCODE_DISABLE_PROJECT_CONFIG": "1",  # an opencode.json above the work directory would win
}


def opencode_config(base_url: str) -> dict[str, Any]:
    """``opencode.json`` as the README gives it: the gateway as an OpenAI-compatible provider, the session
    key from an env variable, the same model for titles (``small_model``), the shell allowed unasked."""
    return {
        "$schema": "https://opencode.ai/config.json",
        "provider": {
            "turnstile": {
                "npm": "@ai-sdk/openai-compatible",
                "name": "Turnstile",
                "options": {"baseURL": base_url, "apiKey": "{env:TURNSTILE_SESSION_KEY}"},
                "models": {"main": {"name": "main"}},
            }
        },
        "model": "turnstile/main",
        "small_model": "turnstile/main",
        "autoupdate": False,
        "share": "disabled",
        "permission": {"bash": "allow", "edit": "allow"},
    }


async def test_opencode_runs_a_shell_command_its_title_is_a_lineage_of_its_own_and_continue_continues(
    servers: Servers,
    store: EventStore,
    llm: NatsLLMClient,  # noqa: F811
    long_model_dir: Path,
    tmp_path: Path,
) -> None:
    arguments = {"command": SHELL_COMMAND, "description": "Write the proof file"}
    script = shell_script(OPENCODE_SHELL_TOOL, arguments)
    async with scripted_gateway(servers, store, llm, long_model_dir, script) as gateway:
        session: dict[str, Any] = await gateway.session()
        home, work = tmp_path / "home", tmp_path / "work"
        work.mkdir()
        env = offline_env(home, TURNSTILE_SESSION_KEY=session["api_key"], **OPENCODE_OFFLINE)
        config = Path(env["XDG_CONFIG_HOME"]) / "opencode" / "opencode.json"
        config.parent.mkdir(parents=True)
        config.write_text(json.dumps(opencode_config(session["base_url"]), indent=2))
        opencode = str(cli("opencode"))
        finished = await run_cli([opencode, "run", PROMPT], cwd=work, env=env)

        assert finished.returncode == 0, finished.output
        assert (work / PROOF_FILE).read_text().strip() == PROOF_TEXT
        recording = await assert_recorded(store, session["session_id"], side_calls=1)
        assert len(recording.main) == 2
        assert recording.side[0].reply.text == TITLE

        # its session continued by a second invocation: the same lineage, no second title
        continued = await run_cli([opencode, "run", "--continue", FOLLOW_UP], cwd=work, env=env)
        assert continued.returncode == 0, continued.output
        recording = await assert_recorded(store, session["session_id"], side_calls=1)
        assert len(recording.main) == 3
        assert FOLLOW_UP in (recording.main[-1].request.messages[-1].content or "")  # opencode quotes it
        await assert_reward_recorded(gateway, store, session["session_id"], recording.main[-1])
