"""Agents for the replay tests (importable by `turnstile replay --rerun` as
``tests.support.replay_agents:Name``).

``CountingAgent`` is the agent as recorded; the others are the same agent after a change: a reworded
follow-up prompt (diverges at turn 2), one turn fewer, one turn more. ``TerseOpenAIAgent`` is the
OpenAI SDK example agent with other sampling.
"""

from __future__ import annotations

from typing import Any

from pipeline.episodes import EpisodeLLM
from pipeline.examples.openai_agent import OpenAIAgent
from pipeline.examples.tools import CALCULATOR, score
from schemas import ChatMessage


class CountingAgent:
    """Three turns, each extending the last with a follow-up prompt."""

    turns = 3
    follow_up = "now say {n}"

    async def run(self, task: dict[str, Any], llm: EpisodeLLM) -> float:
        messages = [ChatMessage(role="user", content=f"task {task.get('id', '?')}: count to three")]
        for n in range(self.turns):
            reply = await llm.chat(messages, max_tokens=8)
            messages += [reply.message, ChatMessage(role="user", content=self.follow_up.format(n=n + 2))]
        return float(task.get("reward", 1.0))


class RewordedCountingAgent(CountingAgent):
    follow_up = "now please say {n}"


class ShortCountingAgent(CountingAgent):
    turns = 2


class LongCountingAgent(CountingAgent):
    turns = 4


class TerseOpenAIAgent(OpenAIAgent):
    """The OpenAI SDK calculator agent with a smaller max_tokens: its requests' sampling differs."""

    async def run(self, task: dict[str, Any], llm: EpisodeLLM) -> float:
        client = llm.openai()
        tools: Any = [CALCULATOR.model_dump()]
        completion = await client.chat.completions.create(
            model="policy",
            messages=[{"role": "user", "content": str(task["question"])}],
            tools=tools,
            max_tokens=16,
        )
        return score(completion.choices[0].message.content or "", task["answer"])


class LongAgent:
    """A hundred turns, each extending the last with a follow-up of a few hundred characters: a long
    conversation whose turns record only what they add."""

    turns = 100

    async def run(self, task: dict[str, Any], llm: EpisodeLLM) -> float:
        messages = [
            ChatMessage(role="system", content="You are thorough."),
            ChatMessage(role="user", content="go"),
        ]
        for n in range(self.turns):
            reply = await llm.chat(messages, max_tokens=64)
            follow = f"observation {n}: " + "the build log says nothing new; " * 8
            messages += [reply.message, ChatMessage(role="user", content=follow)]
        return 1.0


class EditedReplyCountingAgent(CountingAgent):
    """The counting agent, but it sends each reply back with its last character changed: a change in
    substance (one character is enough), which a rerun must report at turn 2."""

    async def run(self, task: dict[str, Any], llm: EpisodeLLM) -> float:
        messages = [ChatMessage(role="user", content=f"task {task.get('id', '?')}: count to three")]
        for n in range(self.turns):
            reply = await llm.chat(messages, max_tokens=8)
            content = reply.message.content or ""
            edited = content[:-1] + ("?" if content.endswith("!") else "!")
            messages += [
                reply.message.model_copy(update={"content": edited}),
                ChatMessage(role="user", content=self.follow_up.format(n=n + 2)),
            ]
        return float(task.get("reward", 1.0))


class ListeningCountingAgent(CountingAgent):
    """The counting agent, keeping every reply text it was handed (in this process: for in-process reruns)."""

    heard: list[str] = []

    async def run(self, task: dict[str, Any], llm: EpisodeLLM) -> float:
        messages = [ChatMessage(role="user", content=f"task {task.get('id', '?')}: count to three")]
        for n in range(self.turns):
            reply = await llm.chat(messages, max_tokens=8)
            ListeningCountingAgent.heard.append(reply.message.content or "")
            messages += [reply.message, ChatMessage(role="user", content=self.follow_up.format(n=n + 2))]
        return float(task.get("reward", 1.0))
