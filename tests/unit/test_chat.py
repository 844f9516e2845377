"""Prompt rendering with token-exact continuation, and hermes tool-call parsing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from pipeline.inference.chat import ChatRenderer, split_reasoning, split_tool_calls
from schemas import ChatMessage, FunctionCall, LLMRequest, TokenPrefix, ToolCall, ToolSpec

# Templates that render a past assistant turn differently once the conversation goes on.
STRIPS_REASONING = """{%- for m in messages -%}
<|im_start|>{{ m.role }}
{% if m.role == 'assistant' and not loop.last %}{{ (m.content or '').split('</think>')[-1].lstrip() }}\
{% else %}{{ m.content or '' }}{% endif %}<|im_end|>
{% endfor -%}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif -%}"""
TRIMS_WHITESPACE = """{%- for m in messages -%}
<|im_start|>{{ m.role }}
{% if loop.last %}{{ m.content or '' }}{% else %}{{ (m.content or '') | trim }}{% endif %}<|im_end|>
{% endfor -%}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif -%}"""
COUNTS_MESSAGES = """{{ messages | length }} messages
{%- for m in messages %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endfor -%}<|im_start|>assistant
"""
NUMBERS_ROUNDS = """{%- for m in messages %}<|im_start|>{{ m.role }} {{ loop.index }}
{{ m.content }}<|im_end|>
{% endfor -%}<|im_start|>assistant
"""


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


def first_turn(tokenizer: Any, completion_text: str) -> tuple[LLMRequest, list[int]]:
    """A first request and the tokens an engine would have produced for it (prompt + completion + eos)."""
    request = LLMRequest(policy="p", messages=[ChatMessage(role="user", content="What is 2+2?")])
    prompt = ChatRenderer(tokenizer).prompt(request).token_ids
    completion = [*tokenizer.encode(completion_text, add_special_tokens=False), tokenizer.eos_token_id]
    return request, prompt + completion


def second_request(first: LLMRequest, reply: str, prefix_ids: list[int]) -> LLMRequest:
    messages = [
        *first.messages,
        ChatMessage(role="assistant", content=reply),
        ChatMessage(role="user", content="  And 3+3?  "),
    ]
    return LLMRequest(
        policy="p", messages=messages, prefix=TokenPrefix(token_ids=prefix_ids, message_count=2)
    )


@pytest.mark.parametrize("template", [None, STRIPS_REASONING, TRIMS_WHITESPACE])
def test_a_continuation_keeps_the_earlier_tokens_even_when_the_template_drifts(
    tokenizer: Any, template: str | None
) -> None:
    if template is not None:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
        tokenizer.chat_template = template
    renderer = ChatRenderer(tokenizer)
    reply = "<think>\nadd them\n</think>\n\n  4  "
    first, prefix_ids = first_turn(tokenizer, reply)
    request = second_request(first, reply, prefix_ids)
    prompt = renderer.prompt(request)
    assert not prompt.prefix_break
    assert prompt.token_ids[: len(prefix_ids)] == prefix_ids
    new_text = tokenizer.decode(prompt.token_ids[len(prefix_ids) :])
    assert new_text == "\n<|im_start|>user\n  And 3+3?  <|im_end|>\n<|im_start|>assistant\n"
    full = renderer.full(request)
    if template is None:
        assert full == prompt.token_ids  # ChatML renders stably: continuation and full render agree
        assert prompt.render_drift is False
    else:
        assert full[: len(prefix_ids)] != prefix_ids  # a full re-render would have changed history
        assert prompt.render_drift is True  # and the turn says so
    assert ChatRenderer(tokenizer, check_drift=False).prompt(request).render_drift is None


def test_a_template_whose_header_counts_the_messages_continues_and_only_a_full_render_drifts(
    tokenizer: Any,
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    tokenizer.chat_template = COUNTS_MESSAGES
    first, prefix_ids = first_turn(tokenizer, "4")
    request = second_request(first, "4", prefix_ids)
    prompt = ChatRenderer(tokenizer).prompt(request)
    assert not prompt.prefix_break  # the new messages render the same whatever came before them
    assert prompt.token_ids[: len(prefix_ids)] == prefix_ids
    assert ChatRenderer(tokenizer).full(request)[:3] != prefix_ids[:3]  # "4 messages": history rewritten
    assert prompt.render_drift is True


def test_a_template_that_numbers_messages_falls_back_to_a_full_render_marked_prefix_break(
    tokenizer: Any,
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    tokenizer.chat_template = NUMBERS_ROUNDS
    first, prefix_ids = first_turn(tokenizer, "4")
    request = second_request(first, "4", prefix_ids)
    prompt = ChatRenderer(tokenizer).prompt(request)
    assert prompt.prefix_break  # the new messages' rendering depends on how many came before
    assert prompt.token_ids == ChatRenderer(tokenizer).full(request)


def test_a_length_cut_completion_gets_the_whole_end_of_message_glue(tokenizer: Any) -> None:
    first, prefix_ids = first_turn(tokenizer, "4")
    cut = prefix_ids[:-1]  # no eos: the engine stopped at max_tokens
    prompt = ChatRenderer(tokenizer).prompt(second_request(first, "4", cut))
    glue = tokenizer.decode(prompt.token_ids[len(cut) : len(cut) + 2])
    assert prompt.token_ids[: len(cut)] == cut
    assert glue == "<|im_end|>\n"


def test_tool_results_and_tools_continue_token_exactly(tokenizer: Any) -> None:
    tools = [ToolSpec.model_validate({"function": {"name": "calculator", "parameters": {"type": "object"}}})]
    call = ToolCall(id="c1", function=FunctionCall(name="calculator", arguments='{"expression": "2+2"}'))
    base = [ChatMessage(role="user", content="2+2?")]
    first = LLMRequest(policy="p", messages=base, tools=tools)
    renderer = ChatRenderer(tokenizer)
    call_text = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+2"}}\n</tool_call>'
    completion = [*tokenizer.encode(call_text, add_special_tokens=False), tokenizer.eos_token_id]
    prefix_ids = renderer.prompt(first).token_ids + completion
    messages = [
        *base,
        ChatMessage(role="assistant", content="", tool_calls=[call]),
        ChatMessage(role="tool", tool_call_id="c1", content="4"),
        ChatMessage(role="tool", content="ok"),
    ]
    second = LLMRequest(
        policy="p", messages=messages, tools=tools, prefix=TokenPrefix(token_ids=prefix_ids, message_count=2)
    )
    prompt = renderer.prompt(second)
    assert prompt.token_ids[: len(prefix_ids)] == prefix_ids
    assert tokenizer.decode(prompt.token_ids[len(prefix_ids) :]) == (
        "\n<|im_start|>user\n<tool_response>\n4\n</tool_response>\n<tool_response>\nok\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n"
    )
    assert prompt.token_ids == renderer.full(second)


def test_hermes_tool_calls_are_parsed_and_malformed_ones_stay_in_the_text() -> None:
    text = (
        "Let me compute.\n"
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+2"}}\n</tool_call>'
        '\n<tool_call>{"name": "search", "arguments": "{\\"q\\": \\"x\\"}"}</tool_call>'
    )
    content, calls = split_tool_calls(text)
    assert content == "Let me compute."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("calculator", {"expression": "2+2"}),
        ("search", {"q": "x"}),
    ]
    assert len({c.id for c in calls}) == 2
    broken = 'ok <tool_call>{"name": "calculator", "arguments": {oops}</tool_call>'
    assert split_tool_calls(broken) == (broken, [])
    nameless = '<tool_call>{"arguments": {}}</tool_call>'
    assert split_tool_calls(nameless) == (nameless, [])
    for arguments in ('"ls -la"', "[1, 2]", '"[1]"', "3"):
        not_an_object = f'<tool_call>{{"name": "shell", "arguments": {arguments}}}</tool_call>'
        assert split_tool_calls(not_an_object) == (not_an_object, [])


@pytest.mark.parametrize(
    ("text", "reasoning", "answer"),
    [
        ("<think>\nAdd them.\n</think>\n\n4", "Add them.", "4"),
        ("Add them.\n</think>\n\n4", "Add them.", "4"),  # the template opened <think> in the prompt
        ("  <think>a</think>b", "a", "b"),
        ("4", None, "4"),
        ("So <think>a</think> b", None, "So <think>a</think> b"),  # not where a reply starts: left alone
        ("<think>never closed", None, "<think>never closed"),
    ],
)
def test_reasoning_is_split_from_the_answer_at_its_markers(
    text: str, reasoning: str | None, answer: str
) -> None:
    assert split_reasoning(text) == (reasoning, answer)


def test_the_consumer_says_at_start_what_its_template_does_to_continuation(tokenizer: Any) -> None:
    assert ChatRenderer(tokenizer).diagnose() == []  # the tiny model's ChatML: exact, no drift
    numbered = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    numbered.chat_template = NUMBERS_ROUNDS
    [problem, *_] = ChatRenderer(numbered).diagnose()
    assert "renders a tool message differently after different histories" in problem
    assert "prefix_break" in problem
    counted = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    counted.chat_template = COUNTS_MESSAGES
    assert [p for p in ChatRenderer(counted).diagnose() if "render_drift" in p]  # continues, but drifts


# Command-R's closing (reply markers inside the turn markers), reduced to what the seam needs.
COMMAND_R_STYLE = """{%- for m in messages -%}
<|START_OF_TURN_TOKEN|><|{{ 'CHATBOT' if m.role == 'assistant' else m.role | upper }}_TOKEN|>\
{% if m.role == 'assistant' %}<|START_RESPONSE|>{{ m.content }}<|END_RESPONSE|>\
{% else %}{{ m.content }}{% endif %}\
<|END_OF_TURN_TOKEN|>
{%- endfor -%}
{%- if add_generation_prompt %}<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|><|START_RESPONSE|>{% endif -%}"""
COMMAND_R_TOKENS = [
    "<|START_OF_TURN_TOKEN|>", "<|END_OF_TURN_TOKEN|>", "<|START_RESPONSE|>", "<|END_RESPONSE|>",
    "<|USER_TOKEN|>", "<|CHATBOT_TOKEN|>", "<|ASSISTANT_TOKEN|>", "<|SYSTEM_TOKEN|>", "<|TOOL_TOKEN|>",
]  # fmt: skip
# Qwen3-Coder's way with arguments: it iterates them, and raises on JSON text.
ITERATES_ARGUMENTS = """{%- for m in messages %}<|im_start|>{{ m.role }}
{{ m.content or '' }}
{%- for tc in m.tool_calls or [] %}<function={{ tc.function.name }}>
{%- for key, value in tc.function.arguments.items() %}<parameter={{ key }}>{{ value }}</parameter>{% endfor %}
</function>{% endfor %}<|im_end|>
{% endfor -%}{%- if add_generation_prompt %}<|im_start|>assistant
{% endif -%}"""
PRINTS_ARGUMENTS = ITERATES_ARGUMENTS.replace(
    "{%- for key, value in tc.function.arguments.items() %}<parameter={{ key }}>{{ value }}</parameter>"
    "{% endfor %}",
    "{{ tc.function.arguments }}",
)
# A user message rendered differently when the conversation has a system message (what the old stand-ins,
# without one, could not see).
SYSTEM_DEPENDENT = """{%- for m in messages %}<|im_start|>{{ m.role }}
{% if m.role == 'user' and messages[0].role == 'system' %}[with system] {% endif %}{{ m.content }}<|im_end|>
{% endfor -%}{%- if add_generation_prompt %}<|im_start|>assistant
{% endif -%}"""
# Tool results numbered by their place in the conversation (Mistral's [TOOL_RESULTS] depends on its
# position): not local, though a user message after them renders the same whatever came before.
NUMBERS_TOOL_RESULTS = """{%- for m in messages %}<|im_start|>{{ m.role }}
{% if m.role == 'tool' %}[result {{ loop.index }}] {% endif %}{{ m.content or '' }}<|im_end|>
{% endfor -%}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif -%}"""


def with_template(tokenizer: Any, template: str, specials: list[str] | None = None) -> Any:
    fresh = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    fresh.chat_template = template
    if specials:
        fresh.add_special_tokens({"additional_special_tokens": specials})
    return fresh


def test_the_seam_never_holds_the_template_end_sequence_twice(tokenizer: Any) -> None:
    """The completion ends ``<|END_RESPONSE|><|END_OF_TURN_TOKEN|>`` (the engine stops on the second), and
    the glue starts with both: they are dropped from the glue, and the prompt equals the full render."""
    tokenizer = with_template(tokenizer, COMMAND_R_STYLE, COMMAND_R_TOKENS)
    end_turn, end_response = (tokenizer.convert_tokens_to_ids(t) for t in COMMAND_R_TOKENS[1:4:2])
    renderer = ChatRenderer(tokenizer, stop_ids=[end_turn])
    assert {end_turn, end_response} <= renderer.closers
    first = LLMRequest(policy="p", messages=[ChatMessage(role="user", content="What is 2+2?")])
    completion = [*tokenizer.encode("4", add_special_tokens=False), end_response, end_turn]
    prefix_ids = renderer.prompt(first).token_ids + completion
    second = second_request(first, "4", prefix_ids)
    prompt = renderer.prompt(second)
    assert not prompt.prefix_break
    assert prompt.token_ids[: len(prefix_ids)] == prefix_ids
    assert tokenizer.decode(prompt.token_ids[len(prefix_ids) :]) == (
        "<|START_OF_TURN_TOKEN|><|USER_TOKEN|>  And 3+3?  <|END_OF_TURN_TOKEN|>"
        "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|><|START_RESPONSE|>"
    )
    assert prompt.token_ids == renderer.full(second)


def test_tool_call_arguments_reach_templates_as_objects_and_as_text_where_printed(tokenizer: Any) -> None:
    call = ToolCall(id="c1", function=FunctionCall(name="calculator", arguments='{"expression": "2+2"}'))
    messages = [
        ChatMessage(role="user", content="2+2?"),
        ChatMessage(role="assistant", content="", tool_calls=[call]),
        ChatMessage(role="tool", tool_call_id="c1", content="4"),
    ]
    request = LLMRequest(policy="p", messages=messages)
    iterating = ChatRenderer(with_template(tokenizer, ITERATES_ARGUMENTS))
    assert iterating.arguments == "object"
    text = iterating.tokenizer.decode(iterating.full(request))
    assert "<function=calculator><parameter=expression>2+2</parameter>" in text
    printing = ChatRenderer(with_template(tokenizer, PRINTS_ARGUMENTS))
    assert printing.arguments == "text"  # an object would print as Python, {'expression': '2+2'}
    assert '<function=calculator>\n{"expression": "2+2"}' in printing.tokenizer.decode(printing.full(request))


def test_a_template_that_depends_on_the_system_message_falls_back(tokenizer: Any) -> None:
    tokenizer = with_template(tokenizer, SYSTEM_DEPENDENT)
    renderer = ChatRenderer(tokenizer)
    first = LLMRequest(
        policy="p",
        messages=[ChatMessage(role="system", content="Be brief."), ChatMessage(role="user", content="2+2?")],
    )
    completion = [*tokenizer.encode("4", add_special_tokens=False), tokenizer.eos_token_id]
    prefix_ids = renderer.prompt(first).token_ids + completion
    messages = [
        *first.messages,
        ChatMessage(role="assistant", content="4"),
        ChatMessage(role="user", content="3+3?"),
    ]
    second = LLMRequest(
        policy="p", messages=messages, prefix=TokenPrefix(token_ids=prefix_ids, message_count=3)
    )
    prompt = renderer.prompt(second)
    assert prompt.prefix_break  # the stand-in with a system message renders the user message differently
    assert prompt.token_ids == renderer.full(second)
    assert "[with system] 3+3?" in tokenizer.decode(prompt.token_ids)


def test_a_template_found_not_local_at_start_is_never_continued(tokenizer: Any) -> None:
    tokenizer = with_template(tokenizer, NUMBERS_TOOL_RESULTS)
    renderer = ChatRenderer(tokenizer)
    [problem] = [p for p in renderer.diagnose() if "prefix_break" in p]
    assert "renders a tool message differently" in problem
    first, prefix_ids = first_turn(tokenizer, "4")
    request = second_request(first, "4", prefix_ids)
    tools = None
    assert renderer.continuation(renderer.messages(request.messages[2:]), tools) is not None  # tails agree
    prompt = renderer.prompt(request)
    assert prompt.prefix_break  # yet the verdict holds: a full render, flagged
    assert prompt.token_ids == renderer.full(request)
