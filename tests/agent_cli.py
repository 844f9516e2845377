"""What the end-to-end tests of unmodified agents share (``tests/test_agent_codex.py``,
``tests/test_agent_opencode.py``, ``tests/test_agent_openai_sdk.py``).

Each test points an agent, configured exactly as the README tells a user to, at a gateway on a free port
whose policy is scripted (the long-context tiny model, torch: real token ids and the model's logprobs for
the script's replies): the first call that offers the agent's shell tool gets a tool call running
``SHELL_COMMAND`` (it writes ``PROOF_FILE``), a call that carries the tool's result gets ``FINAL_ANSWER``,
and a call offering no tools (opencode's title generation) gets ``TITLE``. Then the recording is checked:
every call a turn with engine token ids, one main lineage continued token-exactly, side calls as roots of
their own, and a reward posted afterwards in the log.

The CLIs run offline: every proxy variable points at a closed loopback port (``NO_PROXY`` exempts the
gateway), so anything a CLI fetches from outside fails at once instead of reaching the network.
"""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from consumers.inference import InferenceConfig
from pipeline.dev.embedded import free_port
from pipeline.inference.client import NatsLLMClient
from pipeline.log import EventStore
from schemas import RewardAssigned, TurnCompleted
from tests.conftest import Servers
from tests.serving import serving
from tests.test_gateway import Gateway, assert_token_exact_child, events_of, gateway_for, new_policy

CLI_BIN = Path(__file__).resolve().parent / "agent_clis" / "node_modules" / ".bin"
PROOF_FILE = "proof.txt"
PROOF_TEXT = "turnstile was here"
SHELL_COMMAND = f"echo '{PROOF_TEXT}' > {PROOF_FILE}"
PROMPT = f"Run a shell command that writes '{PROOF_TEXT}' to {PROOF_FILE}, then say that you are done."
FINAL_ANSWER = f"I wrote {PROOF_FILE}. Done."
TITLE = "Writing the proof file"
FOLLOW_UP = "Is the file there?"
"""A second prompt, sent by a second invocation that continues the first one's conversation."""
CLI_TIMEOUT = 300.0
"""Seconds a CLI may take (about 10 s each unloaded; the shared CI machine can be many times slower)."""


def cli(name: str) -> Path:
    """The pinned CLI ``name`` from ``tests/agent_clis``; missing, the test fails under CI (``.ci/run``
    installs it, so the step must not pass empty) and is skipped elsewhere."""
    path = CLI_BIN / name
    if not path.exists():
        missing = f"no {name} in {CLI_BIN}: run `npm ci --prefix tests/agent_clis`"
        if os.environ.get("CI"):
            pytest.fail(missing)
        pytest.skip(missing)
    return path


# ---- the scripted policy -----------------------------------------------------------------------------


def shell_script(tool: str, arguments: dict[str, Any]) -> dict[str, Any]:
    """The policy's script (``pipeline/inference/script.py``): ``tool`` (the agent's shell tool) called with
    ``arguments`` while no tool result is in the conversation, the final answer once one is, a title when
    no tool is offered (a side call). A call none of them foresees is refused, naming what it carried."""
    return {
        "rules": [
            {
                "name": "run the shell command",
                "when": {"tool": tool, "tool_result": False},
                "reply": {"tool_calls": [{"name": tool, "arguments": arguments}]},
            },
            {
                "name": "final answer",
                "when": {"tools": True, "tool_result": True},
                "reply": {"content": FINAL_ANSWER},
            },
            {"name": "title", "when": {"tools": False}, "reply": {"content": TITLE}},
        ]
    }


@asynccontextmanager
async def scripted_gateway(
    servers: Servers, store: EventStore, llm: NatsLLMClient, model: Path, script: dict[str, Any]
) -> AsyncIterator[Gateway]:
    """A gateway whose sessions' policy answers by ``script`` on the long-context tiny ``model`` (torch: the
    tokenizer's ids, the model's logprobs), served by an inference consumer over NATS."""
    policy = new_policy()
    with tempfile.TemporaryDirectory(prefix="turnstile-script-") as directory:
        path = Path(directory) / "script.json"
        path.write_text(json.dumps(script))
        config = InferenceConfig(servers.nats_url, policy, model=model, script=path)
        async with serving(config), gateway_for(store, llm, policy) as gateway:
            yield gateway


# ---- running a CLI -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Finished:
    returncode: int
    output: str


def offline_env(home: Path, **variables: str) -> dict[str, str]:
    """A fresh environment: ``home`` as HOME and XDG directories, every proxy variable at a closed port
    (outside fetches fail at once), the gateway on loopback exempt; then ``variables``."""
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "LANG": "C.UTF-8",
        "XDG_CONFIG_HOME": str(home / ".config"),
        "XDG_DATA_HOME": str(home / ".local" / "share"),
        "XDG_CACHE_HOME": str(home / ".cache"),
        "XDG_STATE_HOME": str(home / ".local" / "state"),
        "NO_PROXY": "127.0.0.1,localhost",
        "no_proxy": "127.0.0.1,localhost",
    }
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
        env[name] = env[name.lower()] = dead
    return env | variables


async def run_cli(argv: list[str], *, cwd: Path, env: dict[str, str]) -> Finished:
    """Run a CLI to its end without blocking the event loop (the gateway and the consumer serve it from
    this loop); stdin is empty (Codex would otherwise wait to read more of the prompt from it)."""
    process = await asyncio.create_subprocess_exec(
        *argv,
        cwd=cwd,
        env=env,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    try:
        output, _ = await asyncio.wait_for(process.communicate(), CLI_TIMEOUT)
    except TimeoutError:
        process.kill()
        output, _ = await process.communicate()
        shown = output.decode(errors="replace")
        raise AssertionError(f"{argv[0]} ran past {CLI_TIMEOUT} s:\n{shown}") from None
    return Finished(process.returncode or 0, output.decode(errors="replace"))


# ---- what the log must hold afterwards ---------------------------------------------------------------


@dataclass(frozen=True)
class Recording:
    main: list[TurnCompleted]
    """The main lineage, root first: the shell tool call, then the final answer."""
    side: list[TurnCompleted]
    """Calls that extend no other turn and offer no tools (opencode's title)."""


def lineages(turns: list[TurnCompleted]) -> Recording:
    """The chain of parents that ends at the last turn offering tools, and the turns off it."""
    by_id = {turn.turn_id: turn for turn in turns}
    last = [turn for turn in turns if turn.request.tools][-1]
    main = [last]
    while main[0].parent_turn_id is not None:
        main.insert(0, by_id[main[0].parent_turn_id])
    on_main = {turn.turn_id for turn in main}
    return Recording(main, [turn for turn in turns if turn.turn_id not in on_main])


async def assert_recorded(store: EventStore, session_id: str, *, side_calls: int) -> Recording:
    """Every call a turn with the engine's tokens; the main lineage is the tool call then the final answer,
    continued token-exactly; ``side_calls`` roots of their own, offered no tools."""
    turns = [e for e in await events_of(store, session_id) if isinstance(e, TurnCompleted)]
    assert turns, "no turn was recorded"
    for turn in turns:
        assert turn.prompt_token_ids, turn.turn_id
        assert turn.completion_token_ids, turn.turn_id
        assert len(turn.completion_logprobs) == len(turn.completion_token_ids), turn.turn_id
    recording = lineages(turns)
    first, *rest = recording.main
    assert first.parent_turn_id is None
    assert [call.function.name for call in first.reply.tool_calls], first.reply
    assert rest, "the tool result never came back to the policy"
    assert recording.main[-1].reply.text == FINAL_ANSWER
    for parent, child in zip(recording.main, recording.main[1:], strict=False):
        assert_token_exact_child(parent, child)
        assert not child.prefix_break, child.turn_id
    assert not any(turn.render_drift for turn in turns)
    assert len(recording.side) == side_calls, [turn.reply.text for turn in recording.side]
    for turn in recording.side:
        assert turn.parent_turn_id is None
        assert not turn.request.tools
        assert turn.reply.text == TITLE
    return recording


async def assert_reward_recorded(
    gateway: Gateway, store: EventStore, session_id: str, turn: TurnCompleted
) -> None:
    """A reward posted after the agent finished is in the log, on the final turn."""
    posted = await gateway.admin.post(
        f"/admin/sessions/{session_id}/reward", json={"value": 1.0, "turn_id": turn.turn_id.hex}
    )
    assert posted.status_code == 200, posted.text
    ended = await gateway.admin.post(f"/admin/sessions/{session_id}/end", json={"termination": "done"})
    assert ended.status_code == 200, ended.text
    rewards = [e for e in await events_of(store, session_id) if isinstance(e, RewardAssigned)]
    assert [(r.turn_id, r.value) for r in rewards] == [(uuid.UUID(turn.turn_id.hex), 1.0)]
