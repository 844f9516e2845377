"""What recognising the model's own output costs a session per call, on a long tool-using conversation.

An in-process session (``EpisodeSession`` over the in-memory store and an instant LLM client that answers
every call with one tool call, as Claude Code's loop does) runs ``--turns`` turns; each call sends the whole
conversation back. Two runs, measured in this process one after the other:

- ``exact`` (the baseline): the agent sends every tool call back as it got it.
- ``defaults``: the agent sends every tool call back with the tool schema's default filled in
  (``"replace_all": false``, as Claude Code does with ``Edit``), so the session has to recognise each as
  the recorded call (``pipeline.episodes.lineage``) to continue it.

Both runs must give one lineage of ``--turns`` turns (checked). Printed: mean wall time per call of each
run and their ratio (``defaults`` ÷ ``exact``), and the time the form restoring itself took per call.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

from pipeline.episodes import EpisodeSession
from pipeline.log import InMemoryStore
from schemas import ChatMessage, FunctionCall, LLMRequest, LLMResponse, ToolCall, ToolSpec

TOOLS = [  # models, as the gateway hands them to the session (its parse memo): the trusted request path
    ToolSpec.model_validate(
        {
            "type": "function",
            "function": {
                "name": "Edit",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "file_path": {"type": "string"},
                        "old_string": {"type": "string"},
                        "new_string": {"type": "string"},
                        "replace_all": {"type": "boolean", "default": False},
                    },
                    "required": ["file_path", "old_string", "new_string"],
                },
            },
        }
    )
]


class EditingLLM:
    """Answers every call with one ``Edit`` tool call; prompt ids: one per new message after the prefix."""

    def __init__(self) -> None:
        self.calls = 0

    async def __call__(self, request: LLMRequest) -> LLMResponse:
        self.calls += 1
        prefix = list(request.prefix.ids) if request.prefix else []
        skipped = request.prefix.message_count if request.prefix else 0
        arguments = {"file_path": f"/w/f{self.calls}.py", "old_string": "a" * 40, "new_string": "b" * 40}
        call = ToolCall(
            id=f"call_{self.calls}", function=FunctionCall(name="Edit", arguments=json.dumps(arguments))
        )
        return LLMResponse(
            request_id=request.request_id,
            text="",
            tool_calls=[call],
            finish_reason="tool_calls",
            prompt_prefix_tokens=len(prefix),  # as an engine continuing the prefix answers: the new ids only
            prompt_token_ids=[100 + i for i in range(len(request.messages) - skipped)],
            completion_token_ids=[7, 8, 2],
            completion_logprobs=[-0.25] * 3,
            policy_version=0,
            consumer_id="bench",
        )


async def run(turns: int, defaults: bool) -> tuple[float, float]:
    """Mean seconds per call, and mean seconds per call in ``_restore_form``."""
    session = EpisodeSession(InMemoryStore(), EditingLLM(), policy="bench")
    await session.start()
    restoring = 0.0
    original = session._restore_form

    def timed(request: Any) -> Any:
        nonlocal restoring
        began = time.perf_counter()
        try:
            return original(request)
        finally:
            restoring += time.perf_counter() - began

    session._restore_form = timed  # type: ignore[method-assign]
    messages: list[ChatMessage] = [ChatMessage(role="user", content="Edit the files.")]
    began = time.perf_counter()
    for _ in range(turns):
        reply = await session.chat(messages, TOOLS)
        call = reply.tool_calls[0]
        if defaults:
            sent = {**json.loads(call.function.arguments), "replace_all": False}
            call = call.model_copy(update={"function": FunctionCall(name="Edit", arguments=json.dumps(sent))})
        messages = [
            *messages,
            ChatMessage(role="assistant", content="", tool_calls=[call]),
            ChatMessage(role="tool", tool_call_id=call.id, content="The file has been updated."),
        ]
    elapsed = time.perf_counter() - began
    parents = [turn.parent_turn_id for turn in session.turns]
    assert parents[0] is None
    assert all(parents[1:]), "the conversation split into several lineages"
    return elapsed / turns, restoring / turns


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--turns", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    exact = min(asyncio.run(run(args.turns, defaults=False)) for _ in range(args.repeats))
    filled = min(asyncio.run(run(args.turns, defaults=True)) for _ in range(args.repeats))
    print(f"{args.turns} turns, one Edit call each, best of {args.repeats}")
    print(f"exact (baseline):  {exact[0] * 1e6:8.1f} us/call   restoring {exact[1] * 1e6:6.1f} us/call")
    print(f"defaults filled:   {filled[0] * 1e6:8.1f} us/call   restoring {filled[1] * 1e6:6.1f} us/call")
    print(f"ratio defaults / exact: {filled[0] / exact[0]:.2f}")


if __name__ == "__main__":
    main()
