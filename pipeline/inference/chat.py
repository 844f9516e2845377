"""Chat rendering with token-exact continuation, and hermes tool-call parsing.

Token-exact continuation (invariant 2): when a request extends an earlier turn (its first
``prefix.message_count`` messages are that turn's messages plus its assistant reply), the prompt is that
turn's exact prompt + completion ids, the template's glue after an assistant message, and the tokens of
the new messages only. The earlier conversation is never re-rendered, so a template that renders past
turns differently (strips their reasoning, changes whitespace) cannot change what the policy saw.

The new messages are rendered after a fixed two-message base and the base's rendering is cut off; that
works for every template that renders each message on its own ("message-local", as ChatML does). For a
template that is not, the prompt is rendered in full and marked ``prefix_break``.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Final, Protocol

from schemas import ChatMessage, FunctionCall, LLMRequest, ToolCall, ToolSpec

_BASE_USER: Final = "\u2063turnstile-base-user\u2063"
_BASE_ASSISTANT: Final = "\u2063turnstile-base-assistant\u2063"
_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


class ChatTokenizer(Protocol):
    """The parts of a Hugging Face tokenizer the renderer uses."""

    eos_token_id: int | None

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


@dataclass(frozen=True, slots=True)
class Prompt:
    token_ids: list[int]
    prefix_break: bool = False
    """True when the request asked for continuation but the template made a full render necessary."""


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    return [message.model_dump(mode="json", exclude_none=True) for message in messages]


def tool_dicts(tools: list[ToolSpec]) -> list[dict[str, Any]] | None:
    return [tool.model_dump(mode="json") for tool in tools] or None


class ChatRenderer:
    """Turns a request into prompt token ids with the model's own chat template."""

    def __init__(self, tokenizer: ChatTokenizer) -> None:
        self.tokenizer = tokenizer
        base = [{"role": "user", "content": _BASE_USER}, {"role": "assistant", "content": _BASE_ASSISTANT}]
        self._base = base
        rendered = self.render(base, None, add_generation_prompt=False)
        tail = rendered[rendered.rindex(_BASE_ASSISTANT) + len(_BASE_ASSISTANT) :]
        self._assistant_tail = self.tokenizer.encode(tail, add_special_tokens=False)

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
            return Prompt(self.full(request))
        if prefix.message_count >= len(request.messages):
            return Prompt(self.full(request), prefix_break=True)
        tools = tool_dicts(request.tools)
        new = message_dicts(request.messages[prefix.message_count :])
        before = self.render(self._base, tools, add_generation_prompt=False)
        after = self.render(self._base + new, tools, add_generation_prompt=True)
        if not after.startswith(before):
            return Prompt(self.full(request), prefix_break=True)
        glue = self._assistant_tail
        if prefix.token_ids and glue and prefix.token_ids[-1] == glue[0] == self.tokenizer.eos_token_id:
            glue = glue[1:]  # the completion already ends with the end-of-message token
        delta = self.tokenizer.encode(after[len(before) :], add_special_tokens=False)
        return Prompt([*prefix.token_ids, *glue, *delta])


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
