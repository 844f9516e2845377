"""``turnstile harness run`` and ``turnstile serve harness``: agent CLIs per task in sandboxes, verified,
rewards posted to a gateway."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from consumers.cli.common import console, tags
from pipeline.errors import ConfigError
from pipeline.settings import Settings

if TYPE_CHECKING:
    from pipeline.harness import HarnessConfig

AGENTS_HELP = "claude-code | codex | opencode | openai-agents | command (with --agent-command)"


def run(
    tasks: list[Path] = typer.Argument(
        ..., help="Harbor task directories, directories of them, or JSONL task files"
    ),
    agent: str = typer.Option(..., help=AGENTS_HELP),
    agent_command: str = typer.Option(
        None,
        help="--agent command: the program to run (the instruction is its last argument; the gateway and "
        "key in OPENAI_BASE_URL / OPENAI_API_KEY, ANTHROPIC_*, TURNSTILE_BASE_URL / TURNSTILE_SESSION_KEY)",
    ),
    group_size: int = typer.Option(1, help="episodes per task (one group, for group-relative advantages)"),
    concurrency: int = typer.Option(4, help="episodes (sandboxes) at a time"),
    retries: int = typer.Option(1, help="times an episode that failed for infrastructure runs again (new)"),
    sandbox: str = typer.Option(
        "none", help="the sandbox backend: none (a temp dir: isolates nothing), bwrap, docker, kubernetes"
    ),
    gateway: str = typer.Option(
        ...,
        envvar="TURNSTILE_GATEWAY_URL",
        help="the gateway's URL (http://host:port) as this machine reaches it",
    ),
    admin_key_env: str = typer.Option(
        "TURNSTILE_ADMIN_KEY",
        "--admin-key-env",
        help="the environment variable holding the gateway's admin key",
    ),
    sandbox_gateway: str = typer.Option(
        None, help="host:port at which sandboxes reach the gateway \\[default: that of --gateway]"
    ),
    policy: str = typer.Option(None, help="the policy \\[default: the gateway's --policy-default]"),
    owner: str = typer.Option(
        None,
        help="this harness's name: its sandboxes' label; the next run of the same owner removes what a "
        "killed one left \\[default: harness-<hostname>]",
    ),
    clis: Path = typer.Option(None, help="the pre-built agent CLIs (node_modules inside), mounted read-only"),
    tag: list[str] = typer.Option([], help="key=value recorded with every episode (repeatable)"),
    mount: list[str] = typer.Option(
        [], help="HOST_DIR:INSIDE_PATH mounted read-only in every sandbox (repeatable), e.g. a command's venv"
    ),
) -> None:
    """Run AGENT on every task GROUP_SIZE times, each in a sandbox, verified; Ctrl-C ends cleanly."""
    import asyncio

    from consumers.harness import harness_run
    from pipeline.harness import load_tasks

    config = harness_config(
        gateway, admin_key_env, agent, agent_command, owner, policy, clis, sandbox_gateway, tag, mount,
        group_size=group_size, concurrency=concurrency, retries=retries,
    )  # fmt: skip
    loaded = load_tasks(tasks)
    result = asyncio.run(harness_run(config, loaded, sandbox, console))
    console.print(result.stats.table("cancelled" if result.cancelled else "finished"))
    for cause, count in result.stats.causes().most_common(5):
        console.print(f"  {count} x {cause}", markup=False, highlight=False, soft_wrap=True)
    if result.cancelled:
        raise SystemExit(130)


def serve(
    agent: str = typer.Option(..., help=AGENTS_HELP),
    policy: str = typer.Option(
        ..., help="take tasks from harness.tasks.<policy> (`turnstile submit --harness`)"
    ),
    agent_command: str = typer.Option(None, help="--agent command: the program to run"),
    concurrency: int = typer.Option(4, help="episodes (sandboxes) at a time on this machine"),
    retries: int = typer.Option(1, help="times an episode that failed for infrastructure runs again (new)"),
    sandbox: str = typer.Option("none", help="the sandbox backend (none isolates nothing)"),
    gateway: str = typer.Option(..., envvar="TURNSTILE_GATEWAY_URL", help="the gateway's URL"),
    admin_key_env: str = typer.Option("TURNSTILE_ADMIN_KEY", "--admin-key-env", help="holds the admin key"),
    sandbox_gateway: str = typer.Option(None, help="host:port at which sandboxes reach the gateway"),
    owner: str = typer.Option(None, help="this harness's name \\[default: harness-<hostname>]"),
    clis: Path = typer.Option(None, help="the pre-built agent CLIs (node_modules inside)"),
    tag: list[str] = typer.Option([], help="key=value recorded with every episode (repeatable)"),
    mount: list[str] = typer.Option([], help="HOST_DIR:INSIDE_PATH mounted read-only (repeatable)"),
    ack_wait: float = typer.Option(
        60.0, help="seconds without progress before a task goes to another harness"
    ),
) -> None:
    """Take harness tasks from the HARNESS_TASKS work queue and run them, on as many machines as you like."""
    from consumers.harness import serve_harness
    from consumers.runtime import run as run_service
    from consumers.runtime import setup_logging

    setup_logging()
    config = harness_config(
        gateway, admin_key_env, agent, agent_command, owner, policy, clis, sandbox_gateway, tag, mount,
        concurrency=concurrency, retries=retries,
    )  # fmt: skip
    run_service(serve_harness(config, sandbox, Settings().require_nats_url(), console, ack_wait=ack_wait))


def harness_config(
    gateway: str,
    admin_key_env: str,
    agent: str,
    agent_command: str | None,
    owner: str | None,
    policy: str | None,
    clis: Path | None,
    sandbox_gateway: str | None,
    tag: list[str],
    mount: list[str],
    *,
    concurrency: int,
    retries: int,
    group_size: int = 1,
) -> HarnessConfig:
    """The harness's configuration from the options ``harness run`` and ``serve harness`` share."""
    from pipeline.harness import DEFAULT_CLIS, HarnessConfig, agent_spec

    admin_key = os.environ.get(admin_key_env, "").strip()
    if not admin_key:
        raise ConfigError(f"no admin key: set {admin_key_env} to the gateway's admin key")
    return HarnessConfig(
        gateway=gateway,
        admin_key=admin_key,
        agent=agent_spec(agent, agent_command),
        owner=owner or f"harness-{socket.gethostname()}",
        state_dir=Settings().data_dir / "harness",
        policy=policy,
        clis=clis or DEFAULT_CLIS,
        sandbox_gateway=sandbox_gateway,
        tags=tags(tag),
        mounts=mounts(mount),
        concurrency=concurrency,
        retries=retries,
        group_size=group_size,
    )


def mounts(pairs: list[str]) -> dict[Path, str]:
    found = {}
    for pair in pairs:
        host, sep, inside = pair.rpartition(":")
        if not sep or not host or not inside.startswith("/"):
            raise ConfigError(f"--mount {pair!r}: write it as HOST_DIR:/path/inside")
        found[Path(host).resolve()] = inside
    return found
