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
render without a generation prompt ends (DeepSeek-V3: a newline). The same is rendered after other
stand-in histories holding what real conversations hold (a system message, a tool call with an id in the
client's format, its output, reasoning); if the tails differ, the template carries state across messages
and the prompt is rendered in full and marked ``prefix_break``. A template whose start-up probe is found
not local is never continued. When the completion ended on one of the engine's stop tokens, the template's
own end sequence (the special tokens it writes after an assistant's content, e.g. Command-R's
``<|END_RESPONSE|><|END_OF_TURN_TOKEN|>``, and whitespace before them) is not added again where the glue
starts with it: never two end markers at the seam. And a continued turn whose new tokens are not the tail of
the template's own full render (made anyway for ``render_drift``) falls back to that render, marked
``prefix_break``: what no stand-in can hold (the continued message's own tool calls) cannot make a turn
silently wrong. Tool-call arguments reach the template as JSON objects,
as vLLM passes them, unless the template expects text.
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
_STAND_IN_ID: Final = "call_0"
"""The stand-in tool-call id when the new messages name none (else their own ids' format is copied)."""
_REASONING: Final = "\u2063turnstile-base-reasoning\u2063"
_NOTE: Final = "\u2063turnstile-base-note\u2063"


def _as_user_note(message: dict[str, Any]) -> dict[str, Any]:
    """A system message after the conversation began, for a template that cannot render one there: a user
    message holding its text in ``<system-reminder>`` tags (see ``ChatRenderer.system_in_place``)."""
    return {
        "role": "user",
        "content": f"<system-reminder>\n{message.get('content') or ''}\n</system-reminder>",
    }


def _stand_ins(call_id: str, *, after_call: bool) -> tuple[list[dict[str, Any]], ...]:
    """Histories ending in the same assistant message: what follows its content must not depend on them.

    Besides a bare one, they hold what real conversations hold before the message continued: a system
    message, a tool call (``call_id``, in the format the client uses, with JSON-object arguments), its
    output, and an assistant message with reasoning; a template whose rendering of the new part depends on
    any of them gives different tails, and the turn falls back to a full render marked ``prefix_break``.
    ``after_call``: the new messages answer the continued message's tool calls, which the stand-ins cannot
    hold (their last message must end in its content); an earlier tool exchange would then leave the
    template in a state no real conversation reaches (DeepSeek-V3 numbers outputs since the last call), so
    those histories hold the system message but no tool exchange.
    """
    last = {"role": "assistant", "content": _BASE_ASSISTANT}
    call = {"id": call_id, "type": "function", "function": {"name": "stand_in", "arguments": {"q": "x"}}}
    system = {"role": "system", "content": "\u2063turnstile-base-system\u2063"}
    exchange: list[dict[str, Any]] = [
        {"role": "user", "content": "\u2063turnstile-base-user-2\u2063"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call_id, "content": "\u2063turnstile-base-output\u2063"},
        {
            "role": "assistant",
            "content": "\u2063turnstile-base-assistant-2\u2063",
            "reasoning_content": _REASONING,
        },
    ]
    return (
        [{"role": "user", "content": _BASE_USER}, last],
        [
            {"role": "user", "content": "\u2063turnstile-base-user-1\u2063"},
            {"role": "assistant", "content": "\u2063turnstile-base-assistant-1\u2063"},
            {"role": "user", "content": _BASE_USER},
            last,
        ],
        [system, *([] if after_call else exchange), {"role": "user", "content": _BASE_USER}, last],
    )


def _like(call_id: str) -> str:
    """An id in the same format as ``call_id`` (same length, same kind of character at each place) that
    differs from it: templates that check their ids' shape (Mistral: nine alphanumerics) accept it."""
    swapped = {**{c: "7" for c in "0123456789"}, **{c: "q" for c in "abcdefghijklmnopqrstuvwxyz"}}
    swapped |= {c: "Q" for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZ"}
    changed = "".join(swapped.get(c, c) for c in call_id)
    return changed if changed != call_id else call_id[::-1]


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


def message_dicts(messages: list[ChatMessage], *, arguments: str = "object") -> list[dict[str, Any]]:
    """Messages as templates take them. Tool-call arguments become JSON objects, as vLLM passes them (the
    templates that iterate them, Qwen3-Coder, GLM-4.6, Seed-OSS, MiniMax-M2, raise on text); with
    ``arguments="text"`` they stay the JSON text, for templates that print them as they are."""
    dicts = [message.model_dump(mode="json", exclude_none=True) for message in messages]
    if arguments == "object":
        for message in dicts:
            for call in message.get("tool_calls") or ():
                call["function"]["arguments"] = _as_object(call["function"]["arguments"])
    return dicts


def _as_object(arguments: Any) -> Any:
    """JSON text of an object -> the object; anything else (not JSON, not an object) stays as it is."""
    if not isinstance(arguments, str):
        return arguments
    try:
        parsed = json.loads(arguments)
    except json.JSONDecodeError:
        return arguments
    return parsed if isinstance(parsed, dict) else arguments


def tool_dicts(tools: list[ToolSpec]) -> list[dict[str, Any]] | None:
    return [tool.model_dump(mode="json") for tool in tools] or None


class ChatRenderer:
    """Turns a request into prompt token ids with the model's own chat template.

    ``stop_ids``: the tokens the engine stops on (``generation_config.eos_token_id``, which may list several);
    by default the tokenizer's ``eos_token_id``. ``check_drift``: also render each continued request in full
    and say whether that differs from the continued prompt (``Prompt.render_drift``), where re-tokenizing
    the conversation would have changed what the policy saw; and fall back to that full render, marked
    ``prefix_break``, where the continued new part is not its tail. It costs a full render per continued
    turn; without it, only the stand-in histories guard a continuation.
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
        self._arguments: str | None = None
        self._closers: frozenset[int] | None = None
        self._local: bool | None = None
        self._system_in_place: bool | None = None
        self._users_in_a_row: bool | None = None

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

    @property
    def arguments(self) -> str:
        """How tool-call arguments reach this template: ``"object"`` (as vLLM passes them) unless the
        template raises on objects or prints them as Python (``{'q': 'x'}``), which means it expects text."""
        if self._arguments is None:
            call = {
                "id": _STAND_IN_ID,
                "type": "function",
                "function": {"name": "f", "arguments": {"q": "x"}},
            }
            probe: list[dict[str, Any]] = [
                {"role": "user", "content": _BASE_USER},
                {"role": "assistant", "content": "", "tool_calls": [call]},
            ]
            try:
                text = self.render(probe, None, add_generation_prompt=False)
            except Exception:  # a template that only takes text
                self._arguments = "text"
            else:
                self._arguments = "text" if "{'q': 'x'}" in text else "object"
        return self._arguments

    def messages(self, messages: list[ChatMessage]) -> list[dict[str, Any]]:
        """``messages`` as this template takes them: notes where it renders no system message, and runs of
        user messages joined where it refuses two in a row."""
        return self._joined(self._placed(messages))

    def _placed(self, messages: list[ChatMessage]) -> list[dict[str, Any]]:
        """One dict per message, a system message after the first as a note where the template needs one."""
        dicts = message_dicts(messages, arguments=self.arguments)
        if self.system_in_place or not dicts:
            return dicts
        return [dicts[0], *(_as_user_note(m) if m["role"] == "system" else m for m in dicts[1:])]

    def _joined(self, dicts: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """``dicts`` with each run of user messages as one, for a template that refuses two in a row (a note
        before or after a user message makes such a run). A run never crosses a continued turn's seam (its
        messages end in the assistant's reply), so the new part is joined on its own."""
        if self.users_in_a_row:
            return dicts
        joined: list[dict[str, Any]] = []
        for message in dicts:
            if joined and message["role"] == "user" == joined[-1]["role"]:
                texts = [joined[-1].get("content") or "", message.get("content") or ""]
                joined[-1] = {**joined[-1], "content": "\n\n".join(text for text in texts if text)}
            else:
                joined.append(message)
        return joined

    @property
    def users_in_a_row(self) -> bool:
        """Whether the template renders two user messages in a row. Mistral's and Gemma's raise ("roles
        must alternate user/assistant"); their runs are joined into one user message, as a client would have
        written it, so a note beside a user message does not fail the request."""
        if self._users_in_a_row is None:
            self._users_in_a_row = self._renders_note_as("user")
        return self._users_in_a_row

    def _renders_note_as(self, role: str) -> bool:
        """Whether a note as a ``role`` message between an assistant's reply and a user message renders,
        every message in it: without tools, or with them (Hermes-2-Pro's tool-use template raises without,
        whatever the messages)."""
        probe = [
            {"role": "user", "content": _BASE_USER},
            {"role": "assistant", "content": _BASE_ASSISTANT},
            {"role": role, "content": _NOTE},
            {"role": "user", "content": _BASE_USER},
        ]
        for tools in (None, _PROBE_TOOLS):
            try:
                rendered = self.render(probe, tools, add_generation_prompt=True)
            except Exception:  # a template that refuses the probe
                continue
            if _NOTE in rendered and rendered.count(_BASE_USER) == 2:
                return True
        return False

    @property
    def system_in_place(self) -> bool:
        """Whether the template renders a ``system`` message after the conversation began where it stands.
        A template that raises on one there (Qwen3.5: "System message must be at the beginning") or drops it
        (MiniMax-M2, gpt-oss) gets the nearest equivalent: a user message holding the note in
        ``<system-reminder>`` tags, as Claude Code writes its own reminders, so a later note still extends
        the prompt instead of being lost or failing the request."""
        if self._system_in_place is None:
            self._system_in_place = self._renders_note_as("system")
        return self._system_in_place

    def full(self, request: LLMRequest) -> list[int]:
        text = self.render(
            self.messages(request.messages), tool_dicts(request.tools), add_generation_prompt=True
        )
        return self.tokenizer.encode(text, add_special_tokens=False)

    def prompt(self, request: LLMRequest) -> Prompt:
        prefix = request.prefix
        if prefix is None:
            return Prompt(self.full(request), render_drift=False)
        if prefix.message_count >= len(request.messages) or not self.local:
            return Prompt(self.full(request), prefix_break=True, render_drift=False)
        new = self._joined(self._placed(request.messages)[prefix.message_count :])  # a note's form: its place
        tail = self.continuation(new, tool_dicts(request.tools))
        if tail is None:
            return Prompt(self.full(request), prefix_break=True, render_drift=False)
        ids = self.tokenizer.encode(tail, add_special_tokens=False)
        if prefix.ids and prefix.ids[-1] in self.stop_ids:
            ids = self._without_end_sequence(ids)
        prompt = Chain.of(prefix.ids).then(ids).tolist()  # the engines take a list; a held prefix is a Chain
        if not self.check_drift:
            return Prompt(prompt)
        full = self.full(request)
        if ids and full[-len(ids) :] != ids:
            # the glue or the new messages are not what the template renders for them in this conversation
            # (Gemma 4's thought channel, R1 distills' tool outputs, Command-R7b's end sequence): never
            # silently wrong, the template's own render marked prefix_break
            return Prompt(full, prefix_break=True, render_drift=False)
        return Prompt(prompt, render_drift=full != prompt)

    def continuation(self, new: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str | None:
        """The text that follows an assistant message's content when ``new`` comes next: its closing glue,
        the new messages and the generation prompt. None when it depends on the history (not message-local)
        or the template cannot render a stand-in history."""
        named = [m["tool_call_id"] for m in new if isinstance(m.get("tool_call_id"), str)]
        after_call = bool(new) and new[0].get("role") == "tool"
        histories = _stand_ins(_like(named[0]) if named else _STAND_IN_ID, after_call=after_call)
        if self.arguments == "text":
            for message in histories[2]:
                for call in message.get("tool_calls", ()):
                    call["function"]["arguments"] = json.dumps(call["function"]["arguments"])
        tails = set()
        for history in histories:
            try:
                rendered = self.render([*history, *new], tools, add_generation_prompt=True)
            except Exception:  # a template that raises on this shape: locality cannot be checked
                return None
            end = rendered.rfind(_BASE_ASSISTANT)
            if end < 0:
                return None  # the template dropped the assistant's content: nothing to cut at
            tails.add(rendered[end + len(_BASE_ASSISTANT) :])
        return tails.pop() if len(tails) == 1 else None

    @property
    def local(self) -> bool:
        """The start-up verdict: whether the probe's tool result and user follow-up render the same after
        every stand-in history. A template found not local is never continued: every turn is a full render
        marked ``prefix_break``, even where one request's tails happen to agree."""
        if self._local is None:
            self._local = not self._locality_problems()
        return self._local

    def _locality_problems(self) -> list[str]:
        problems = []
        for new in _PROBE_STEPS:
            if self.continuation(new, _PROBE_TOOLS) is None:
                problems.append(
                    f"the template renders a {new[0]['role']} message differently after different histories "
                    "(it keeps state across messages, or cannot render the stand-in history): such turns are "
                    "rendered in full and marked prefix_break"
                )
        return problems

    def diagnose(self) -> list[str]:
        """What this template does to continuation, in sentences for the consumer's start-up log: empty when
        a probe conversation (a tool call, its result, a follow-up) continues exactly without drift."""
        problems = self._locality_problems()
        self._local = not problems
        arguments: Any = {"q": "x"} if self.arguments == "object" else '{"q": "x"}'
        call = {"id": _PROBE_ID, "type": "function", "function": {"name": "lookup", "arguments": arguments}}
        probe: list[dict[str, Any]] = [
            {"role": "user", "content": "Look up x."},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            *_PROBE_STEPS[0],
            {"role": "assistant", "content": "It is found."},
            *_PROBE_STEPS[1],
        ]
        try:
            whole = self.render(probe, _PROBE_TOOLS, add_generation_prompt=True)
            pieces = self.render(probe[:2], _PROBE_TOOLS, add_generation_prompt=False)
        except Exception as error:  # a template that refuses the probe's shape
            return [*problems, f"the template cannot render a tool conversation ({error})"]
        if not whole.startswith(pieces):
            problems.append(
                "a full render of a conversation changes how earlier messages look (e.g. it strips earlier "
                "reasoning or whitespace): continued turns keep the tokens the policy saw, and render_drift "
                "marks where re-tokenizing would differ"
            )
        return problems

    @property
    def closers(self) -> frozenset[int]:
        """The tokens that close an assistant message: the engine's stop ids and the special tokens the
        template writes right after an assistant's content (Command-R: ``<|END_RESPONSE|>`` and
        ``<|END_OF_TURN_TOKEN|>``; ChatML: ``<|im_end|>``)."""
        if self._closers is None:
            closers = set(self.stop_ids)
            try:
                last = [
                    {"role": "user", "content": _BASE_USER},
                    {"role": "assistant", "content": _BASE_ASSISTANT},
                ]
                rendered = self.render(last, None, add_generation_prompt=False)
            except Exception:
                rendered = ""
            after = rendered[rendered.rfind(_BASE_ASSISTANT) + len(_BASE_ASSISTANT) :] if rendered else ""
            special = self._special_ids()
            for token in self.tokenizer.encode(after, add_special_tokens=False):
                if token in special:
                    closers.add(token)
                elif str(self.tokenizer.decode([token])).strip():
                    break  # past the closing markers
            self._closers = frozenset(closers)
        return self._closers

    def _special_ids(self) -> frozenset[int]:
        added = getattr(self.tokenizer, "added_tokens_decoder", None) or {}
        return frozenset([*added, *(getattr(self.tokenizer, "all_special_ids", None) or [])])

    def _without_end_sequence(self, ids: list[int]) -> list[int]:
        """``ids`` without the template's own end sequence where the glue starts with it (its closing
        markers and the whitespace before or between them): the completion already ended the message, and
        the seam must never hold two end markers."""
        cut = 0
        for index, token in enumerate(ids):
            if token in self.closers:
                cut = index + 1
            elif str(self.tokenizer.decode([token])).strip():
                break  # the next message begins
        return ids[cut:]


_PROBE_ID: Final = "call_1"
_PROBE_TOOLS: Final = tool_dicts(
    [ToolSpec.model_validate({"function": {"name": "lookup", "parameters": {"type": "object"}}})]
)
_PROBE_STEPS: Final[list[list[dict[str, Any]]]] = [
    [{"role": "tool", "tool_call_id": _PROBE_ID, "content": "found"}],
    [{"role": "user", "content": "Thanks. And y?"}],
]


def is_json_object(text: str) -> bool:
    """Whether ``text`` is the JSON text of an object (what a tool call's arguments must be)."""
    try:
        return isinstance(json.loads(text), dict)
    except (ValueError, RecursionError):
        return False


def split_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """Hermes ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks -> tool calls.

    Returns the text without the well-formed blocks, and the calls. A block whose JSON does not parse,
    lacks a name or has arguments that are not a JSON object, stays in the text so the agent (and the
    log) sees exactly what the model wrote.
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
        if not is_json_object(arguments_text):
            return match.group(0)  # clients (and the gateway) take a call's arguments as a JSON object
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
