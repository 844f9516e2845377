"""Example agents shipped with Turnstile (used by the tests and the demo).

- ``calculator.CalculatorAgent``: multi-turn tool use (hermes tool calls, tools run in parallel).
- ``single_turn.SingleTurnAgent``: one question, one answer.
- ``openai_agent.OpenAIAgent``: the calculator loop written against the OpenAI SDK (``llm.openai()``).

``arithmetic.jsonl`` holds small tasks for all three: ``{"id", "question", "answer"}``.
"""

from pathlib import Path

from pipeline.examples.digits_or_capitals import DigitsOrCapitalsAgent, demo_tasks

ARITHMETIC_TASKS = Path(__file__).with_name("arithmetic.jsonl")

__all__ = [
    "DigitsOrCapitalsAgent",
    "demo_tasks",
]
