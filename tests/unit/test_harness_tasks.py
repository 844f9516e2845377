"""Harness tasks, agents and rewards, read from files: the example tasks, bad task files, each agent's
rendered command line, config and environment, and the verifier's reward files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.errors import ConfigError
from pipeline.harness import AGENTS, ExecResult, agent_spec, harbor_task, load_tasks
from pipeline.harness.run import InfrastructureFailure, read_reward
from tests.support.harness import EXAMPLE_TASKS

VALUES = {
    "gateway_url": "http://10.0.0.1:8000",
    "base_url": "http://10.0.0.1:8000/v1",
    "api_key": "ts-SECRET",
    "instruction": "do it",
    "home": "/home/agent",
    "clis": "/opt/clis",
    "examples": "/opt/examples",
    "python": "/usr/bin/python3",
}


def test_the_example_tasks_load_with_their_timeouts_instructions_and_verifiers() -> None:
    tasks = {task.task_id: task for task in load_tasks([EXAMPLE_TASKS, EXAMPLE_TASKS / "tasks.jsonl"])}
    assert sorted(tasks) == ["fix-add", "fizzbuzz", "sum-to-file", "uppercase-file", "write-greeting"]
    greeting = tasks["write-greeting"]
    assert (greeting.agent_timeout_s, greeting.verifier_timeout_s) == (300.0, 60.0)
    assert greeting.verifier_env == {"EXPECTED": "hello turnstile"}
    assert greeting.instruction.startswith("Write the text `hello turnstile`")
    assert (greeting.allow_internet, greeting.cpus, greeting.memory_mib) == (False, 1, 1024)
    assert greeting.tests == EXAMPLE_TASKS / "write-greeting" / "tests"
    assert greeting.environment == EXAMPLE_TASKS / "write-greeting" / "environment"
    fix = tasks["fix-add"]
    assert fix.files == {"add.py": "def add(a, b):\n    return a - b\n"}
    assert fix.verifier_command is not None
    assert fix.tests is None


def test_harbor_defaults_apply_to_what_task_toml_leaves_out(tmp_path: Path) -> None:
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test.sh").write_text("true\n")
    (tmp_path / "instruction.md").write_text("x")
    (tmp_path / "task.toml").write_text('version = "1.0"\n[some_future_section]\nkey = 1\n')
    task = harbor_task(tmp_path)
    assert (task.agent_timeout_s, task.verifier_timeout_s, task.verifier_env) == (600.0, 600.0, {})


@pytest.mark.parametrize(
    ("toml", "named"),
    [("[agent]\ntimeout_sec = -1\n", "agent.timeout_sec"), ("[verifier\n", "task.toml is not valid")],
)
def test_a_bad_task_toml_is_refused_naming_the_file_and_key(tmp_path: Path, toml: str, named: str) -> None:
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test.sh").write_text("true\n")
    (tmp_path / "instruction.md").write_text("x")
    (tmp_path / "task.toml").write_text(toml)
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        harbor_task(tmp_path)


def test_bad_task_lists_are_refused_with_what_to_do(tmp_path: Path) -> None:
    (tmp_path / "task.toml").write_text("")
    with pytest.raises(ConfigError, match=r"not a Harbor task directory: instruction\.md is missing"):
        harbor_task(tmp_path)
    lines = tmp_path / "tasks.jsonl"
    lines.write_text('{"id": "a", "instruction": "x", "verifier": "true", "files": {"../up": ""}}\n')
    with pytest.raises(ConfigError, match=r"line 1: file '../up' must stay in the workspace"):
        load_tasks([lines])
    lines.write_text('{"id": "a", "instruction": "x"}\n')
    with pytest.raises(ConfigError, match="line 1: field verifier: Field required"):
        load_tasks([lines])
    with pytest.raises(ConfigError, match="given twice"):
        load_tasks([EXAMPLE_TASKS / "fizzbuzz", EXAMPLE_TASKS / "fizzbuzz"])


@pytest.mark.parametrize("name", [*AGENTS, "command"])
def test_every_agent_gets_the_key_in_its_environment_only_and_the_gateway_in_its_config(name: str) -> None:
    spec = agent_spec(name, "/bin/agent --flag" if name == "command" else None)
    rendered = spec.render(VALUES)
    assert "ts-SECRET" in rendered.env.values()
    assert not any("ts-SECRET" in text for text in rendered.files.values()), (
        "no key in a file the agent leaves"
    )
    assert not any("ts-SECRET" in part for part in rendered.argv), "no key on a command line (ps shows it)"
    assert "do it" in rendered.argv
    said = " ".join([*rendered.env.values(), *rendered.files.values()])
    assert "http://10.0.0.1:8000" in said
    if spec.uses_clis:
        assert rendered.argv[0].startswith("/opt/clis/node_modules/.bin/")


def test_the_opencode_and_codex_configs_are_the_documented_ones() -> None:
    opencode = json.loads(agent_spec("opencode").render(VALUES).files[".config/opencode/opencode.json"])
    assert opencode["$schema"] == "https://opencode.ai/config.json"
    assert opencode["provider"]["turnstile"]["options"]["baseURL"] == "http://10.0.0.1:8000/v1"
    codex = agent_spec("codex").render(VALUES).files[".codex/config.toml"]
    assert 'base_url = "http://10.0.0.1:8000/v1"' in codex
    assert 'env_key = "TURNSTILE_SESSION_KEY"' in codex


def test_unknown_agents_and_placeholders_are_refused() -> None:
    with pytest.raises(ConfigError, match="unknown agent 'aider'"):
        agent_spec("aider")
    with pytest.raises(ConfigError, match="needs --agent-command"):
        agent_spec("command")
    with pytest.raises(ConfigError, match="unknown or bad placeholder 'nope'"):
        agent_spec("command", "run $nope").render(VALUES)


def test_the_verifiers_reward_comes_from_reward_txt_or_reward_json(tmp_path: Path) -> None:
    ran = ExecResult(1, "Traceback: boom", 0.1)
    with pytest.raises(InfrastructureFailure, match=r"exited 1 and wrote no .*reward.txt.*Traceback: boom"):
        read_reward(tmp_path, ran)
    (tmp_path / "reward.json").write_text('{"accuracy": 0.25}')
    assert read_reward(tmp_path, ran) == 0.25  # one key: that is the reward
    (tmp_path / "reward.json").write_text('{"reward": 0.5, "style": 1}')
    assert read_reward(tmp_path, ran) == 0.5
    (tmp_path / "reward.txt").write_text("1\n")
    assert read_reward(tmp_path, ran) == 1.0
    (tmp_path / "reward.txt").write_text("pass\n")
    with pytest.raises(InfrastructureFailure, match="not a number"):
        read_reward(tmp_path, ran)
