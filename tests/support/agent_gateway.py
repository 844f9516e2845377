"""What every agent-CLI test (marker ``agent_cli``) needs: the CLI's binary, a ``turnstile serve gateway``
process in front of the long-context tiny model answering with a script, and the checks every CLI's
recorded turns must pass (engine ids of the scripted text, the main lineage token-exact)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import re
import signal
import socket
import sys
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from consumers.inference import InferenceConfig
from pipeline.inference.backends.torch_backend import TorchBackend
from pipeline.inference.script import Script
from pipeline.log import EventStore
from pipeline.log.turns import whole_events
from schemas import EpisodeFinished, Event, RewardAssigned, TurnCompleted
from tests.support.serving import serving

CLIS = Path(__file__).resolve().parents[1] / "e2e" / "agent_clis"


def cli_binary(name: str) -> Path:
    """``tests/e2e/agent_clis/node_modules/.bin/<name>``; missing: a skip, or under CI (which installs it) a
    failure, so that the step cannot pass empty."""
    binary = CLIS / "node_modules" / ".bin" / name
    if not binary.exists():
        missing = f"{binary} is missing: run `npm ci --prefix tests/e2e/agent_clis` (Node 20+)"
        if os.environ.get("CI"):
            pytest.fail(missing)
        pytest.skip(missing)
    return binary


@dataclass
class AgentGateway:
    url: str
    """The gateway's base URL, without /v1."""
    admin: httpx.AsyncClient
    policy: str
    backend: TorchBackend
    """The consumer's backend: its tokenizer, end tokens and model, for the checks."""
    consumer_id: str

    async def session(self, **spec: Any) -> dict[str, Any]:
        """``POST /admin/sessions``: ``session_id``, ``api_key``, ``base_url``."""
        created = await self.admin.post("/admin/sessions", json={"policy": self.policy, **spec})
        assert created.status_code == 201, created.text
        body: dict[str, Any] = created.json()
        return body

    async def reward_and_end(self, session_id: str, value: float) -> None:
        rewarded = await self.admin.post(f"/admin/sessions/{session_id}/reward", json={"value": value})
        assert rewarded.status_code < 300, rewarded.text
        ended = await self.admin.post(f"/admin/sessions/{session_id}/end", json={})
        assert ended.status_code < 300, ended.text


@contextlib.asynccontextmanager
async def agent_gateway(
    nats_url: str, database_url: str, model_dir: Path, script: Path
) -> AsyncIterator[AgentGateway]:
    """An inference consumer (in this process) answering with ``script`` on ``model_dir``, and a
    ``turnstile serve gateway`` process in front of it, for a policy of this test's own."""
    policy = f"agent-{uuid.uuid4().hex[:8]}"
    admin_key = "admin-" + uuid.uuid4().hex
    config = InferenceConfig(nats_url, policy, model=model_dir, script=script)
    async with (
        serving(config) as service,
        gateway_process(database_url, nats_url, policy, admin_key) as url,
        httpx.AsyncClient(
            base_url=url, headers={"Authorization": f"Bearer {admin_key}"}, timeout=60
        ) as admin,
    ):
        assert isinstance(service.backend, TorchBackend)
        yield AgentGateway(url, admin, policy, service.backend, service.consumer_id)


@contextlib.asynccontextmanager
async def gateway_process(
    database_url: str,
    nats_url: str,
    policy: str,
    admin_key: str,
    *,
    pids: list[int] | None = None,
    options: tuple[str, ...] = (),
) -> AsyncIterator[str]:
    """``turnstile serve gateway`` on a free port (``--port 0``) with ``options``; yields its URL once it
    listens (and puts its process id in ``pids``, for a test that watches its memory or kills it)."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("TURNSTILE_")}
    env |= {
        "TURNSTILE_DATABASE_URL": database_url,
        "TURNSTILE_NATS_URL": nats_url,
        "TURNSTILE_ADMIN_KEY": admin_key,
        "COLUMNS": "400",  # the URL on one line
    }
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "consumers.cli", "serve", "gateway", "--port", "0", "--policy-default", policy,
        *options, env=env, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert process.stderr is not None
    if pids is not None:
        pids.append(process.pid)
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


async def episode_events(store: EventStore, session_id: str) -> list[Event]:
    """The session's episode, its turns made whole."""
    recorded = await store.read_stream(f"episode-{session_id}")
    return whole_events([r.event for r in recorded if r.event is not None])


def assert_scripted_engine_turns(turns: list[TurnCompleted], gateway: AgentGateway, script: Path) -> None:
    """Each turn's completion is the tokenizer's ids of one of the script's replies and the end token, with a
    logprob per id, from this test's consumer: what an engine returns had it sampled that text."""
    replies = {rule.reply.text() for rule in Script.load(script).rules}
    tokenizer, eos = gateway.backend.tokenizer, gateway.backend.eos_ids[0]
    for turn in turns:
        assert turn.engine_id == gateway.consumer_id
        assert turn.prompt_token_ids
        text = tokenizer.decode(turn.completion_token_ids[:-1])
        assert text in replies
        assert turn.completion_token_ids == [*tokenizer.encode(text, add_special_tokens=False), eos]
        assert len(turn.completion_logprobs) == len(turn.completion_token_ids)


def lineages(turns: list[TurnCompleted]) -> list[list[TurnCompleted]]:
    """The turns by root, each lineage in the order recorded, the first call's lineage first."""
    by_id = {turn.turn_id: turn for turn in turns}

    def root(turn: TurnCompleted) -> uuid.UUID:
        while turn.parent_turn_id is not None:
            turn = by_id[turn.parent_turn_id]
        return turn.turn_id

    roots = [turn.turn_id for turn in turns if turn.parent_turn_id is None]
    return [[turn for turn in turns if root(turn) == r] for r in roots]


def assert_token_exact(lineage: list[TurnCompleted]) -> None:
    """Each turn of a lineage is its predecessor's child, prompted with its exact prompt + completion ids
    first, with no prefix_break and no render drift."""
    for parent, child in itertools.pairwise(lineage):
        assert child.parent_turn_id == parent.turn_id
        prefix = [*parent.prompt_token_ids, *parent.completion_token_ids]
        assert child.prompt_token_ids[: len(prefix)] == prefix
    assert not any(turn.prefix_break for turn in lineage)
    assert all(turn.render_drift is False for turn in lineage)


# ---- Codex, opencode and the Agents SDK's example: one shell command, then an answer -----------------

PROOF_FILE = "proof.txt"
PROOF_TEXT = "turnstile was here"
"""What the scripts of Codex, opencode and the Agents SDK have the agent write (``echo ... > proof.txt``)."""
FINAL_ANSWER = "I wrote proof.txt. Done."
REASONING = "The command exited 0, so the file is there."
"""The reasoning before the final answer in the Codex and opencode scripts (``<think>`` in the reply text)."""
TITLE = "Writing the proof file"
PROMPT = f"Run a shell command that writes '{PROOF_TEXT}' to {PROOF_FILE}, then say that you are done."
FOLLOW_UP = "Is the file there?"
"""A second prompt, sent by a second invocation that continues the first one's conversation."""
CLI_TIMEOUT = 300.0
"""Seconds a CLI may take (about 5-10 s each unloaded; a loaded CI machine is many times slower)."""


def offline_env(home: Path, **variables: str) -> dict[str, str]:
    """A fresh environment: ``home`` as HOME and XDG directories, every proxy variable at a loopback port
    nothing listens on (so whatever a CLI would fetch from outside fails at once and nothing leaves the
    machine), the gateway on loopback exempt (``NO_PROXY``); then ``variables``."""
    with socket.socket() as probe:  # bound, never listening: a connection there is refused
        probe.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{probe.getsockname()[1]}"
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


@dataclass(frozen=True)
class Finished:
    returncode: int
    stdout: str
    stderr: str

    def __str__(self) -> str:
        return f"exit status {self.returncode}\nstdout:\n{self.stdout}\nstderr:\n{self.stderr}"


async def run_cli(argv: list[str], *, cwd: Path, env: dict[str, str]) -> Finished:
    """Run a CLI to its end without blocking the event loop (the consumer answers it from this loop);
    stdin is empty (``codex exec`` would wait to read more of the prompt from it)."""
    process = await asyncio.create_subprocess_exec(
        *argv, cwd=cwd, env=env, stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        stdout, stderr = await asyncio.wait_for(process.communicate(), CLI_TIMEOUT)
    except TimeoutError:
        process.kill()
        stdout, stderr = await process.communicate()
        ran = Finished(-1, stdout.decode(errors="replace"), stderr.decode(errors="replace"))
        raise AssertionError(f"{argv[0]} ran past {CLI_TIMEOUT} s:\n{ran}") from None
    return Finished(process.returncode or 0, stdout.decode(errors="replace"), stderr.decode(errors="replace"))


def main_and_side(turns: list[TurnCompleted]) -> tuple[list[TurnCompleted], list[list[TurnCompleted]]]:
    """The main lineage (the one whose calls offer tools: the agent's loop) and the others (side calls,
    such as opencode's title, which may come first)."""
    by_root = lineages(turns)
    main = [lineage for lineage in by_root if lineage[0].request.tools]
    assert len(main) == 1, [[t.reply.text for t in lineage] for lineage in by_root]
    return main[0], [lineage for lineage in by_root if lineage is not main[0]]


def assert_shell_then_answer(main: list[TurnCompleted], tool: str, *, prompts: int = 1) -> None:
    """The main lineage is the shell tool call, then the final answer (one more per later prompt), each
    turn continuing its parent token-exactly."""
    assert [call.function.name for call in main[0].reply.tool_calls] == [tool]
    assert [turn.reply.text for turn in main[1:]] == [FINAL_ANSWER] * prompts
    assert_token_exact(main)


async def assert_rewarded(gateway: AgentGateway, store: EventStore, session_id: str) -> None:
    """A reward posted after the agent finished is in the log, and the episode ended ``done``."""
    await gateway.reward_and_end(session_id, 1.0)
    events = await episode_events(store, session_id)
    assert [e.value for e in events if isinstance(e, RewardAssigned)] == [1.0]
    assert isinstance(events[-1], EpisodeFinished)
    assert events[-1].termination == "done"


async def recorded_turns(store: EventStore, session_id: str) -> list[TurnCompleted]:
    """The session's turns, whole, in the order recorded."""
    return [e for e in await episode_events(store, session_id) if isinstance(e, TurnCompleted)]


def token_counts(turns: list[TurnCompleted]) -> tuple[int, int]:
    """Prompt and completion tokens of ``turns`` together: what a client's usage adds up to."""
    return sum(len(t.prompt_token_ids) for t in turns), sum(len(t.completion_token_ids) for t in turns)
