"""Harbor's own task loader (``harbor`` on PyPI, Python 3.12+) accepts every example task directory and reads
the same instruction, time limits, verifier environment and network setting as pipeline/harness/tasks.py.

Harbor needs Python >= 3.12 and the project runs on 3.11, so the test builds a virtualenv of its own with the
first Python 3.12 it finds (pyenv's, or ``python3.12`` on PATH), cached in build/harbor-venv. Marker
``harbor``: its own step in .ci/run (the install takes minutes the first time)."""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from pipeline.harness import load_tasks
from tests.support.harness import EXAMPLE_TASKS, REPOSITORY

pytestmark = pytest.mark.harbor

HARBOR = "harbor==0.26.0"
VENV = REPOSITORY / "build" / "harbor-venv"
READ_WITH_HARBOR = """
import json, sys
from harbor.models.task.task import Task

tasks = {}
for directory in sys.argv[1:]:
    task = Task(directory)
    config = task.config
    tasks[task.name] = {
        "instruction": task.instruction,
        "agent_timeout_s": config.agent.timeout_sec,
        "verifier_timeout_s": config.verifier.timeout_sec,
        "verifier_env": config.verifier.env,
        "allow_internet": config.environment.network_mode.value == "public",
        "cpus": config.environment.cpus,
        "memory_mib": config.environment.memory_mb,
    }
print(json.dumps(tasks))
"""


def python312() -> str:
    found = sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.1[2-9]*/bin/python")))
    candidate = found[0] if found else shutil.which("python3.12")
    if candidate is None:
        pytest.fail("Harbor needs Python 3.12+: install one (pyenv install 3.12, or Debian's python3.12)")
    return candidate


def harbor_python() -> Path:
    """build/harbor-venv/bin/python with Harbor installed (made once, then reused)."""
    python = VENV / "bin" / "python"
    if not python.exists() or subprocess.run([python, "-c", "import harbor"], check=False).returncode:
        subprocess.run([python312(), "-m", "venv", VENV], check=True)
        subprocess.run([python, "-m", "pip", "install", "-q", HARBOR], check=True)
    return python


def test_harbor_reads_every_example_task_as_the_harness_does() -> None:
    directories = sorted(path for path in EXAMPLE_TASKS.iterdir() if (path / "task.toml").is_file())
    assert len(directories) >= 3
    ran = subprocess.run(
        [harbor_python(), "-W", "ignore::DeprecationWarning", "-c", READ_WITH_HARBOR, *map(str, directories)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    harbor = json.loads(ran.stdout)
    ours = {task.task_id: task for task in load_tasks(directories)}
    assert sorted(harbor) == sorted(ours)
    for name, read in harbor.items():
        task = ours[name]
        assert read == {
            "instruction": task.instruction,
            "agent_timeout_s": task.agent_timeout_s,
            "verifier_timeout_s": task.verifier_timeout_s,
            "verifier_env": dict(task.verifier_env),
            "allow_internet": task.allow_internet,
            "cpus": task.cpus,
            "memory_mib": task.memory_mib,
        }, name
    assert "canary" not in ours["sum-to-file"].instruction  # stripped, as Harbor does
