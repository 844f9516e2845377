"""The calculator agent written against the OpenAI SDK: runs unchanged on ``llm.openai()``."""

from __future__ import annotations

from typing import Any

from pipeline.episodes import EpisodeLLM
from pipeline.examples.tools import CALCULATOR, run_calculator, score
from schemas import FunctionCall, ToolCall


class OpenAIAgent:
    def __init__(self, max_turns: int = 6) -> None:
        self.max_turns = max_turns

    async def run(self, task: dict[str, Any], llm: EpisodeLLM) -> float:
        client = llm.openai()
        messages: list[Any] = [{"role": "user", "content": str(task["question"])}]
        tools: Any = [CALCULATOR.model_dump()]
        for _ in range(self.max_turns):
            completion = await client.chat.completions.create(
                model="policy", messages=messages, tools=tools, max_tokens=64
            )
            message = completion.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                return score(message.content or "", task["answer"])
            for call in message.tool_calls:
                function = getattr(call, "function", None)
                name, arguments = (function.name, function.arguments) if function else ("?", "{}")
                result = run_calculator(
                    ToolCall(id=call.id, function=FunctionCall(name=name, arguments=arguments))
                )
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        return 0.0
