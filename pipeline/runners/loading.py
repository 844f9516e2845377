"""Agents and reward functions named on the command line as ``package.module:Name``."""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from pipeline.episodes import Agent, FunctionAgent, RewardFunction
from pipeline.errors import ConfigError
from pipeline.runners.proxy import proxy_agent_adapter


def import_object(spec: str, what: str) -> Any:
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise ConfigError(f"{what} {spec!r}: write it as package.module:Name")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ConfigError(
            f"{what} {spec!r}: cannot import module {module_name!r} ({error}); is it installed or on "
            "PYTHONPATH?"
        ) from None
    found: Any = module
    for part in attribute.split("."):
        try:
            found = getattr(found, part)
        except AttributeError:
            raise ConfigError(f"{what} {spec!r}: module {module_name!r} has no {attribute!r}") from None
    return found


def load_agent(spec: str) -> Agent:
    """``package.module:Name``: a class (made with no arguments), an object with ``async run``, or an
    ``async def run(task, llm)`` function. One whose ``run`` takes ``base_url`` and ``api_key`` instead of
    ``llm`` (the proxy style, for agents written for any framework) runs through an in-process gateway."""
    found = import_object(spec, "agent")
    if inspect.isclass(found):
        try:
            found = found()
        except TypeError as error:
            raise ConfigError(f"agent {spec!r}: the class must take no arguments ({error})") from None
    if (proxy := proxy_agent_adapter(found)) is not None:
        return proxy
    if inspect.iscoroutinefunction(found):
        return FunctionAgent(found)
    if not inspect.iscoroutinefunction(getattr(found, "run", None)):
        raise ConfigError(
            f"agent {spec!r}: expected an object with `async def run(task, llm)` (or "
            f"`async def run(task, base_url, api_key)`), got {found!r}"
        )
    agent: Agent = found
    return agent


def load_reward_function(spec: str) -> RewardFunction:
    found = import_object(spec, "reward function")
    if not callable(found):
        raise ConfigError(f"reward function {spec!r} is not callable")
    function: RewardFunction = found
    return function
