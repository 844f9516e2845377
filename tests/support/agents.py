"""Agents for the tests (importable by runner processes as ``tests.support.agents:Name``)."""

from __future__ import annotations

import asyncio
import os
from typing import Any

from pipeline.episodes import EpisodeLLM
from schemas import ChatMessage


class ThreeTurnAgent:
    """Three turns, each extending the last: exercises token-exact continuation and parents."""

    turns = 3

    async def run(self, task: dict[str, Any], llm: EpisodeLLM) -> float:
        messages = [ChatMessage(role="user", content=f"task {task.get('id', '?')}: count to three")]
        for n in range(self.turns):
            reply = await llm.chat(messages, max_tokens=int(task.get("max_tokens", 6)))
            messages += [reply.message, ChatMessage(role="user", content=f"now say {n + 2}")]
        return float(task.get("reward", 1.0))


class SlowAgent(ThreeTurnAgent):
    """Sleeps ``TURNSTILE_TEST_AGENT_SLEEP`` seconds between turns, so a test can kill its runner mid-run."""

    async def run(self, task: dict[str, Any], llm: EpisodeLLM) -> float:
        messages = [ChatMessage(role="user", content=f"task {task.get('id', '?')}")]
        for n in range(self.turns):
            reply = await llm.chat(messages)
            messages += [reply.message, ChatMessage(role="user", content=f"go on {n}")]
            await asyncio.sleep(float(os.environ.get("TURNSTILE_TEST_AGENT_SLEEP", "0.2")))
        return 1.0


class FailingAgent:
    async def run(self, task: dict[str, Any], llm: EpisodeLLM) -> float:
        await llm.chat([{"role": "user", "content": "hello"}])
        if task.get("fail"):
            raise RuntimeError(f"agent broke on task {task.get('id')}")
        return 0.5


async def function_agent(task: dict[str, Any], llm: EpisodeLLM) -> None:
    await llm.chat([{"role": "user", "content": str(task)}])


def length_reward(task: dict[str, Any], episode: Any) -> float:
    return float(len(episode.turns))


NOT_AN_AGENT = 42
