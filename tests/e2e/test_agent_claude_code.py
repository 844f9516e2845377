"""Claude Code, unmodified, through ``turnstile serve gateway``: every call it makes is a recorded turn.

``claude -p`` (the pinned ``@anthropic-ai/claude-code`` in tests/e2e/agent_clis, installed by
``npm ci --prefix tests/e2e/agent_clis``) runs headless in a fresh HOME against a real gateway process, real
PostgreSQL and NATS, and the long-context tiny model answering with the scripted policy
(tests/e2e/agent_clis/claude-code.script.json): run a shell command that writes a file; then delegate a check
to a subagent (Claude Code's Agent tool, with a haiku model name: a conversation of its own); then a final
answer. Marker ``agent_cli``: left out of the main run, run by its own step in .ci/run.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
from pathlib import Path

import pytest

from pipeline.inference.script import Script, last_spoken
from pipeline.log import EventStore
from schemas import EpisodeFinished, RewardAssigned, TurnCompleted
from tests.conftest import Servers
from tests.support.agent_gateway import (
    CLIS,
    agent_gateway,
    assert_scripted_engine_turns,
    assert_token_exact,
    cli_binary,
    episode_events,
    lineages,
)
from tests.support.reference import recomputed_logprobs

pytestmark = pytest.mark.agent_cli

SCRIPT = CLIS / "claude-code.script.json"
PROMPT = "Write the word turnstile into written.txt, then have it checked."
CLAUDE_ENV = {
    # no internet: nothing but the gateway (found by running it behind a logging proxy: without these it
    # reaches api.anthropic.com three times per run; with them, nothing)
    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    "DISABLE_TELEMETRY": "1",
    "DISABLE_AUTOUPDATER": "1",
    "DISABLE_ERROR_REPORTING": "1",
}
CLAUDE_FLAGS = [
    # root in CI: --dangerously-skip-permissions refuses root (unless IS_SANDBOX=1); allowing the two tools
    # the script uses works for any user
    "--allowedTools",
    "Bash",
    "Agent",
    "--max-turns",
    "8",  # a script that stopped matching cannot loop for ever
]


async def run_claude(gateway: str, api_key: str, home: Path, work: Path) -> tuple[int, str]:
    """``claude -p`` with nothing of this machine's environment but PATH (for node); exit code and output."""
    node = shutil.which("node")
    assert node is not None, "Node is needed for the agent CLIs"
    env = {
        "PATH": os.pathsep.join([str(Path(node).parent), "/usr/bin", "/bin"]),
        "HOME": str(home),
        "CLAUDE_CONFIG_DIR": str(home / ".claude"),
        "ANTHROPIC_BASE_URL": gateway,  # without /v1: it posts to $ANTHROPIC_BASE_URL/v1/messages?beta=true
        "ANTHROPIC_API_KEY": api_key,
        **CLAUDE_ENV,
    }
    debug = home / "claude-debug.txt"
    process = await asyncio.create_subprocess_exec(
        str(cli_binary("claude")), "-p", PROMPT, *CLAUDE_FLAGS, "--debug-file", str(debug),
        cwd=work, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    try:
        output, _ = await asyncio.wait_for(process.communicate(), 300)
    except TimeoutError:
        process.kill()
        await process.wait()
        raise
    return process.returncode or 0, output.decode()


def api_requests(home: Path) -> list[str]:
    """The model calls Claude Code says it made (its debug log): the source of each."""
    text = (home / "claude-debug.txt").read_text()
    return re.findall(r"\[API REQUEST\] /v1/messages source=(\S+)", text)


@pytest.fixture
def home(tmp_path: Path) -> Path:
    """A fresh HOME (and Claude Code's config directory in it) per test."""
    directory = tmp_path / "home"
    directory.mkdir()
    return directory


async def test_claude_code_runs_a_command_and_a_subagent_and_every_call_is_a_token_exact_turn(
    servers: Servers, database_url: str, store: EventStore, long_model_dir: Path, home: Path, tmp_path: Path
) -> None:
    cli_binary("claude")
    work = tmp_path / "work"
    work.mkdir()
    async with agent_gateway(servers.nats_url, database_url, long_model_dir, SCRIPT) as gateway:
        session = await gateway.session()
        code, output = await run_claude(gateway.url, session["api_key"], home, work)
        assert code == 0, output
        assert "The file is written." in output
        assert (work / "written.txt").read_text() == "turnstile\n"
        await gateway.reward_and_end(session["session_id"], 1.0)

    events = await episode_events(store, session["session_id"])
    turns = [e for e in events if isinstance(e, TurnCompleted)]
    calls = api_requests(home)
    assert calls == ["sdk", "sdk", "agent:builtin:general-purpose", "sdk"]
    assert len(turns) == len(calls), "every call Claude Code made is a recorded turn, and no other"
    assert_scripted_engine_turns(turns, gateway, SCRIPT)
    first = turns[0]
    assert len(first.prompt_token_ids) >= 20_000, "Claude Code's system prompt and tools, whole"
    expected = recomputed_logprobs(long_model_dir, first.prompt_token_ids[-4096:], first.completion_token_ids)
    assert max(abs(a - b) for a, b in zip(first.completion_logprobs, expected, strict=True)) <= 2e-6

    # the main lineage: command, delegation, final answer, each continuing its parent token-exactly; the
    # subagent's call (a haiku model name) is a lineage of its own, never grafted onto the main one
    main, side = lineages(turns)
    assert [t.reply.tool_calls[0].function.name if t.reply.tool_calls else None for t in main] == [
        "Bash", "Agent", None,
    ]  # fmt: skip
    assert_token_exact(main)
    [subagent] = side
    assert "SUBAGENT-TASK" in (last_spoken(subagent.request.messages).content or "")
    assert not subagent.prefix_break

    assert [e.value for e in events if isinstance(e, RewardAssigned)] == [1.0]
    assert isinstance(events[-1], EpisodeFinished)
    assert events[-1].termination == "done"


def test_the_script_is_valid_and_names_the_tools_claude_code_offers() -> None:
    script = Script.load(SCRIPT)
    called = {call.name for rule in script.rules for call in rule.reply.tool_calls}
    assert called == {"Bash", "Agent"}
    assert all(rule.name for rule in script.rules)
