"""Codex CLI, unmodified, through two gateway replicas behind Debian's HAProxy (deploy/haproxy.cfg:
round-robin, no affinity): the replica that holds Codex's second call is killed with SIGKILL mid-call;
Codex's retry reaches the other replica and the run completes, every call recorded once in one token-exact
lineage (the same checks as tests/e2e/test_agent_codex.py), and a resumed thread goes on through the one
replica left."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from consumers.inference import InferenceConfig
from pipeline.inference.backends.torch_backend import TorchBackend
from pipeline.log import EventStore
from schemas import LLMRequest
from tests.conftest import Servers
from tests.e2e.test_agent_codex import CODEX_FLAGS, CODEX_SHELL_TOOL, SCRIPT, codex_config, codex_usage
from tests.support.agent_gateway import (
    FOLLOW_UP,
    PROMPT,
    PROOF_FILE,
    PROOF_TEXT,
    AgentGateway,
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
from tests.support.load_balancer import gateway_replicas, kill_holding_replica
from tests.support.serving import serving

pytestmark = pytest.mark.agent_cli


def hold_call(backend: TorchBackend, number: int) -> tuple[asyncio.Event, asyncio.Event]:
    """Hold the engine's ``number``-th generation (1-based) until the second event is set; the first is set
    when it arrives. The engine itself is untouched: its ``generate`` is wrapped on this instance."""
    arrived, release = asyncio.Event(), asyncio.Event()
    generate: Callable[[LLMRequest], Awaitable[Any]] = backend.generate
    seen = 0

    async def held(request: LLMRequest) -> Any:
        nonlocal seen
        seen += 1
        if seen == number:
            arrived.set()
            await release.wait()
        return await generate(request)

    backend.generate = held  # type: ignore[method-assign]
    return arrived, release


async def test_codex_goes_on_when_the_replica_holding_its_call_is_killed(
    servers: Servers, database_url: str, store: EventStore, long_model_dir: Path, tmp_path: Path
) -> None:
    codex = str(cli_binary("codex"))
    policy, admin_key = f"agent-{uuid.uuid4().hex[:8]}", "admin-" + uuid.uuid4().hex
    config = InferenceConfig(servers.nats_url, policy, model=long_model_dir, script=SCRIPT)
    async with (
        serving(config) as service,
        gateway_replicas(database_url, servers.nats_url, policy, admin_key, tmp_path) as (url, replicas),
        httpx.AsyncClient(
            base_url=url, headers={"Authorization": f"Bearer {admin_key}"}, timeout=60
        ) as admin,
    ):
        assert isinstance(service.backend, TorchBackend)
        gateway = AgentGateway(url, admin, policy, service.backend, service.consumer_id)
        session: dict[str, Any] = await gateway.session()
        codex_home, work = tmp_path / "codex", tmp_path / "work"
        codex_home.mkdir()
        work.mkdir()
        (codex_home / "config.toml").write_text(codex_config(f"{url}/v1"))
        env = offline_env(
            tmp_path / "home", CODEX_HOME=str(codex_home), TURNSTILE_SESSION_KEY=session["api_key"]
        )
        arrived, release = hold_call(service.backend, 2)  # its answer, after the shell command ran

        run = asyncio.create_task(run_cli([codex, "exec", *CODEX_FLAGS, PROMPT], cwd=work, env=env))
        await asyncio.wait_for(arrived.wait(), 300)
        await kill_holding_replica(replicas, admin_key, session["session_id"])
        release.set()
        finished = await run
        assert finished.returncode == 0, finished
        assert (work / PROOF_FILE).read_text() == PROOF_TEXT + "\n"
        turns = await recorded_turns(store, session["session_id"])
        assert codex_usage(finished.stdout) == token_counts(turns)  # every call Codex got, recorded once
        main, side = main_and_side(turns)
        assert (len(main), side) == (2, [])
        assert_shell_then_answer(main, CODEX_SHELL_TOOL)

        resume = [codex, "exec", "resume", "--last", *CODEX_FLAGS, FOLLOW_UP]
        resumed = await run_cli(resume, cwd=work, env=env)
        assert resumed.returncode == 0, resumed
        turns = await recorded_turns(store, session["session_id"])
        assert codex_usage(resumed.stdout) == token_counts(turns)
        main, side = main_and_side(turns)
        assert (len(main), side) == (3, [])
        assert_shell_then_answer(main, CODEX_SHELL_TOOL, prompts=2)
        assert_scripted_engine_turns(turns, gateway, SCRIPT)
        await assert_rewarded(gateway, store, session["session_id"])
