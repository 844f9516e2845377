"""A multi-turn tool-use agent: asks the model, runs its calculator calls (in parallel), repeats."""

from __future__ import annotations

import asyncio
from typing import Any

from pipeline.episodes import EpisodeLLM
from pipeline.examples.tools import CALCULATOR, run_calculator, score
from schemas import ChatMessage

SYSTEM = (
    "You are a careful assistant. Use the calculate tool for arithmetic, then reply with the final answer "
    "as a number."
)
MALFORMED_TOOL_CALL = (
    'tool error: your <tool_call> block is not valid JSON; write <tool_call>{"name": "calculate", '
    '"arguments": {"expression": "..."}}</tool_call>'
)


class CalculatorAgent:
    def __init__(self, max_turns: int = 6) -> None:
        self.max_turns = max_turns

    async def run(self, task: dict[str, Any], llm: EpisodeLLM) -> float:
        messages = [
            ChatMessage(role="system", content=SYSTEM),
            ChatMessage(role="user", content=str(task["question"])),
        ]
        for _ in range(self.max_turns):
            reply = await llm.chat(messages, tools=[CALCULATOR])
            messages.append(reply.message)
            if reply.tool_calls:
                results = await asyncio.gather(
                    *(asyncio.to_thread(run_calculator, call) for call in reply.tool_calls)
                )
                messages += [
                    ChatMessage(role="tool", tool_call_id=call.id, name=call.function.name, content=result)
                    for call, result in zip(reply.tool_calls, results, strict=True)
                ]
            elif "<tool_call>" in reply.text:
                messages.append(ChatMessage(role="user", content=MALFORMED_TOOL_CALL))
            else:
                return score(reply.text, task["answer"])
        return 0.0
