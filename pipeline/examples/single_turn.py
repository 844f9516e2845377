"""A single-turn agent: one question, one answer, scored."""

from __future__ import annotations

from typing import Any

from pipeline.episodes import EpisodeLLM
from pipeline.examples.tools import score


class SingleTurnAgent:
    async def run(self, task: dict[str, Any], llm: EpisodeLLM) -> float:
        reply = await llm.chat([{"role": "user", "content": str(task["question"])}])
        return score(reply.text, task["answer"])
