"""The demo's task: two turns, each asking for digits or for capital letters; a reply earns the share of
its characters of the requested kind.

A random model already earns a little (a few characters in a hundred are digits or capitals), so the
reward is reachable by chance, and it rises as the policy learns to follow the request of each turn,
which it must read from the conversation (the second turn extends the first: token-exact continuation).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

from pipeline.episodes import EpisodeLLM
from schemas import ChatMessage

PROMPTS = {"digits": "Reply with digits only.", "capitals": "Reply with capital letters only."}


def share(text: str, kind: str) -> float:
    """The share of the non-space characters of ``text`` that are of ``kind`` (0 for an empty reply)."""
    characters = [c for c in text if not c.isspace()]
    if not characters:
        return 0.0
    wanted = str.isdigit if kind == "digits" else (lambda c: c.isascii() and c.isupper())
    return sum(1 for c in characters if wanted(c)) / len(characters)


def demo_tasks(seed: int = 0, turns: int = 2) -> Iterator[dict[str, Any]]:
    """An endless stream of tasks: {"id", "turns": [kind, ...]}."""
    rng = random.Random(seed)
    n = 0
    while True:
        yield {"id": f"demo-{seed}-{n}", "turns": [rng.choice(sorted(PROMPTS)) for _ in range(turns)]}
        n += 1


class DigitsOrCapitalsAgent:
    async def run(self, task: dict[str, Any], llm: EpisodeLLM) -> dict[str, float]:
        messages: list[ChatMessage] = []
        rewards = {}
        for kind in task["turns"]:
            messages.append(ChatMessage(role="user", content=PROMPTS[kind]))
            reply = await llm.chat(messages)
            messages.append(reply.message)
            rewards[str(reply.turn_id)] = share(reply.text, kind)
        return rewards
