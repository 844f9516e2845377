"""The six-call tool conversation that the template tests put through ``ChatRenderer`` turn by turn
(``tests/integration/test_templates.py`` on the templates in the repository, ``test_published_templates.py``
on published ones), and the check that a continued prompt's new part is the template's own rendering."""

from __future__ import annotations

import json

from pipeline.inference.chat import ChatRenderer
from schemas import ChatMessage, FunctionCall, LLMRequest, ToolCall, ToolSpec

TOOLS = [
    ToolSpec.model_validate(
        {
            "function": {
                "name": "calculator",
                "description": "Evaluate an arithmetic expression",
                "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
            }
        }
    )
]


def call(expression: str, n: int) -> ChatMessage:
    arguments = json.dumps({"expression": expression})
    return ChatMessage(
        role="assistant",
        content="",
        tool_calls=[ToolCall(id=f"call_{n}", function=FunctionCall(name="calculator", arguments=arguments))],
    )


# (the assistant reply of each turn, the messages that follow it)
SCRIPT: list[tuple[ChatMessage, list[ChatMessage]]] = [
    (call("2+3", 1), [ChatMessage(role="tool", tool_call_id="call_1", content="5")]),
    (call("5*7", 2), [ChatMessage(role="tool", tool_call_id="call_2", content="35")]),
    (
        ChatMessage(
            role="assistant", content="2+3 is 5, and 5*7 is 35.", reasoning_content="Add, then multiply."
        ),
        [ChatMessage(role="user", content="Now add 1.")],
    ),
    (call("35+1", 3), [ChatMessage(role="tool", tool_call_id="call_3", content="36")]),
    (ChatMessage(role="assistant", content="36."), [ChatMessage(role="user", content="Thanks!")]),
    (ChatMessage(role="assistant", content="You're welcome."), []),
]


def assert_new_part_is_the_templates_own(
    renderer: ChatRenderer, request: LLMRequest, prompt: list[int], held: int
) -> None:
    """The continued prompt's new part, token for token, is what the template renders for the new messages:
    the tail of a full render of the longer conversation, starting right after the reply's closing marker
    (the full render minus the render of the conversation up to and including the reply)."""
    new = prompt[held:]
    full = renderer.full(request)
    assert new
    if not renderer.closers - renderer.stop_ids:
        # a stand-in tokenizer without the template's markers (Llama 3's on DeepSeek's): BPE may merge across
        # the seam in a full render, so the new part is compared as text, then the seam as tokens
        decode = renderer.tokenizer.decode
        assert str(decode(full)).endswith(str(decode(new))), "the new part differs from the template's own"
        return
    assert full[-len(new) :] == new, "the new part differs from the template's own rendering"
    before = full[: len(full) - len(new)]
    seam = {*renderer.closers, *prompt[held - 2 : held]}  # the reply's closing marker, or its last tokens
    assert before[-1] in seam, "the new part does not start where the full render finishes the reply"
    if prompt[held - 1] in renderer.stop_ids:
        assert new[0] not in renderer.closers, "two end markers at the seam"
