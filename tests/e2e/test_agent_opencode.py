"""opencode (``opencode-ai``, pinned in ``tests/e2e/agent_clis``), unmodified, headless through
``turnstile serve gateway`` on the long-context tiny model answering with
``tests/e2e/agent_clis/opencode.script.json``.

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

from pipeline.log import EventStore
from schemas import TurnCompleted
from tests.conftest import Servers
from tests.support.agent_gateway import (
    CLIS,
    FOLLOW_UP,
    PROMPT,
    PROOF_FILE,
    PROOF_TEXT,
    REASONING,
    TITLE,
    agent_gateway,
    assert_rewarded,
    assert_scripted_engine_turns,
    assert_shell_then_answer,
    cli_binary,
    main_and_side,
    offline_env,
    recorded_turns,
    run_cli,
)

pytestmark = pytest.mark.agent_cli

SCRIPT = CLIS / "opencode.script.json"
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
    """``opencode.json`` as the docs give it: the gateway as an OpenAI-compatible provider, the session
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


def opencode_steps(stdout: str) -> list[tuple[int, int]]:
    """Input and output tokens of each of the agent's model calls (``opencode run --format json``: a
    ``step_finish`` event per call; the title call is not a step), as the gateway's replies reported them."""
    events = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    tokens = [event["part"]["tokens"] for event in events if event.get("type") == "step_finish"]
    return [(step["input"], step["output"]) for step in tokens]


def sizes(turns: list[TurnCompleted]) -> list[tuple[int, int]]:
    return [(len(turn.prompt_token_ids), len(turn.completion_token_ids)) for turn in turns]


async def test_opencode_runs_a_shell_command_its_title_is_a_lineage_of_its_own_and_continue_continues(
    servers: Servers, database_url: str, store: EventStore, long_model_dir: Path, tmp_path: Path
) -> None:
    opencode = str(cli_binary("opencode"))
    async with agent_gateway(servers.nats_url, database_url, long_model_dir, SCRIPT) as gateway:
        session: dict[str, Any] = await gateway.session()
        work = tmp_path / "work"
        work.mkdir()
        env = offline_env(tmp_path / "home", TURNSTILE_SESSION_KEY=session["api_key"], **OPENCODE_OFFLINE)
        config = Path(env["XDG_CONFIG_HOME"]) / "opencode" / "opencode.json"
        config.parent.mkdir(parents=True)
        config.write_text(json.dumps(opencode_config(f"{gateway.url}/v1"), indent=2))

        finished = await run_cli([opencode, "run", "--format", "json", PROMPT], cwd=work, env=env)
        assert finished.returncode == 0, finished
        assert (work / PROOF_FILE).read_text() == PROOF_TEXT + "\n"
        turns = await recorded_turns(store, session["session_id"])
        main, side = main_and_side(turns)
        # every call of the agent's loop is a recorded turn, and no other: its own count of tokens per call
        assert opencode_steps(finished.stdout) == sizes(main)
        assert len(main) == 2
        assert_shell_then_answer(main, OPENCODE_SHELL_TOOL)
        [[title]] = side  # the title call: a root of its own, offered no tools
        assert (title.reply.text, title.request.tools) == (TITLE, [])

        # its session continued by a second invocation: the same lineage, no second title
        again = [opencode, "run", "--continue", "--format", "json", FOLLOW_UP]
        continued = await run_cli(again, cwd=work, env=env)
        assert continued.returncode == 0, continued
        turns = await recorded_turns(store, session["session_id"])
        main, side = main_and_side(turns)
        assert opencode_steps(continued.stdout) == sizes(main[2:])
        assert (len(main), len(side)) == (3, 1)
        assert_shell_then_answer(main, OPENCODE_SHELL_TOOL, prompts=2)
        assert FOLLOW_UP in (main[-1].request.messages[-1].content or "")  # opencode quotes it: '"..."'
        # the answer's reasoning came back in the next invocation (as the message's reasoning_content)
        assert main[1].reply.reasoning == REASONING
        assert [m.reasoning_content for m in main[2].request.messages if m.role == "assistant"] == [
            None, REASONING,
        ]  # fmt: skip
        assert_scripted_engine_turns(turns, gateway, SCRIPT)
        await assert_rewarded(gateway, store, session["session_id"])
