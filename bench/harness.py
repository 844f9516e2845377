"""Episodes per minute through the harness, and the harness's own CPU per episode, beside the same agent
command run without it, in one run on the same servers, gateway and consumer.

Each episode: one gateway session, the command agent (examples/harness_shell_agent.py, the openai SDK)
making one call that the instant scripted consumer (bench/common.py) answers, a verifier (``true``), the
reward and the end. Two ways, at each concurrency level (``--levels``, default 1, 8 and 32) with
``--episodes`` episodes each:

- ``bare`` (the baseline): this process opens the session over the admin API, runs the agent with the
  session's key in its environment as a subprocess, runs the verifier, posts the reward and ends the
  session: what a hand-written loop does, with no sandbox, no config files, no journal, no clean-up.
- ``harness``: ``run_harness`` with ``--sandbox none`` (a temp directory per episode, the agent's HOME
  written, a process group per command, the owner's journal and lock, the verifier's reward file read).

Each level runs ``--rounds`` (2) rounds of each way, alternated, and keeps the best of each (the machine's
load drifts between them). "episodes/min" is episodes over wall-clock time; "CPU per episode" is this
process's CPU time (user + system) per episode: the harness's own work, not the agent's (a process of its
own). On a small shared machine the agent's Python start-up bounds both paths: read the ratios, measured
side by side.

    python bench/harness.py                      # --levels 1,8,32 --episodes 8,32,64
    python bench/harness.py --sandbox-start      # a sandbox's start-up per backend (bench/sandbox_start.py)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Coroutine
from pathlib import Path

import httpx

from pipeline.harness import HarnessConfig, agent_spec, backend, base_env, load_tasks, run_harness

from common import REPO, consumer, note, scratch_database, servers, summary

AGENT = [sys.executable, str(REPO / "examples" / "harness_shell_agent.py")]


@contextlib.asynccontextmanager
async def gateway(database_url: str, nats_url: str, policy: str, admin_key: str) -> AsyncIterator[str]:
    """``turnstile serve gateway`` on a free port; its URL."""
    env = os.environ | {
        "TURNSTILE_DATABASE_URL": database_url, "TURNSTILE_NATS_URL": nats_url,
        "TURNSTILE_ADMIN_KEY": admin_key, "COLUMNS": "400",
    }  # fmt: skip
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "consumers.cli", "serve", "gateway", "--port", "0", "--policy-default", policy,
        "--max-open-sessions", "1000", env=env, stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE, cwd=REPO,
    )  # fmt: skip
    assert process.stderr is not None
    seen = ""
    while not (found := re.search(r" on (http://[\d.]+:\d+): ", seen)):
        line = await asyncio.wait_for(process.stderr.readline(), 120)
        if not line:
            raise RuntimeError(f"the gateway exited:\n{seen}")
        seen += line.decode()
    drain = asyncio.create_task(process.stderr.read())
    try:
        yield found.group(1)
    finally:
        process.terminate()
        await process.wait()
        await drain


async def bare_episode(admin: httpx.AsyncClient, url: str, home: Path) -> None:
    """The baseline: a session, the agent, the verifier, the reward, the end, by hand."""
    session = (await admin.post("/admin/sessions", json={"task_id": "bench", "agent": "bare"})).json()
    env = base_env(
        str(home), "127.0.0.1"
    )  # what the harness gives an agent, so that only the harness differs
    env |= {"OPENAI_BASE_URL": f"{url}/v1", "OPENAI_API_KEY": session["api_key"]}
    with tempfile.TemporaryDirectory() as work:
        # a session of its own, as the process sandbox starts every command: where the kernel groups
        # processes by session for scheduling (sched_autogroup), agents that share the benchmark's session
        # share one CPU share among them and ran up to 4x slower under other users' load
        agent = await asyncio.create_subprocess_exec(
            *AGENT, "Say ok.", cwd=work, env=env, stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        output, _ = await agent.communicate()
        assert agent.returncode == 0, output.decode()
        verifier = await asyncio.create_subprocess_exec("true", cwd=work, env={}, start_new_session=True)
        reward = 1.0 if await verifier.wait() == 0 else 0.0
    await admin.post(f"/admin/sessions/{session['session_id']}/reward", json={"value": reward})
    await admin.post(f"/admin/sessions/{session['session_id']}/end", json={})


async def bare(url: str, admin_key: str, concurrency: int, episodes: int, home: Path) -> None:
    slots = asyncio.Semaphore(concurrency)
    headers = {"Authorization": f"Bearer {admin_key}"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=120) as admin:

        async def one() -> None:
            async with slots:
                await bare_episode(admin, url, home)

        await asyncio.gather(*(one() for _ in range(episodes)))


async def harness(url: str, admin_key: str, concurrency: int, episodes: int, scratch: Path) -> None:
    tasks_file = scratch / "tasks.jsonl"
    tasks_file.write_text(json.dumps({"id": "bench", "instruction": "Say ok.", "verifier": "true"}) + "\n")
    config = HarnessConfig(
        gateway=url, admin_key=admin_key, agent=agent_spec("command", " ".join(AGENT)),
        owner=f"bench-{uuid.uuid4().hex[:8]}", state_dir=scratch / "state", group_size=episodes,
        concurrency=concurrency, retries=0,
    )  # fmt: skip
    run = await run_harness(config, load_tasks([tasks_file]), backend("none"))
    outcomes = {a.outcome for a in run.stats.attempts}
    assert outcomes == {"passed"}, [a.cause for a in run.stats.attempts]


async def measure(work: Coroutine[object, object, None], episodes: int) -> tuple[float, float]:
    """Episodes per minute and this process's CPU ms per episode of ``work``."""
    cpu, wall = time.process_time(), time.monotonic()
    await work
    wall, cpu = time.monotonic() - wall, time.process_time() - cpu
    return episodes / wall * 60, cpu / episodes * 1000


async def main(levels: list[int], counts: list[int], rounds: int) -> None:
    policy, admin_key = f"bench-{uuid.uuid4().hex[:6]}", uuid.uuid4().hex
    with servers() as found, scratch_database(found.database_url) as database_url:
        async with (
            consumer(found.nats_url, policy),
            gateway(database_url, found.nats_url, policy, admin_key) as url,
        ):
            with tempfile.TemporaryDirectory() as scratch:
                home = Path(scratch)
                await bare(url, admin_key, 1, 1, home)  # warm-up: imports, connections
                for level, count in zip(levels, counts, strict=True):
                    base, ours = (0.0, 0.0), (0.0, 0.0)
                    for _ in range(rounds):  # alternated, the best of each: a shared machine's load drifts
                        base = max(base, await measure(bare(url, admin_key, level, count, home), count))
                        ours = max(ours, await measure(harness(url, admin_key, level, count, home), count))
                    note(
                        f"concurrency {level}, {count} episodes: bare {base[0]:.0f}/min "
                        f"(CPU {base[1]:.1f} ms each), harness {ours[0]:.0f}/min (CPU {ours[1]:.1f} ms each)"
                    )
                    summary(
                        "harness", f"episodes/min at concurrency {level}", f"{ours[0]:.0f}/min",
                        f"bare {base[0]:.0f}/min", ours[0] / base[0], None,
                    )  # fmt: skip
                    summary(
                        "harness", f"CPU per episode at concurrency {level}", f"{ours[1]:.1f} ms",
                        f"bare {base[1]:.1f} ms", ours[1] / base[1], None,
                    )  # fmt: skip


if __name__ == "__main__":
    if "--sandbox-start" in sys.argv:  # the sandboxes' start-up cost: bench/sandbox_start.py
        import sandbox_start

        sys.exit(sandbox_start.main(sys.argv[1:]))
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--levels", default="1,8,32", help="concurrency levels")
    parser.add_argument("--episodes", default="8,32,64", help="episodes at each level")
    parser.add_argument("--rounds", type=int, default=2, help="alternated rounds of each way per level")
    options = parser.parse_args()
    levels = [int(value) for value in options.levels.split(",")]
    counts = [int(value) for value in options.episodes.split(",")]
    if len(levels) != len(counts):
        parser.error("--levels and --episodes need as many values each")
    asyncio.run(main(levels, counts, options.rounds))
