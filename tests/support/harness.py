"""What the harness tests share: the sandbox backends they run under, the scripted policy the command agent
meets, and a harness config pointed at a test's gateway."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from pipeline.harness import HarnessConfig, agent_spec, python_mounts
from pipeline.harness.backends.hostdirs import read_owner
from pipeline.harness.backends.process import sandboxes_root
from tests.support.agent_gateway import AgentGateway

REPOSITORY = Path(__file__).resolve().parents[2]
EXAMPLE_TASKS = REPOSITORY / "examples" / "harness-tasks"
SCRIPT = Path(__file__).resolve().parent / "harness.script.json"
"""The scripted policy: run_shell writes greeting.txt when asked for it, sleeps when asked to wait, does
something useless otherwise, and answers "Done." after a tool result."""
SHELL_AGENT = f"{sys.executable} {REPOSITORY / 'examples' / 'harness_shell_agent.py'}"
SANDBOXES = os.environ.get("TURNSTILE_HARNESS_SANDBOXES", "none").split(",")
"""The backends the harness tests run under: ``none`` here; CI adds ``bwrap``
(``TURNSTILE_HARNESS_SANDBOXES=none,bwrap``)."""


def admin_key(gateway: AgentGateway) -> str:
    return str(gateway.admin.headers["Authorization"]).removeprefix("Bearer ")


def interpreter_mounts() -> dict[Path, str]:
    """This Python and the examples, each mounted at its own host path, so that ``SHELL_AGENT``'s host paths
    work inside an isolating sandbox (bwrap) too."""
    return python_mounts() | {REPOSITORY / "examples": str(REPOSITORY / "examples")}


def mount_options() -> list[str]:
    """``interpreter_mounts`` as ``turnstile harness run --mount`` options."""
    return [arg for host, inside in interpreter_mounts().items() for arg in ("--mount", f"{host}:{inside}")]


def harness_config(gateway: AgentGateway, state_dir: Path, **settings: Any) -> HarnessConfig:
    """The command agent (examples/harness_shell_agent.py, unless ``agent`` is given) against ``gateway``, an
    owner of its own."""
    options: dict[str, Any] = {
        "owner": f"test-{os.getpid()}-{state_dir.name}",
        "concurrency": 2,
        "agent": agent_spec("command", SHELL_AGENT),
        "mounts": interpreter_mounts(),
    } | settings
    return HarnessConfig(
        gateway=gateway.url,
        admin_key=admin_key(gateway),
        state_dir=state_dir,
        policy=gateway.policy,
        **options,
    )


def owned_sandboxes(owner: str, tmp: Path | None = None) -> list[Path]:
    """The sandbox directories of ``owner``: ``<root>/<owner>/*`` (none) or ``<root>/sandbox-*`` whose owner
    file names it (bwrap, docker)."""
    root = tmp / "turnstile-sandboxes" if tmp else sandboxes_root()
    mine = sorted((root / owner).iterdir()) if (root / owner).is_dir() else []
    for directory in root.glob("sandbox-*") if root.is_dir() else []:
        found = read_owner(directory)
        if found is not None and found.label == owner:
            mine.append(directory)
    return mine
