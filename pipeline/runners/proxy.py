"""Proxy-style agents: code written for any framework, given a base URL and an API key instead of ``llm``.

The contract::

    class Agent:
        async def run(self, task: dict, base_url: str, api_key: str) -> float | dict | None: ...

(or a module-level ``async def run(task, base_url, api_key)``). ``base_url`` ends in ``/v1``: hand it to
``openai.AsyncOpenAI(base_url=..., api_key=...)``, ``anthropic.AsyncAnthropic(base_url=..., api_key=...)``
or any framework that speaks either API. What ``run`` returns means what it means for an ordinary agent.

``ProxyAgentAdapter`` makes such an agent an ordinary ``Agent``, so ``turnstile run`` and
``turnstile serve runner`` drive it unchanged, with groups, retries, timeouts and recovery. Each process
runs one gateway of its own on a free loopback port, in its event loop, started with the first episode;
each episode's session is registered under a fresh key for the length of ``run`` and forgotten after it
(its calls still in flight are waited for, or cancelled when the episode is cancelled).
"""

from __future__ import annotations

import asyncio
import inspect
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from pipeline.episodes import AgentResult, EpisodeLLM, MaxTurnsExceeded
from pipeline.gateway import HttpServer, SessionRegistry, create_gateway

PROXY_PARAMETERS = frozenset({"base_url", "api_key"})


@runtime_checkable
class ProxyAgent(Protocol):
    async def run(self, task: dict[str, Any], base_url: str, api_key: str) -> AgentResult: ...


@dataclass(frozen=True, slots=True)
class _FunctionProxyAgent:
    function: Callable[[dict[str, Any], str, str], Awaitable[AgentResult]]

    async def run(self, task: dict[str, Any], base_url: str, api_key: str) -> AgentResult:
        return await self.function(task, base_url, api_key)


def wants_base_url(run: object) -> bool:
    """Whether ``run`` takes parameters named ``base_url`` and ``api_key`` (the proxy style)."""
    if not callable(run):
        return False
    try:
        parameters = inspect.signature(run).parameters
    except (TypeError, ValueError):
        return False
    return parameters.keys() >= PROXY_PARAMETERS


def proxy_agent_adapter(found: object) -> ProxyAgentAdapter | None:
    """An ``Agent`` for a proxy-style agent (an object whose ``run``, or an async function that, takes
    ``base_url`` and ``api_key``); None for anything else."""
    if inspect.iscoroutinefunction(found) and wants_base_url(found):
        return ProxyAgentAdapter(_FunctionProxyAgent(found))
    run = getattr(found, "run", None)
    if inspect.iscoroutinefunction(run) and wants_base_url(run):
        agent: ProxyAgent = found  # type: ignore[assignment]
        return ProxyAgentAdapter(agent)
    return None


class LocalGateway:
    """The gateway a process runs for its proxy agents: registered sessions only, no admin key."""

    def __init__(self) -> None:
        self.registry = SessionRegistry()
        self.server = HttpServer(
            create_gateway(None, None, admin_key=None, registry=self.registry), lifespan="off"
        )

    @property
    def base_url(self) -> str:
        return f"{self.server.url}/v1"


_gateways: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Task[LocalGateway]] = (
    weakref.WeakKeyDictionary()
)


async def local_gateway() -> LocalGateway:
    """This event loop's gateway, started on first use (one per process and loop)."""
    loop = asyncio.get_running_loop()
    starting = _gateways.get(loop)
    if starting is None or (starting.done() and (starting.cancelled() or starting.exception() is not None)):
        starting = _gateways[loop] = loop.create_task(_start_gateway(), name="turnstile-local-gateway")
    return await asyncio.shield(starting)


async def _start_gateway() -> LocalGateway:
    gateway = LocalGateway()
    await gateway.server.start()
    return gateway


class ProxyAgentAdapter:
    """An ``Agent`` that runs a ``ProxyAgent`` against this process's gateway, bound to the episode."""

    def __init__(self, agent: ProxyAgent) -> None:
        self.agent = agent

    def __repr__(self) -> str:
        return f"ProxyAgentAdapter({self.agent!r})"

    async def run(self, task: dict[str, Any], llm: EpisodeLLM) -> AgentResult:
        gateway = await local_gateway()
        session = llm._session  # the episode the runner opened; the gateway serves it under a fresh key
        api_key = gateway.registry.register(session)
        cancelled = False
        try:
            return await self.agent.run(task, gateway.base_url, api_key)
        except asyncio.CancelledError:
            cancelled = True
            raise
        except Exception as error:
            # The gateway refused a call over --max-turns (HTTP 400); the agent's SDK raised its own error.
            if session.max_turns_hit and session.max_turns is not None:
                raise MaxTurnsExceeded(session.max_turns) from error
            raise
        finally:
            await gateway.registry.close(session.episode_id, cancel=cancelled)
