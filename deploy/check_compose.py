"""Checks docker-compose.yml against the code it runs, without Docker: ``python deploy/check_compose.py``.

- every ``turnstile ...`` a service runs (its command, or the ``turnstile`` lines of an ``sh -c`` script) is
  parsed by the real CLI: the subcommand exists, every option is known, required options are there and
  values have the right type (nothing is run);
- every healthcheck script it names exists under deploy/;
- ``depends_on`` names services, named volumes are declared;
- the NATS users in ``TURNSTILE_NATS_URL`` are users of deploy/nats.conf, the PostgreSQL users in
  ``TURNSTILE_DATABASE_URL`` are made by deploy/postgres-init.sql (or are the owner, ``POSTGRES_USER``), and
  the password variables those files read are given to their containers.

Variables are interpolated as compose does (``${VAR:-default}``), from this process's environment. Exit 0
and a summary when all is well; exit 1 with one line per problem. ``tests/e2e/test_deploy.py`` runs it too,
and runs the compose services as local processes.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
COMPOSE_FILE = ROOT / "docker-compose.yml"
NATS_CONF = ROOT / "deploy" / "nats.conf"
POSTGRES_INIT = ROOT / "deploy" / "postgres-init.sql"
IMAGE_DEPLOY_DIR = "/app/deploy"  # where the Dockerfile copies deploy/

_VARIABLE = re.compile(r"\$\$|\$\{(?P<braced>\w+)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}|\$(?P<plain>\w+)")


class ComposeError(Exception):
    """The compose file cannot be read or interpolated."""


def interpolate(value: str, env: Mapping[str, str]) -> str:
    """Compose's variable substitution: ``$$``, ``$VAR``, ``${VAR}``, ``${VAR:-d}``, ``${VAR-d}``,
    ``${VAR:?message}``, ``${VAR?message}``."""

    def substitute(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group("braced") or match.group("plain")
        op, arg = match.group("op"), match.group("arg") or ""
        found = env.get(name)
        missing = found is None or (found == "" and op is not None and op.startswith(":"))
        if op in ("-", ":-"):
            return arg if missing else str(found)
        if op in ("?", ":?") and missing:
            raise ComposeError(f"variable {name} is required: {arg}")
        return found or ""

    return _VARIABLE.sub(substitute, value)


def _interpolated(node: Any, env: Mapping[str, str]) -> Any:
    if isinstance(node, str):
        return interpolate(node, env)
    if isinstance(node, list):
        return [_interpolated(item, env) for item in node]
    if isinstance(node, dict):
        return {key: _interpolated(value, env) for key, value in node.items()}
    return node


def load_compose(path: Path = COMPOSE_FILE, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The compose file with its YAML merge keys applied and its variables interpolated."""
    import yaml

    try:
        loaded = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as error:
        raise ComposeError(f"cannot read {path}: {error}") from None
    if not isinstance(loaded, dict) or not isinstance(loaded.get("services"), dict):
        raise ComposeError(f"{path}: no services")
    result: dict[str, Any] = _interpolated(loaded, os.environ if env is None else env)
    return result


def service_environment(service: Mapping[str, Any]) -> dict[str, str]:
    environment = service.get("environment") or {}
    if isinstance(environment, list):
        pairs = (item.partition("=") for item in environment)
        return {key: value for key, _, value in pairs}
    return {str(key): "" if value is None else str(value) for key, value in environment.items()}


def as_list(value: Any) -> list[str]:
    if value is None:
        return []
    return shlex.split(value) if isinstance(value, str) else [str(item) for item in value]


def runs_turnstile_image(service: Mapping[str, Any]) -> bool:
    """Runs an image built from this repository (whose ENTRYPOINT is ``turnstile``): the service that builds
    it, or one that runs its tag and is never pulled (``pull_policy: never``)."""
    return "build" in service or service.get("pull_policy") == "never"


def image_problems(services: Mapping[str, Any]) -> list[str]:
    """One build per image: a tag is built by one service (``pull_policy: build``: never looked for on a
    registry), and a service that runs a tag without building it never pulls it and runs a built one."""
    found: list[str] = []
    built: dict[str, str] = {}
    for name, service in services.items():
        if "build" in service:
            image = service.get("image")
            if image in built:
                found.append(f"service {name}: builds {image} again (built by {built[image]})")
            built[str(image)] = name
            if service.get("pull_policy") != "build":
                found.append(
                    f"service {name}: builds {image} without pull_policy: build (a registry is asked first)"
                )
    for name, service in services.items():
        if (
            "build" not in service
            and service.get("pull_policy") == "never"
            and service.get("image") not in built
        ):
            found.append(f"service {name}: runs {service.get('image')}, which no service builds")
    return found


def turnstile_invocations(service: Mapping[str, Any]) -> list[list[str]]:
    """The argument lists this service passes to ``turnstile``."""
    if not runs_turnstile_image(service):
        return []
    entrypoint, command = as_list(service.get("entrypoint")), as_list(service.get("command"))
    if not entrypoint:
        return [command]
    if entrypoint[-1] == "-c" and Path(entrypoint[0]).name in ("sh", "bash"):
        return list(_script_invocations(" ".join(command)))
    if Path(entrypoint[0]).name == "turnstile":
        return [entrypoint[1:] + command]
    return []


def _script_invocations(script: str) -> Iterator[list[str]]:
    """The ``turnstile ...`` commands of a shell script, each up to the next ``;``, ``&&``, ``}`` ..."""
    lexer = shlex.shlex(script, posix=True, punctuation_chars=";&|(){}")
    lexer.whitespace_split = True
    tokens = list(lexer)
    for start, token in enumerate(tokens):
        if token == "turnstile" or token.endswith("/turnstile"):
            args = []
            for item in tokens[start + 1 :]:
                if item and all(c in ";&|(){}" for c in item):
                    break
                args.append(item)
            yield args


def check_invocation(args: list[str]) -> str | None:
    """None if the CLI accepts ``turnstile ARGS`` (parsed, not run); else what it refused."""
    import typer

    from consumers.cli import app

    # Typer's own click: groups are the commands that resolve subcommands; errors have format_message().
    command: Any = typer.main.get_command(app)
    parent, rest, path = None, list(args), ["turnstile"]
    try:
        while hasattr(command, "resolve_command"):
            context = command.make_context(path[-1], [], parent=parent, resilient_parsing=True)
            if not rest or rest[0].startswith("-"):
                choices = ", ".join(sorted(command.list_commands(context)))
                return f"`{' '.join(path)}` needs a subcommand ({choices})"
            token = rest[0]
            name, found, rest = command.resolve_command(context, rest)
            if found is None or name is None:
                return f"`{' '.join(path)}` has no subcommand {token!r}"
            path.append(name)
            command, parent = found, context
        command.make_context(path[-1], list(rest), parent=parent)
    except Exception as error:
        describe = getattr(error, "format_message", None)
        if describe is None:
            raise
        return f"`{' '.join(path)}`: {describe()}"
    return None


def _healthcheck_scripts(service: Mapping[str, Any]) -> Iterator[str]:
    test = (service.get("healthcheck") or {}).get("test") or []
    for item in as_list(test):
        if item.startswith(IMAGE_DEPLOY_DIR + "/"):
            yield item


def _nats_users() -> set[str]:
    return set(re.findall(r"\{\s*user:\s*(\w+)", NATS_CONF.read_text()))


def _postgres_users() -> set[str]:
    text = POSTGRES_INIT.read_text()
    made = re.search(r"CREATE ROLE %I LOGIN'.*?VALUES(?P<names>[^;]*?)\)\s*AS users", text, re.S)
    return set(re.findall(r"'(\w+)'", made.group("names"))) if made else set()


def _required_variables(text: str) -> set[str]:
    """``$TURNSTILE_X`` (nats.conf) and ``${TURNSTILE_X:?...}`` (shell): variables without a default."""
    return set(re.findall(r"\$(TURNSTILE_\w+)", text)) | set(re.findall(r"\$\{(TURNSTILE_\w+):?\?", text))


def problems(compose: Mapping[str, Any]) -> list[str]:
    """What is wrong with the interpolated compose file; empty when nothing is."""
    found: list[str] = []
    services: dict[str, Any] = compose["services"]
    volumes = set((compose.get("volumes") or {}).keys())
    nats_users, postgres_users = _nats_users(), _postgres_users()
    found.extend(image_problems(services))
    for name, service in services.items():
        for args in turnstile_invocations(service):
            if (refused := check_invocation(args)) is not None:
                found.append(f"service {name}: {refused}")
        if runs_turnstile_image(service) and not turnstile_invocations(service):
            found.append(f"service {name}: runs no turnstile command")
        for script in _healthcheck_scripts(service):
            if not (ROOT / "deploy" / script[len(IMAGE_DEPLOY_DIR) + 1 :]).is_file():
                found.append(f"service {name}: healthcheck script {script} is not in deploy/")
        for dependency in service.get("depends_on") or {}:
            if dependency not in services:
                found.append(f"service {name}: depends on {dependency!r}, which is no service")
        for mount in service.get("volumes") or []:
            source = (mount.get("source") if isinstance(mount, dict) else str(mount).split(":")[0]) or ""
            if source and not source.startswith((".", "/", "~", "$")) and source not in volumes:
                found.append(f"service {name}: volume {source!r} is not declared under volumes:")
        environment = service_environment(service)
        nats_user = re.match(r"nats://(\w+):", environment.get("TURNSTILE_NATS_URL", ""))
        if nats_user and nats_user.group(1) not in nats_users:
            found.append(f"service {name}: NATS user {nats_user.group(1)!r} is not in deploy/nats.conf")
        postgres_user = re.match(r"postgres(?:ql)?://(\w+):", environment.get("TURNSTILE_DATABASE_URL", ""))
        owner = service_environment(services.get("postgres", {})).get("POSTGRES_USER")
        if postgres_user and postgres_user.group(1) not in postgres_users | {owner}:
            found.append(
                f"service {name}: PostgreSQL user {postgres_user.group(1)!r} is not made by "
                "deploy/postgres-init.sql"
            )
    for server, config in (("nats", NATS_CONF), ("postgres", POSTGRES_INIT.with_suffix(".sh"))):
        given = set(service_environment(services.get(server, {})))
        for variable in sorted(_required_variables(config.read_text()) - given):
            found.append(
                f"service {server}: {config.name} reads {variable}, which its environment does not set"
            )
    return found


def main() -> int:
    try:
        compose = load_compose()
    except ComposeError as error:
        print(f"docker-compose.yml: {error}", file=sys.stderr)
        return 1
    found = problems(compose)
    for problem in found:
        print(f"docker-compose.yml: {problem}", file=sys.stderr)
    if found:
        return 1
    commands = [
        f"{name}: turnstile {' '.join(args)}"
        for name, service in compose["services"].items()
        for args in turnstile_invocations(service)
    ]
    services = len(compose["services"])
    print(f"docker-compose.yml: {services} services; these commands parse with the turnstile CLI:")
    for line in commands:
        print(f"  {line}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
