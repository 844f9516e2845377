"""Claude Code, unmodified, through ``turnstile serve gateway``: every call it makes is a recorded turn.

``claude -p`` (the pinned ``@anthropic-ai/claude-code`` in tests/agent_clis, installed by
``npm ci --prefix tests/agent_clis``) runs headless in a fresh HOME against a real gateway process, real
PostgreSQL and NATS, and the long-context tiny model answering with the scripted policy
(tests/agent_clis/claude-code.script.json): run a shell command that writes a file; then delegate a check
to a subagent (Claude Code's Agent tool, with a haiku model name: a conversation of its own); then a final
answer. Marker ``agent_cli``: left out of the main run, run by its own step in .ci/run.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import re
import shutil
import signal
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from consumers.inference import InferenceConfig
from pipeline.inference.backends.torch_backend import TorchBackend
from pipeline.inference.script import Script
from pipeline.log import EventStore
from pipeline.log.turns import whole_events
from schemas import EpisodeFinished, RewardAssigned, TurnCompleted
from tests.conftest import Servers
from tests.reference import recomputed_logprobs
from tests.serving import serving

pytestmark = pytest.mark.agent_cli

CLIS = Path(__file__).resolve().parent / "agent_clis"
CLAUDE = CLIS / "node_modules" / ".bin" / "claude"
SCRIPT = CLIS / "claude-code.script.json"
ADMIN = "admin-" + uuid.uuid4().hex
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


@pytest.fixture(scope="module")
def claude() -> Path:
    if not CLAUDE.exists():
        missing = f"{CLAUDE} is missing: run `npm ci --prefix tests/agent_clis` (Node 20+)"
        if os.environ.get("CI"):  # .ci/run installs it: missing there, the step must fail, not pass empty
            pytest.fail(missing)
        pytest.skip(missing)
    return CLAUDE


@contextlib.asynccontextmanager
async def gateway_process(database_url: str, nats_url: str, policy: str) -> AsyncIterator[str]:
    """``turnstile serve gateway`` on a free port (``--port 0``); yields its URL once it listens."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("TURNSTILE_")}
    env |= {
        "TURNSTILE_DATABASE_URL": database_url,
        "TURNSTILE_NATS_URL": nats_url,
        "TURNSTILE_ADMIN_KEY": ADMIN,
        "COLUMNS": "400",  # the URL on one line
    }
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "consumers.cli", "serve", "gateway", "--port", "0", "--policy-default", policy,
        env=env, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert process.stderr is not None
    seen: list[str] = []
    drain: asyncio.Task[bytes] | None = None
    try:
        async with asyncio.timeout(120):
            while not (found := re.search(r" on (http://[\d.]+:\d+): ", "".join(seen))):
                line = await process.stderr.readline()
                assert line, f"the gateway exited before it listened:\n{''.join(seen)}"
                seen.append(line.decode())
        drain = asyncio.create_task(process.stderr.read())  # its log must not fill the pipe
        yield found.group(1)
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGTERM)
            await asyncio.wait_for(process.wait(), 60)
        if drain is not None:
            await drain


async def run_claude(claude: Path, gateway: str, api_key: str, home: Path, work: Path) -> tuple[int, str]:
    """``claude -p`` with nothing of this machine's environment but PATH (for node); output and exit code."""
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
        str(claude), "-p", PROMPT, *CLAUDE_FLAGS, "--debug-file", str(debug),
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
    claude: Path, servers: Servers, database_url: str, store: EventStore, long_model_dir: Path, home: Path,
    tmp_path: Path,
) -> None:  # fmt: skip
    work = tmp_path / "work"
    work.mkdir()
    policy = f"claude-{uuid.uuid4().hex[:8]}"
    config = InferenceConfig(servers.nats_url, policy, model=long_model_dir, script=SCRIPT)
    async with (
        serving(config) as service,
        gateway_process(database_url, servers.nats_url, policy) as gateway,
        httpx.AsyncClient(base_url=gateway, headers={"Authorization": f"Bearer {ADMIN}"}) as admin,
    ):
        created = await admin.post("/admin/sessions", json={"policy": policy})
        assert created.status_code == 201, created.text
        session = created.json()
        code, output = await run_claude(claude, gateway, session["api_key"], home, work)
        assert code == 0, output
        assert "The file is written." in output
        assert (work / "written.txt").read_text() == "turnstile\n"

        rewarded = await admin.post(f"/admin/sessions/{session['session_id']}/reward", json={"value": 1.0})
        assert rewarded.status_code < 300, rewarded.text
        ended = await admin.post(f"/admin/sessions/{session['session_id']}/end", json={})
        assert ended.status_code < 300, ended.text
        backend = service.backend
        assert isinstance(backend, TorchBackend)

    events = whole_events(
        [r.event for r in await store.read_stream(f"episode-{session['session_id']}") if r.event is not None]
    )
    turns = [e for e in events if isinstance(e, TurnCompleted)]
    calls = api_requests(home)
    assert calls == ["sdk", "sdk", "agent:builtin:general-purpose", "sdk"]
    assert len(turns) == len(calls), "every call Claude Code made is a recorded turn, and no other"

    # engine token ids: the scripted text as the tokenizer's ids, scored by the model
    replies = {rule.reply.text() for rule in Script.load(SCRIPT).rules}
    eos = backend.eos_ids[0]
    for turn in turns:
        assert turn.engine_id == service.consumer_id
        text = backend.tokenizer.decode(turn.completion_token_ids[:-1])
        assert text in replies
        assert turn.completion_token_ids == [*backend.tokenizer.encode(text, add_special_tokens=False), eos]
        assert len(turn.completion_logprobs) == len(turn.completion_token_ids)
    first = turns[0]
    assert len(first.prompt_token_ids) >= 20_000, "Claude Code's system prompt and tools, whole"
    expected = recomputed_logprobs(long_model_dir, first.prompt_token_ids[-4096:], first.completion_token_ids)
    assert max(abs(a - b) for a, b in zip(first.completion_logprobs, expected, strict=True)) <= 2e-6

    # the main lineage: command, delegation, final answer, each continuing its parent token-exactly
    by_id = {turn.turn_id: turn for turn in turns}
    roots = [turn for turn in turns if turn.parent_turn_id is None]
    main = [turn for turn in turns if _root(turn, by_id) is roots[0]]
    assert [t.reply.tool_calls[0].function.name if t.reply.tool_calls else None for t in main] == [
        "Bash", "Agent", None,
    ]  # fmt: skip
    for parent, child in itertools.pairwise(main):
        assert child.parent_turn_id == parent.turn_id
        prefix = [*parent.prompt_token_ids, *parent.completion_token_ids]
        assert child.prompt_token_ids[: len(prefix)] == prefix
    assert not any(turn.prefix_break for turn in turns)
    assert all(turn.render_drift is False for turn in turns)

    # the subagent's call (a haiku model name) is a lineage of its own, never grafted onto the main one
    [side] = [turn for turn in turns if turn not in main]
    assert side.parent_turn_id is None
    assert "SUBAGENT-TASK" in (side.request.messages[-1].content or "")
    assert side.prompt_token_ids[: len(first.prompt_token_ids)] != first.prompt_token_ids

    rewards = [e for e in events if isinstance(e, RewardAssigned)]
    assert [r.value for r in rewards] == [1.0]
    assert isinstance(events[-1], EpisodeFinished)
    assert events[-1].termination == "done"


def _root(turn: TurnCompleted, by_id: dict[Any, TurnCompleted]) -> TurnCompleted:
    while turn.parent_turn_id is not None:
        turn = by_id[turn.parent_turn_id]
    return turn


def test_the_script_is_valid_and_names_the_tools_claude_code_offers() -> None:
    script = Script.load(SCRIPT)
    called = {call.name for rule in script.rules for call in rule.reply.tool_calls}
    assert called == {"Bash", "Agent"}
    assert json.loads(SCRIPT.read_text())["rules"][2]["reply"]["tool_calls"][0]["arguments"]["command"]
