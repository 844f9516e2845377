"""Tasks the harness runs: Harbor's task directories, read as they are, and a JSONL form for simple tasks.

A Harbor task directory (https://harborframework.com/docs, ``harbor`` on PyPI)::

    my-task/
      task.toml          # [agent] timeout_sec; [environment] network_mode (or the older allow_internet),
                         # docker_image, cpus, memory_mb;
                         # [verifier] timeout_sec, env
      instruction.md     # the prompt the agent gets
      environment/       # the sandbox's build context (Dockerfile) for image backends
      tests/test.sh      # the verifier: copied in only after the agent ran; writes
                         # /logs/verifier/reward.txt (a number) or reward.json ({"reward": x})

``task.toml`` is read tolerantly (keys this module does not use are ignored, as Harbor adds them); the values
it uses are checked, and a bad one is a ``ConfigError`` naming the file and the key. Checked against Harbor
0.26's own loader by tests/integration/test_harbor_tasks.py.

A JSONL line is a task of its own: ``{"id": ..., "instruction": ..., "files": {"path": "text"},
"verifier": "shell command", "agent_timeout_sec": ..., "verifier_timeout_sec": ...}``; the verifier command
runs in the workspace and passes with exit status 0 (reward 1) or fails (reward 0).
"""

from __future__ import annotations

import json
import re
import tomllib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pipeline.errors import ConfigError, describe_validation_error

HARBOR_TIMEOUT_S = 600.0
"""Harbor's default verifier time limit; also the agent's where the task gives none (Harbor's agent has no
limit then: a harness that trains must bound every rollout)."""
CANARY_LINE = re.compile(r"^(<!--.*canary.*-->|#.*canary.*)$", re.IGNORECASE)
"""A data-provenance marker at the top of an instruction, never shown to the agent (as Harbor strips it)."""


@dataclass(frozen=True)
class HarnessTask:
    """One task, whichever form it came in."""

    task_id: str
    instruction: str
    agent_timeout_s: float = HARBOR_TIMEOUT_S
    verifier_timeout_s: float = HARBOR_TIMEOUT_S
    verifier_env: Mapping[str, str] = field(default_factory=dict)
    allow_internet: bool = False
    environment: Path | None = None
    """The task's ``environment/`` directory (image backends build it), if any."""
    image: str | None = None
    cpus: float | None = None
    memory_mib: int | None = None
    files: Mapping[str, str] = field(default_factory=dict)
    """Workspace files the task starts with (JSONL form), path relative to the workspace -> text."""
    tests: Path | None = None
    """The directory copied to ``tests/`` in the sandbox after the agent ran (Harbor form)."""
    verifier_command: str | None = None
    """JSONL form: a shell command whose exit status is the verdict (instead of ``tests/test.sh``)."""


class _Tolerant(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class _Agent(_Tolerant):
    timeout_sec: float = Field(default=HARBOR_TIMEOUT_S, gt=0)


class _Verifier(_Tolerant):
    timeout_sec: float = Field(default=HARBOR_TIMEOUT_S, gt=0)
    env: dict[str, str] = Field(default_factory=dict)


class _Environment(_Tolerant):
    network_mode: Literal["public", "no-network", "allowlist"] = "public"
    allow_internet: bool | None = None
    """Harbor's older spelling of ``network_mode`` (public / no-network); it wins where given."""
    docker_image: str | None = None
    cpus: float | None = Field(default=None, gt=0)
    memory_mb: int | None = Field(default=None, gt=0)


class _TaskToml(_Tolerant):
    agent: _Agent = Field(default_factory=_Agent)
    verifier: _Verifier = Field(default_factory=_Verifier)
    environment: _Environment = Field(default_factory=_Environment)


class _JsonTask(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    id: str = Field(min_length=1)
    instruction: str = Field(min_length=1)
    files: dict[str, str] = Field(default_factory=dict)
    verifier: str = Field(min_length=1)
    agent_timeout_sec: float = Field(default=HARBOR_TIMEOUT_S, gt=0)
    verifier_timeout_sec: float = Field(default=HARBOR_TIMEOUT_S, gt=0)
    verifier_env: dict[str, str] = Field(default_factory=dict)


def harbor_task(directory: Path) -> HarnessTask:
    """The Harbor task in ``directory`` (its name is the task id)."""
    toml_path, instruction_path = directory / "task.toml", directory / "instruction.md"
    for required in (toml_path, instruction_path, directory / "tests" / "test.sh"):
        if not required.is_file():
            raise ConfigError(f"{directory} is not a Harbor task directory: {required.name} is missing")
    try:
        config = _TaskToml.model_validate(tomllib.loads(toml_path.read_text()))
    except (tomllib.TOMLDecodeError, ValidationError) as error:
        why = describe_validation_error(error) if isinstance(error, ValidationError) else str(error)
        raise ConfigError(f"{toml_path} is not valid: {why}") from None
    environment = directory / "environment"
    return HarnessTask(
        task_id=directory.resolve().name,
        instruction=strip_canary(instruction_path.read_text()),
        agent_timeout_s=config.agent.timeout_sec,
        verifier_timeout_s=config.verifier.timeout_sec,
        verifier_env=config.verifier.env,
        allow_internet=internet(config.environment),
        environment=environment if environment.is_dir() else None,
        image=config.environment.docker_image,
        cpus=config.environment.cpus,
        memory_mib=config.environment.memory_mb,
        tests=directory / "tests",
    )


def internet(environment: _Environment) -> bool:
    """Whether the sandbox may reach the internet: ``allowlist`` is read as no (only the gateway)."""
    if environment.allow_internet is not None:
        return environment.allow_internet
    return environment.network_mode == "public"


def strip_canary(text: str) -> str:
    """The instruction without leading canary lines and the blank lines after them (Harbor's rule)."""
    lines = text.split("\n")
    start = 0
    while start < len(lines) and CANARY_LINE.match(lines[start].strip()):
        start += 1
    while start < len(lines) and not lines[start].strip():
        start += 1
    return "\n".join(lines[start:])


def jsonl_tasks(path: Path) -> Iterator[HarnessTask]:
    """The tasks of a JSONL file, one a line (blank lines skipped); a bad line is a ``ConfigError`` naming
    the file and the line."""
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if line.strip():
            try:
                parsed = json.loads(line)
            except json.JSONDecodeError as error:
                raise ConfigError(f"task file {path}, line {number}: {error}") from None
            yield json_task(parsed, f"task file {path}, line {number}")


def json_task(fields: object, where: str) -> HarnessTask:
    """A task in the JSONL form (one line's object); a bad one is a ``ConfigError`` naming ``where``."""
    try:
        task = _JsonTask.model_validate(fields)
    except ValidationError as error:
        raise ConfigError(f"{where}: {describe_validation_error(error)}") from None
    for name in task.files:
        if Path(name).is_absolute() or ".." in Path(name).parts:
            raise ConfigError(f"{where}: file {name!r} must stay in the workspace")
    return HarnessTask(
        task_id=task.id,
        instruction=task.instruction,
        agent_timeout_s=task.agent_timeout_sec,
        verifier_timeout_s=task.verifier_timeout_sec,
        verifier_env=task.verifier_env,
        allow_internet=False,
        files=task.files,
        verifier_command=task.verifier,
    )


def queued_task(task: Mapping[str, Any], task_id: str) -> HarnessTask:
    """A task from the TASKS queue (``turnstile submit --harness``): ``{"path": DIR}`` names a Harbor task
    directory on the harness's machine; any other object is the JSONL form, its id the message's."""
    if "path" in task:
        return harbor_task(Path(str(task["path"])))
    fields = {key: value for key, value in task.items() if key not in ("id", "task_id")}
    return json_task({"id": task_id, **fields}, f"task {task_id!r}")


def load_tasks(paths: list[Path]) -> list[HarnessTask]:
    """Tasks from each path: a Harbor task directory, a directory of them (a dataset), or a JSONL file.
    Task ids must be unique across them all."""
    tasks: list[HarnessTask] = []
    for path in paths:
        if path.is_file():
            tasks.extend(jsonl_tasks(path))
        elif (path / "task.toml").is_file():
            tasks.append(harbor_task(path))
        elif path.is_dir():
            found = sorted(child for child in path.iterdir() if (child / "task.toml").is_file())
            if not found:
                raise ConfigError(f"{path} holds no Harbor task directory (a directory with a task.toml)")
            tasks.extend(harbor_task(child) for child in found)
        else:
            raise ConfigError(f"task path {path} does not exist (give task directories or JSONL files)")
    seen: set[str] = set()
    for task in tasks:
        if task.task_id in seen:
            raise ConfigError(f"task id {task.task_id!r} is given twice: task ids must be unique in a run")
        seen.add(task.task_id)
    return tasks
