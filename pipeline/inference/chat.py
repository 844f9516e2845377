"""Chat rendering with token-exact continuation, and hermes tool-call parsing.

Token-exact continuation (invariant 2): when a request extends an earlier turn (its first
``prefix.message_count`` messages are that turn's messages plus its assistant reply), the prompt is that
turn's exact prompt + completion ids, the template's glue after an assistant message, and the tokens of
the new messages only. The earlier conversation is never re-rendered, so a template that renders past
turns differently (strips their reasoning, changes whitespace) cannot change what the policy saw.

How: the new messages are rendered after a stand-in history that ends in an assistant message, and
everything up to the end of that assistant's content is cut off; what remains is the glue that closes an
assistant message followed by the new messages and the generation prompt. Nothing is assumed about how the
template renders an assistant message that comes last (Qwen3 gives it an empty ``<think>`` block) or how a
render without a generation prompt ends (DeepSeek-V3: a newline). The same is rendered after a second,
longer stand-in history; if the two differ, the template carries state across messages (a round counter)
and the prompt is rendered in full and marked ``prefix_break``. When the completion ended on one of the
engine's stop tokens (any of them, not only the tokenizer's ``eos_token``), the glue's own end token (and
any whitespace before it) is not added again: never two end tokens in a row.
"""

from __future__ import annotations

import hashlib
import json
import re
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Final, Protocol

from pipeline.inference.chain import Chain
from schemas import ChatMessage, FunctionCall, LLMRequest, ToolCall, ToolSpec

_BASE_USER: Final = "\u2063turnstile-base-user\u2063"
_BASE_ASSISTANT: Final = "\u2063turnstile-base-assistant\u2063"
_STAND_INS: Final = (
    [{"role": "user", "content": _BASE_USER}, {"role": "assistant", "content": _BASE_ASSISTANT}],
    [
        {"role": "user", "content": "\u2063turnstile-base-user-1\u2063"},
        {"role": "assistant", "content": "\u2063turnstile-base-assistant-1\u2063"},
        {"role": "user", "content": _BASE_USER},
        {"role": "assistant", "content": _BASE_ASSISTANT},
    ],
)
"""Two histories ending in the same assistant message: what follows its content must not depend on them."""
_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


class ChatTokenizer(Protocol):
    """The parts of a Hugging Face tokenizer the renderer uses."""

    eos_token_id: int | None

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, token_ids: list[int], **kwargs: Any) -> Any: ...


@dataclass(frozen=True, slots=True)
class Prompt:
    token_ids: list[int]
    prefix_break: bool = False
    """True when the request asked for continuation but the template made a full render necessary."""
    render_drift: bool | None = None
    """Whether the prompt differs from a full re-render of the request's messages (None: not checked)."""


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    return [message.model_dump(mode="json", exclude_none=True) for message in messages]


def tool_dicts(tools: list[ToolSpec]) -> list[dict[str, Any]] | None:
    return [tool.model_dump(mode="json") for tool in tools] or None


class ChatRenderer:
    """Turns a request into prompt token ids with the model's own chat template.

    ``stop_ids``: the tokens the engine stops on (``generation_config.eos_token_id``, which may list several);
    by default the tokenizer's ``eos_token_id``. ``check_drift``: also render each continued request in full
    and say whether that differs from the continued prompt (``Prompt.render_drift``): where re-tokenizing
    the conversation would have changed what the policy saw. It costs a full render per continued turn.
    """

    def __init__(
        self, tokenizer: ChatTokenizer, *, stop_ids: Iterable[int] | None = None, check_drift: bool = True
    ) -> None:
        self.tokenizer = tokenizer
        default = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        self.stop_ids = frozenset(default if stop_ids is None else stop_ids)
        self.check_drift = check_drift
        template = getattr(tokenizer, "chat_template", None)
        self.template_id = hashlib.sha256(str(template).encode()).hexdigest()[:12] if template else None
        """sha256 of the chat template, 12 hex digits: which template made a turn's prompt."""

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        *,
        add_generation_prompt: bool,
    ) -> str:
        text = self.tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False
        )
        return str(text)

    def full(self, request: LLMRequest) -> list[int]:
        text = self.render(
            message_dicts(request.messages), tool_dicts(request.tools), add_generation_prompt=True
        )
        return self.tokenizer.encode(text, add_special_tokens=False)

    def prompt(self, request: LLMRequest) -> Prompt:
        prefix = request.prefix
        if prefix is None:
            return Prompt(self.full(request), render_drift=False)
        if prefix.message_count >= len(request.messages):
            return Prompt(self.full(request), prefix_break=True, render_drift=False)
        tail = self.continuation(
            message_dicts(request.messages[prefix.message_count :]), tool_dicts(request.tools)
        )
        if tail is None:
            return Prompt(self.full(request), prefix_break=True, render_drift=False)
        ids = self.tokenizer.encode(tail, add_special_tokens=False)
        if prefix.ids and prefix.ids[-1] in self.stop_ids:
            ids = self._without_end_token(ids)
        prompt = Chain.of(prefix.ids).then(ids).tolist()  # the engines take a list; a held prefix is a Chain
        drift = self.full(request) != prompt if self.check_drift else None
        return Prompt(prompt, render_drift=drift)

    def continuation(self, new: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str | None:
        """The text that follows an assistant message's content when ``new`` comes next: its closing glue,
        the new messages and the generation prompt. None when it depends on the history (not message-local)
        or the template cannot render the stand-in history."""
        tails = set()
        for history in _STAND_INS:
            try:
                rendered = self.render([*history, *new], tools, add_generation_prompt=True)
            except Exception:  # a template that raises on this shape: locality cannot be checked
                return None
            end = rendered.rfind(_BASE_ASSISTANT)
            if end < 0:
                return None  # the template dropped the assistant's content: nothing to cut at
            tails.add(rendered[end + len(_BASE_ASSISTANT) :])
        return tails.pop() if len(tails) == 1 else None

    def diagnose(self) -> list[str]:
        """What this template does to continuation, in sentences for the consumer's start-up log: empty when
        a probe conversation (a tool call, its result, a follow-up) continues exactly without drift."""
        call: dict[str, Any] = {
            "id": "call_1",
            "type": "function",
            "function": {"name": "lookup", "arguments": '{"q": "x"}'},
        }
        tools = tool_dicts(
            [ToolSpec.model_validate({"function": {"name": "lookup", "parameters": {"type": "object"}}})]
        )
        steps: list[list[dict[str, Any]]] = [
            [{"role": "tool", "tool_call_id": "call_1", "content": "found"}],
            [{"role": "user", "content": "Thanks. And y?"}],
        ]
        problems = []
        for new in steps:
            if self.continuation(new, tools) is None:
                problems.append(
                    f"the template renders a {new[0]['role']} message differently after different histories "
                    "(it keeps state across messages, or cannot render the stand-in history): such turns are "
                    "rendered in full and marked prefix_break"
                )
        probe: list[dict[str, Any]] = [
            {"role": "user", "content": "Look up x."},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            *steps[0],
            {"role": "assistant", "content": "It is found."},
            *steps[1],
        ]
        try:
            whole = self.render(probe, tools, add_generation_prompt=True)
            pieces = self.render(probe[:2], tools, add_generation_prompt=False)
        except Exception as error:  # a template that refuses the probe's shape
            return [*problems, f"the template cannot render a tool conversation ({error})"]
        if not whole.startswith(pieces):
            problems.append(
                "a full render of a conversation changes how earlier messages look (e.g. it strips earlier "
                "reasoning or whitespace): continued turns keep the tokens the policy saw, and render_drift "
                "marks where re-tokenizing would differ"
            )
        return problems

    def _without_end_token(self, ids: list[int]) -> list[int]:
        """``ids`` without the glue's end token (and the whitespace before it), when the glue has one."""
        for index, token in enumerate(ids):
            if token in self.stop_ids:
                before = self.tokenizer.decode(ids[:index]) if index else ""
                return ids[index + 1 :] if not str(before).strip() else ids
            if index >= 8:
                break  # the end token comes first in the glue, or not at all
        return ids


def split_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """Hermes ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks -> tool calls.

    Returns the text without the well-formed blocks, and the calls. A block whose JSON does not parse,
    or lacks a name, stays in the text so the agent (and the log) sees exactly what the model wrote.
    """
    calls: list[ToolCall] = []

    def take(match: re.Match[str]) -> str:
        try:
            body = json.loads(match.group(1))
        except json.JSONDecodeError:
            return match.group(0)
        if not isinstance(body, dict) or not isinstance(body.get("name"), str) or not body["name"]:
            return match.group(0)
        arguments = body.get("arguments", {})
        arguments_text = (
            arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        )
        calls.append(
            ToolCall(
                id=f"call_{uuid.uuid4().hex[:24]}",
                function=FunctionCall(name=body["name"], arguments=arguments_text),
            )
        )
        return ""

    content = _TOOL_CALL.sub(take, text)
    return (content.strip() if calls else content), calls


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet (the printable character standing for each byte), reversed: what
    byte-level tokenizers (Qwen, Llama 3, DeepSeek, GPT-2) write their vocabularies in."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    characters = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            characters.append(256 + extra)
            extra += 1
    return {chr(character): byte for byte, character in zip(printable, characters, strict=True)}


_BYTE_LEVEL: Final = _byte_level_alphabet()
_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")  # SentencePiece's byte tokens


def token_bytes(tokenizer: Any, token_id: int) -> bytes:
    """The raw bytes of one token: from its byte-level spelling where the vocabulary has one (so a token that
    is half of a multi-byte character gives its exact bytes), else from decoding it alone."""
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if isinstance(piece, str):
        fallback = _BYTE_FALLBACK.match(piece)
        if fallback:
            return bytes([int(fallback.group(1), 16)])
        if piece and all(character in _BYTE_LEVEL for character in piece):
            return bytes(_BYTE_LEVEL[character] for character in piece)
    return str(tokenizer.decode([token_id], skip_special_tokens=False)).encode()


REASONING_MARKERS: Final = ("<think>", "</think>")
"""Where a reasoning model's reasoning begins and ends in its completion (Qwen3, DeepSeek-R1, QwQ, ...)."""


def split_reasoning(text: str, markers: tuple[str, str] = REASONING_MARKERS) -> tuple[str | None, str]:
    """(reasoning, answer): the reasoning between the markers at the start of ``text`` and what follows it.

    The opening marker may be missing (a template that ends its generation prompt with it, so the model
    begins inside the reasoning); the closing one must be there. No reasoning: (None, text) unchanged.
    """
    opening, closing = markers
    stripped = text.lstrip()
    end = text.find(closing)
    if end < 0:
        return None, text
    if stripped.startswith(opening):
        start = text.index(opening) + len(opening)
    elif opening in text[:end]:
        return None, text  # the reasoning does not start the reply: leave the text as the model wrote it
    else:
        start = 0
    return text[start:end].strip("\n"), text[end + len(closing) :].lstrip("\n")
