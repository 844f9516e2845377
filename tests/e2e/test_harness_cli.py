"""A real agent CLI under the harness: Claude Code (pinned in tests/e2e/agent_clis) on a Harbor task in a
``--sandbox none`` sandbox, against a ``turnstile serve gateway`` process on the long-context tiny model
answering with tests/e2e/agent_clis/claude-code.script.json (write the file with Bash, delegate a check to a
subagent, answer). The harness writes its config, runs it headless and offline, and the task's own verifier
scores what it left on disk. Marker ``agent_cli``: run by that step of .ci/run."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.harness import agent_spec, backend, load_tasks, run_harness
from pipeline.log import EventStore
from schemas import EpisodeFinished, RewardAssigned, TurnCompleted
from tests.conftest import Servers
from tests.support.agent_gateway import CLIS, agent_gateway, cli_binary, episode_events
from tests.support.harness import SANDBOXES, harness_config

pytestmark = [pytest.mark.agent_cli, pytest.mark.parametrize("sandbox", SANDBOXES)]

PROMPT = "Write the word turnstile into written.txt, then have it checked."
TEST_SH = """#!/bin/bash
if [ "$(cat written.txt 2>/dev/null)" = turnstile ]; then r=1; else r=0; fi
echo $r > "${TURNSTILE_SANDBOX_ROOT:-}/logs/verifier/reward.txt"
"""


def harbor_task_dir(directory: Path) -> Path:
    (directory / "tests").mkdir(parents=True)
    (directory / "task.toml").write_text(
        'version = "1.0"\n[agent]\ntimeout_sec = 300.0\n[verifier]\ntimeout_sec = 60.0\n'
    )
    (directory / "instruction.md").write_text(PROMPT)
    (directory / "tests" / "test.sh").write_text(TEST_SH)
    return directory


async def test_claude_code_under_the_harness_passes_a_harbor_task_and_is_rewarded_1(
    sandbox: str, servers: Servers, database_url: str, store: EventStore, long_model_dir: Path, tmp_path: Path
) -> None:
    cli_binary("claude")
    tasks = load_tasks([harbor_task_dir(tmp_path / "claude-writes")])
    async with agent_gateway(
        servers.nats_url, database_url, long_model_dir, CLIS / "claude-code.script.json"
    ) as gateway:
        config = harness_config(
            gateway, tmp_path / "state", agent=agent_spec("claude-code"), clis=CLIS, retries=0
        )
        harness = await run_harness(config, tasks, backend(sandbox))

    [attempt] = harness.stats.attempts
    assert (attempt.outcome, attempt.reward) == ("passed", 1.0), attempt.cause
    assert attempt.session_id is not None
    events = await episode_events(store, attempt.session_id)
    turns = [e for e in events if isinstance(e, TurnCompleted)]
    assert len(turns) == attempt.turns == 4  # command, delegation, the subagent's call, the answer
    assert [e.value for e in events if isinstance(e, RewardAssigned)] == [1.0]
    assert isinstance(events[-1], EpisodeFinished)
    assert events[-1].termination == "done"


PROOF_PROMPT = "Write 'turnstile was here' into proof.txt with a shell command."
PROOF_TEST_SH = """#!/bin/bash
if [ "$(cat proof.txt 2>/dev/null)" = "turnstile was here" ]; then r=1; else r=0; fi
echo $r > "${TURNSTILE_SANDBOX_ROOT:-}/logs/verifier/reward.txt"
"""
BINARIES = {"codex": "codex", "opencode": "opencode", "openai-agents": None}
"""The other agents the harness knows, each on the script its own CLI test uses (run a shell command that
writes proof.txt, then answer); the Agents SDK example runs on this Python, no npm binary."""


@pytest.mark.parametrize("agent", sorted(BINARIES))
async def test_every_agent_under_the_harness_passes_a_harbor_task_and_is_rewarded_1(
    agent: str,
    sandbox: str,
    servers: Servers,
    database_url: str,
    store: EventStore,
    long_model_dir: Path,
    tmp_path: Path,
) -> None:
    if (binary := BINARIES[agent]) is not None:
        cli_binary(binary)
    task = harbor_task_dir(tmp_path / f"{agent}-proof")
    (task / "instruction.md").write_text(PROOF_PROMPT)
    (task / "tests" / "test.sh").write_text(PROOF_TEST_SH)
    async with agent_gateway(
        servers.nats_url, database_url, long_model_dir, CLIS / f"{agent}.script.json"
    ) as gateway:
        config = harness_config(gateway, tmp_path / "state", agent=agent_spec(agent), clis=CLIS, retries=0)
        harness = await run_harness(config, load_tasks([task]), backend(sandbox))

    [attempt] = harness.stats.attempts
    assert (attempt.outcome, attempt.reward) == ("passed", 1.0), attempt.cause
    assert attempt.session_id is not None
    events = await episode_events(store, attempt.session_id)
    turns = [e for e in events if isinstance(e, TurnCompleted)]
    assert len(turns) == attempt.turns >= 2  # the shell command, the answer (and opencode's title call)
    assert [e.value for e in events if isinstance(e, RewardAssigned)] == [1.0]
    assert isinstance(events[-1], EpisodeFinished)
    assert events[-1].termination == "done"
