"""What an agent's LLM call can be refused for."""

from __future__ import annotations

from pipeline.errors import TurnstileError


class InvalidLLMCall(TurnstileError, ValueError):
    """The agent called ``llm.chat`` with arguments that cannot make a request; ``field`` names the refused
    one where known (``tools[2].function.parameters``)."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class MaxTurnsExceeded(TurnstileError):
    """The agent asked for more turns than the episode allows."""

    def __init__(self, max_turns: int) -> None:
        self.max_turns = max_turns
        super().__init__(f"the episode allows {max_turns} LLM turns and the agent asked for one more")
