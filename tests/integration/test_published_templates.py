"""Native-tool-syntax templates real models publish (Mistral, Command-R, Gemma 4, gpt-oss, DeepSeek-R1
distills, GLM, Kimi, MiniMax, Qwen3-Coder, Seed-OSS, granite), fetched at test time from llama-cpp-python's
sdist (``tests/support/published_templates.py``): never silently wrong.

The six-call tool conversation of ``tests/support/template_conversation.py`` goes through ``ChatRenderer``
turn by turn. Each completion is the template's own render of the assistant message (the render with the
reply minus the generation prompt), ending on the model's stop token. Each turn is either continued, its new
part equal token for token to the template's own full render of the longer conversation, or flagged
``prefix_break``; and the start-up diagnosis agrees (a template found not local is never continued).
"""

from __future__ import annotations

import jinja2
import pytest

from pipeline.inference.chat import ChatRenderer
from schemas import ChatMessage, LLMRequest, TokenPrefix
from tests.support.published_templates import PUBLISHED, Published, tokenizer_for
from tests.support.real_templates import tokenizer_with_template
from tests.support.template_conversation import SCRIPT, TOOLS, assert_new_part_is_the_templates_own

EXPECTED = {
    "mistralai-Mistral-Nemo-Instruct-2407": "flagged",
    "Mistral-Small-3.2-24B-Instruct-2506": "flagged",
    "unsloth-mistral-Devstral-Small-2507": "continued",
    "CohereForAI-c4ai-command-r-plus-tool_use": "refuses",
    "CohereForAI-c4ai-command-r7b-12-2024-tool_use": "mixed",
    "google-gemma-4-31B-it": "mixed",
    "openai-gpt-oss-120b": "flagged",
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B": "mixed",
    "deepseek-ai-DeepSeek-R1-Distill-Llama-8B": "mixed",
    "Qwen3-Coder": "continued",
    "GLM-4.6": "continued",
    "moonshotai-Kimi-K2": "continued",
    "MiniMax-M2": "flagged",
    "ByteDance-Seed-OSS": "flagged",
    "ibm-granite-granite-4.0": "continued",
}
"""What each template gets (docs/templates.md says why): ``continued`` (every turn, exactly), ``flagged``
(every turn a full render marked ``prefix_break``: the start-up probe finds it not local), ``mixed``
(turns whose continuation differs from the template's own render are flagged, the others continued exactly) or
``refuses`` (the template cannot render OpenAI-style tools: the request fails with the template's error)."""


def completion(
    renderer: ChatRenderer, published: Published, history: list[ChatMessage], reply: ChatMessage
) -> list[int]:
    """The model's tokens for ``reply``: the template's render of the conversation with it, minus the render
    with the generation prompt, up to the first end marker; the model stops on its stop token there."""
    tokenizer = renderer.tokenizer
    tools = [t.model_dump(mode="json") for t in TOOLS]
    before = renderer.render(renderer.messages(history), tools, add_generation_prompt=True)
    after = renderer.render(renderer.messages([*history, reply]), tools, add_generation_prompt=False)
    # where the generation prompt holds more than the history form (R1's "<think>\n", Gemma 4's channel),
    # the model's text is what the history form renders after the part both renders share
    shared = next(
        (i for i, (a, b) in enumerate(zip(before, after, strict=False)) if a != b),
        min(len(before), len(after)),
    )
    assert after[shared:], f"{published.name}: the reply renders as nothing"
    ids = tokenizer.encode(after[shared:], add_special_tokens=False)
    stops = [tokenizer.convert_tokens_to_ids(s) for s in published.stops]
    for index, token in enumerate(ids):
        if token in renderer.stop_ids:
            return ids[: index + 1]
        if token in renderer.closers:  # gpt-oss: <|end|> in history where the model stopped on <|return|>
            return [*ids[:index], stops[0]]
    return [*ids, stops[-1] if reply.tool_calls else stops[0]]  # GLM: the next role's token stops it


def with_nine_character_ids(
    script: list[tuple[ChatMessage, list[ChatMessage]]],
) -> list[tuple[ChatMessage, list[ChatMessage]]]:
    """The script with tool-call ids of nine alphanumerics (``call_1`` -> ``callid001``): Mistral's templates
    refuse any other shape, and the other templates take any."""

    def renamed(message: ChatMessage) -> ChatMessage:
        text = message.model_dump_json().replace('"call_', '"callid00')
        return ChatMessage.model_validate_json(text)

    return [(renamed(reply), [renamed(m) for m in following]) for reply, following in script]


@pytest.mark.parametrize("published", PUBLISHED, ids=[p.name for p in PUBLISHED])
def test_a_six_call_tool_conversation_is_continued_exactly_or_flagged(published: Published) -> None:
    tokenizer = tokenizer_for(published)
    stop_ids = {tokenizer.convert_tokens_to_ids(s) for s in published.stops}
    renderer = ChatRenderer(tokenizer, stop_ids=stop_ids)
    if EXPECTED[published.name] == "refuses":  # Command-R+ wants Cohere's tool format (parameter_definitions)
        with pytest.raises(jinja2.TemplateError):
            renderer.prompt(
                LLMRequest(policy="p", messages=[ChatMessage(role="user", content="hi")], tools=TOOLS)
            )
        return
    diagnosis = renderer.diagnose()
    messages = [
        ChatMessage(role="system", content="You are a careful calculator."),
        ChatMessage(role="user", content="What is (2+3)*7? Use the calculator."),
    ]
    prefix: TokenPrefix | None = None
    breaks, continued = 0, 0
    for reply, following in with_nine_character_ids(SCRIPT):
        request = LLMRequest(policy="p", messages=messages, tools=TOOLS, prefix=prefix)
        prompt = renderer.prompt(request)
        if prefix is not None and prompt.prefix_break:
            breaks += 1
            assert prompt.token_ids == renderer.full(request)  # the fallback is the template's own render
        elif prefix is not None:
            continued += 1
            assert prompt.token_ids[: len(prefix.token_ids)] == prefix.token_ids
            assert_new_part_is_the_templates_own(renderer, request, prompt.token_ids, len(prefix.token_ids))
        ids = completion(renderer, published, messages, reply)
        prefix = TokenPrefix(token_ids=[*prompt.token_ids, *ids], message_count=len(messages) + 1)
        messages = [*messages, reply, *following]
    print(
        f"{published.name} ({published.tokenizer}): continued {continued}, prefix_break {breaks}; {diagnosis}"
    )
    verdict = "continued" if breaks == 0 else "flagged" if continued == 0 else "mixed"
    assert verdict == EXPECTED[published.name]
    # the start-up diagnosis agrees: a template it finds not local is never continued, and the reverse
    assert renderer.local == (continued > 0)
    assert renderer.local == (not [p for p in diagnosis if "prefix_break" in p or "cannot render" in p])


REFUSES_SYSTEM = """{%- for m in messages -%}
{%- if m.role == 'system' and not loop.first -%}
{{- raise_exception('System message must be at the beginning.') -}}
{%- endif -%}
<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endfor -%}
{%- if add_generation_prompt -%}<|im_start|>assistant
{% endif -%}"""
"""Hand-made: ChatML that raises on a system message after the first message, as Qwen3.5's does."""


@pytest.mark.parametrize(
    ("name", "tokenizer_name"),
    [("hand-made", "qwen"), ("Qwen3.5-4B", "qwen3"), ("Apertus-8B-Instruct", "qwen")],
)
def test_a_system_note_mid_conversation_becomes_a_user_note_and_later_ones_extend_the_prompt(
    name: str, tokenizer_name: str
) -> None:
    """Templates that refuse a system message after the first get the note as a user message in
    ``<system-reminder>`` tags where it stands: each later note continues the prompt token for token."""
    if name == "hand-made":
        tokenizer = tokenizer_with_template(tokenizer_name, "qwen2.5-instruct")
        tokenizer.chat_template = REFUSES_SYSTEM
    else:
        tokenizer = tokenizer_for(Published(name, tokenizer_name, ("<|im_end|>",)))
    renderer = ChatRenderer(tokenizer, stop_ids={tokenizer.convert_tokens_to_ids("<|im_end|>")})
    assert not renderer.system_in_place
    messages = [ChatMessage(role="system", content="Be brief."), ChatMessage(role="user", content="Hi.")]
    prefix: TokenPrefix | None = None
    for turn in range(3):
        request = LLMRequest(policy="p", messages=messages, prefix=prefix)
        prompt = renderer.prompt(request)
        if prefix is not None:
            assert not prompt.prefix_break
            assert prompt.token_ids[: len(prefix.token_ids)] == prefix.token_ids
            assert_new_part_is_the_templates_own(renderer, request, prompt.token_ids, len(prefix.token_ids))
            assert f"<system-reminder>\n{turn} tokens left\n</system-reminder>" in tokenizer.decode(
                prompt.token_ids
            )
        reply = ChatMessage(role="assistant", content=f"Reply {turn}.")
        end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        ids = [*tokenizer.encode(f"Reply {turn}.", add_special_tokens=False), end]
        prefix = TokenPrefix(token_ids=[*prompt.token_ids, *ids], message_count=len(messages) + 1)
        note = ChatMessage(role="system", content=f"{turn + 1} tokens left")
        messages = [*messages, reply, note, ChatMessage(role="user", content="Go on.")]


REFUSES_RUNS = REFUSES_SYSTEM.replace(
    "<|im_start|>{{ m.role }}",
    "{%- if m.role == 'user' and not loop.first and messages[loop.index0 - 1].role == 'user' -%}\n"
    "{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') -}}\n"
    "{%- endif -%}\n<|im_start|>{{ m.role }}",
    1,
)
"""Hand-made: ChatML that refuses a system message after the first and two user messages in a row."""
MISTRAL_SMALL = next(p for p in PUBLISHED if p.name == "Mistral-Small-3.2-24B-Instruct-2506")


@pytest.mark.parametrize("name", ["hand-made", MISTRAL_SMALL.name])
def test_a_note_beside_a_user_message_is_joined_to_it_where_the_template_refuses_two_in_a_row(
    name: str,
) -> None:
    """Claude Code's first call ends in a system message after the user's (its environment), later calls
    put one before the next user message: where the template renders no system message there and refuses
    two user messages in a row (Mistral Small 3.2: "roles must alternate"), the note and the user message
    are one user message. Each turn renders (no template error), holds every note and user text, and is
    continued token for token (the hand-made template) or flagged with the template's own render (Mistral,
    not local: ``test_a_six_call_tool_conversation_is_continued_exactly_or_flagged``)."""
    if name == "hand-made":
        tokenizer = tokenizer_with_template("qwen", "qwen2.5-instruct")
        tokenizer.chat_template = REFUSES_RUNS
        end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    else:
        tokenizer = tokenizer_for(MISTRAL_SMALL)
        end = tokenizer.convert_tokens_to_ids(MISTRAL_SMALL.stops[0])
    renderer = ChatRenderer(tokenizer, stop_ids={end})
    assert not renderer.users_in_a_row
    assert not renderer.system_in_place
    messages = [
        ChatMessage(role="system", content="Be brief."),
        ChatMessage(role="user", content="Hi."),
        ChatMessage(role="system", content="Working directory: /work"),
    ]
    prefix: TokenPrefix | None = None
    for turn in range(3):
        request = LLMRequest(policy="p", messages=messages, prefix=prefix)
        prompt = renderer.prompt(request)
        text = tokenizer.decode(prompt.token_ids)
        assert "<system-reminder>\nWorking directory: /work\n</system-reminder>" in text
        assert all(f"{n} tokens left" in text for n in range(1, turn + 1))
        assert text.count("Go on.") == turn
        if prefix is not None and prompt.prefix_break:
            assert name != "hand-made"
            assert prompt.token_ids == renderer.full(request)
        elif prefix is not None:
            assert prompt.token_ids[: len(prefix.token_ids)] == prefix.token_ids
            assert_new_part_is_the_templates_own(renderer, request, prompt.token_ids, len(prefix.token_ids))
        ids = [*tokenizer.encode(f"Reply {turn}.", add_special_tokens=False), end]
        prefix = TokenPrefix(token_ids=[*prompt.token_ids, *ids], message_count=len(messages) + 1)
        note = ChatMessage(role="system", content=f"{turn + 1} tokens left")
        reply = ChatMessage(role="assistant", content=f"Reply {turn}.")
        messages = [*messages, reply, note, ChatMessage(role="user", content="Go on.")]
