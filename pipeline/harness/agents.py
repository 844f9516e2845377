"""Agents as data: for each agent the config files it reads from its HOME, its headless command line, the
environment that points it at the gateway with the session's key and keeps it offline, and where its
binary comes from (a pre-built directory mounted read-only: never installed per sandbox).

Values are ``string.Template`` text (``$name``), filled per rollout with:

- ``$gateway_url``: the gateway as the sandbox reaches it (no ``/v1``); ``$base_url``: the same with ``/v1``
- ``$api_key``: the session's key (only ever in the agent's environment, never in a file or the verifier's)
- ``$instruction``: the task's prompt; ``$home``: the agent's HOME inside the sandbox
- ``$clis``: where the pre-built agent CLIs directory is mounted (``node_modules/.bin/<cli>`` inside)
- ``$python``, ``$examples``: the harness's Python and the repository's examples/ (the Agents SDK example)

What each CLI needs was found by running it offline against the gateway (tests/e2e/test_agent_*.py and
docs/agent-clis.md): without the ``*_DISABLE_*`` variables they reach their vendors' servers.
"""

from __future__ import annotations

import json
import shlex
import string
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.errors import ConfigError

CLIS_INSIDE = "/opt/turnstile/agent-clis"
"""Where the pre-built agent CLIs directory is mounted in a sandbox."""
EXAMPLES_INSIDE = "/opt/turnstile/examples"
REPOSITORY = Path(__file__).resolve().parents[2]
DEFAULT_CLIS = REPOSITORY / "tests" / "e2e" / "agent_clis"
"""The CLIs pinned for the tests (``npm ci --prefix tests/e2e/agent_clis``)."""
DEAD_PROXY = "http://127.0.0.1:9"
"""A proxy nothing listens on (the discard port): whatever an agent would fetch from outside fails at once."""


@dataclass(frozen=True)
class AgentSpec:
    """One agent, as data."""

    name: str
    argv: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)
    files: Mapping[str, str] = field(default_factory=dict)
    """Config files, path relative to HOME -> text."""
    uses_clis: bool = False
    """Whether it runs from the pre-built CLIs directory (mounted read-only at ``CLIS_INSIDE``)."""
    untrained_models: tuple[str, ...] = ()
    """Model-name patterns of its side calls, recorded but not trained (``POST /admin/sessions``)."""

    def render(self, values: Mapping[str, str]) -> RenderedAgent:
        """The command line, environment and files with ``values`` filled in; an unknown ``$name`` in a
        user's command is a ``ConfigError``."""
        try:
            return RenderedAgent(
                argv=[string.Template(part).substitute(values) for part in self.argv],
                env={key: string.Template(value).substitute(values) for key, value in self.env.items()},
                files={path: string.Template(text).substitute(values) for path, text in self.files.items()},
            )
        except (KeyError, ValueError) as error:
            raise ConfigError(
                f"agent {self.name!r}: unknown or bad placeholder {error} (known: {', '.join(values)})"
            ) from None


@dataclass(frozen=True)
class RenderedAgent:
    argv: list[str]
    env: dict[str, str]
    files: dict[str, str]


def base_env(home: str, gateway_host: str) -> dict[str, str]:
    """What every program in a sandbox gets: HOME and XDG directories in ``home``, a UTF-8 locale, a PATH
    with the system's tools, every proxy variable at a port nothing listens on, the gateway exempt."""
    env = {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": home,
        "LANG": "C.UTF-8",
        "XDG_CONFIG_HOME": f"{home}/.config",
        "XDG_DATA_HOME": f"{home}/.local/share",
        "XDG_CACHE_HOME": f"{home}/.cache",
        "XDG_STATE_HOME": f"{home}/.local/state",
        "NO_PROXY": f"{gateway_host},127.0.0.1,localhost",
        "no_proxy": f"{gateway_host},127.0.0.1,localhost",
    }
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
        env[name] = env[name.lower()] = DEAD_PROXY
    return env


CLAUDE_CODE = AgentSpec(
    name="claude-code",
    argv=(
        "$clis/node_modules/.bin/claude",
        "-p",
        "$instruction",
        # as root --dangerously-skip-permissions is refused; allowing the tools works for any user
        "--allowedTools",
        "Bash",
        "Edit",
        "Write",
        "Read",
        "Glob",
        "Grep",
        "Agent",
    ),
    env={
        "ANTHROPIC_BASE_URL": "$gateway_url",  # without /v1: it posts to $ANTHROPIC_BASE_URL/v1/messages
        "ANTHROPIC_API_KEY": "$api_key",
        "CLAUDE_CONFIG_DIR": "$home/.claude",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_AUTOUPDATER": "1",
        "DISABLE_ERROR_REPORTING": "1",
    },
    uses_clis=True,
    untrained_models=("claude-haiku-*",),
)

CODEX = AgentSpec(
    name="codex",
    argv=(
        "$clis/node_modules/.bin/codex",
        "exec",
        "--skip-git-repo-check",
        "--dangerously-bypass-approvals-and-sandbox",
        "$instruction",
    ),
    env={"CODEX_HOME": "$home/.codex", "TURNSTILE_SESSION_KEY": "$api_key"},
    files={
        ".codex/config.toml": """\
model = "main"
model_provider = "turnstile"

[analytics]
enabled = false

[model_providers.turnstile]
name = "turnstile"
base_url = "$base_url"
env_key = "TURNSTILE_SESSION_KEY"
wire_api = "responses"
"""
    },
    uses_clis=True,
)

OPENCODE = AgentSpec(
    name="opencode",
    argv=("$clis/node_modules/.bin/opencode", "run", "$instruction"),
    env={
        "TURNSTILE_SESSION_KEY": "$api_key",
        "OPENCODE_DISABLE_MODELS_FETCH": "1",
        "OPENCODE_DISABLE_AUTOUPDATE": "1",
        "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
        "OPENCODE_DISABLE_DEFAULT_PLUGINS": "1",
        "OPENCODE_DISABLE_SHARE": "1",
        "OPENCODE_DISABLE_PROJECT_CONFIG": "1",
    },
    files={
        ".config/opencode/opencode.json": json.dumps(
            {
                "$$schema": "https://opencode.ai/config.json",
                "provider": {
                    "turnstile": {
                        "npm": "@ai-sdk/openai-compatible",
                        "name": "Turnstile",
                        "options": {"baseURL": "$base_url", "apiKey": "{env:TURNSTILE_SESSION_KEY}"},
                        "models": {"main": {"name": "main"}},
                    }
                },
                "model": "turnstile/main",
                "small_model": "turnstile/main",
                "autoupdate": False,
                "share": "disabled",
                "permission": {"bash": "allow", "edit": "allow"},
            },
            indent=2,
        )
    },
    uses_clis=True,
)

OPENAI_AGENTS = AgentSpec(
    name="openai-agents",
    argv=("$python", "$examples/openai_agents_shell.py", "$instruction"),
    env={
        "OPENAI_BASE_URL": "$base_url",
        "OPENAI_API_KEY": "$api_key",
        "OPENAI_AGENTS_DISABLE_TRACING": "1",  # or it uploads traces to OpenAI with the session's key
    },
)

COMMAND_ENV: Mapping[str, str] = {
    "OPENAI_BASE_URL": "$base_url",
    "OPENAI_API_KEY": "$api_key",
    "ANTHROPIC_BASE_URL": "$gateway_url",
    "ANTHROPIC_API_KEY": "$api_key",
    "TURNSTILE_BASE_URL": "$base_url",
    "TURNSTILE_SESSION_KEY": "$api_key",
}
"""What "command" gives any program: the gateway and the key under the names the SDKs read."""

AGENTS: Mapping[str, AgentSpec] = {spec.name: spec for spec in (CLAUDE_CODE, CODEX, OPENCODE, OPENAI_AGENTS)}


def command_agent(command: str) -> AgentSpec:
    """Any program: ``command`` (a shell-style command line, ``$placeholders`` allowed), the task's
    instruction as its last argument, the gateway and key in ``COMMAND_ENV``."""
    argv = shlex.split(command)
    if not argv:
        raise ConfigError("--agent command needs --agent-command 'PROGRAM ARGS...'")
    return AgentSpec(name="command", argv=(*argv, "$instruction"), env=COMMAND_ENV)


def agent_spec(name: str, command: str | None = None) -> AgentSpec:
    """The agent ``name`` (one of ``AGENTS``, or ``command`` with ``command``)."""
    if name == "command":
        return command_agent(command or "")
    if command:
        raise ConfigError(f"--agent-command is for --agent command, not {name!r}")
    if name not in AGENTS:
        raise ConfigError(f"unknown agent {name!r}: choose one of {', '.join([*AGENTS, 'command'])}")
    return AGENTS[name]


def host_values() -> dict[str, str]:
    """Placeholders that name things of the harness's own machine (the Agents SDK example's Python)."""
    return {"python": sys.executable}


def python_mounts() -> dict[Path, str]:
    """This Python (its virtualenv and the interpreter it was made from), each to be mounted at its own host
    path, so that ``$python`` and the packages it imports work inside an isolating sandbox (bwrap) too; what
    a sandbox binds already (``/usr``) is left out."""
    wanted = {Path(sys.prefix), Path(sys.base_prefix)}
    return {path: str(path) for path in wanted if not str(path.resolve()).startswith("/usr")}
