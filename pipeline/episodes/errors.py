"""What an agent's LLM call can be refused for."""

from __future__ import annotations

from pipeline.errors import TurnstileError


class InvalidLLMCall(TurnstileError, ValueError):
    """The agent called ``llm.chat`` with arguments that cannot make a request."""


class MaxTurnsExceeded(TurnstileError):
    """The agent asked for more turns than the episode allows."""

    def __init__(self, max_turns: int) -> None:
        self.max_turns = max_turns
        super().__init__(f"the episode allows {max_turns} LLM turns and the agent asked for one more")
