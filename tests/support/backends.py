"""Test backends: replies chosen by a rule over the request, tokens derived from the text.

What a test on these backends can prove about tokens: ``prompt_ids`` copies the request's prefix ids and
adds made-up ids for the new messages, so a session or gateway test that finds turn k's prompt + completion
at the start of turn k+1's prompt proves that the right prefix was *sent*, not that an engine continues it
exactly. That second half is proved on real engines and real templates: ``tests/unit/test_chat.py`` (the
renderer), ``tests/integration/test_torch_backend.py`` and ``tests/e2e/test_vllm_backend.py`` (the engines).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from pipeline.inference.backends import Generation
from schemas import LLMRequest, LLMResponse

Rule = Callable[[LLMRequest], str]


def text_ids(text: str) -> list[int]:
    return [3 + byte % 990 for byte in text.encode()] or [3]


def prompt_ids(request: LLMRequest) -> list[int]:
    """The prefix's exact tokens plus one made-up token run per new message (token-exact continuation)."""
    if request.prefix is not None:
        new = request.messages[request.prefix.message_count :]
        return [*request.prefix.ids, 1, *[i for m in new for i in text_ids(m.content or m.role)], 1]
    return [i for m in request.messages for i in (1, *text_ids(m.content or m.role), 2)]


class RuleBackend:
    """Answers ``rule(request)``; ``delay`` seconds per request; completion ids are the text's bytes + eos."""

    def __init__(self, rule: Rule, *, delay: float = 0.0) -> None:
        self.rule = rule
        self.delay = delay
        self.policy_version = 0
        self.requests_seen = 0
        self.loaded: list[tuple[int, str]] = []  # (version, checkpoint) of every load, in order

    async def generate(self, request: LLMRequest) -> Generation:
        self.requests_seen += 1
        started = time.monotonic()
        if self.delay:
            await asyncio.sleep(self.delay)
        text = self.rule(request)
        completion = [*text_ids(text), 2]
        return Generation(
            prompt_token_ids=prompt_ids(request),
            completion_token_ids=completion,
            completion_logprobs=[-0.25] * len(completion),
            text=text,
            finish_reason="stop",
            policy_version=self.policy_version,
            started_at=started,
            first_token_at=time.monotonic(),
        )

    async def load_version(self, version: int, checkpoint: str) -> None:
        self.policy_version = version
        self.loaded.append((version, checkpoint))

    async def close(self) -> None:
        pass


def calculator_rule(request: LLMRequest) -> str:
    """A model that uses the calculator: a tool call for the question, then the tool's result as answer."""
    last = request.messages[-1]
    if last.role == "tool":
        return f"The answer is {last.content}."
    question = next(m.content or "" for m in request.messages if m.role == "user")
    expression = question.removeprefix("What is ").rstrip("?")
    if "malformed" in question:
        return '<tool_call>{"name": "calculate", "arguments": </tool_call>'
    return f'<tool_call>{{"name": "calculate", "arguments": {{"expression": "{expression}"}}}}</tool_call>'


def echo_rule(request: LLMRequest) -> str:
    return f"reply {len(request.messages)}"


PREFIX_ECHO_COMPLETION = [7, 8, 2]


class PrefixEcho:
    """An in-process LLM client: the prompt is the request's prefix ids plus one id per new message."""

    def __init__(self, *, reasoning: str | None = None) -> None:
        self.requests: list[LLMRequest] = []
        self.reasoning = reasoning

    async def __call__(self, request: LLMRequest) -> LLMResponse:
        self.requests.append(request)
        prefix = list(request.prefix.ids) if request.prefix else []
        skipped = request.prefix.message_count if request.prefix else 0
        new = [100 + len(message.content or "") for message in request.messages[skipped:]]
        return LLMResponse(
            request_id=request.request_id,
            text=f"reply {len(self.requests)}",
            finish_reason="stop",
            reasoning=self.reasoning,
            prompt_token_ids=prefix + new,
            completion_token_ids=PREFIX_ECHO_COMPLETION,
            completion_logprobs=[-0.25] * len(PREFIX_ECHO_COMPLETION),
            policy_version=3,
            consumer_id="in-process",
        )
