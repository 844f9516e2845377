"""What a sticky consumer keeps of its recent turns, so a request that continues one need not send it again.

After each reply the consumer keeps the turn's prompt + completion ids, its messages (the reply appended)
and its tools under a fresh key (``LLMResponse.tokens_key``). A request that continues the turn names the
key (``prefix.key``) and carries only its new messages. Memory is bounded by a budget in bytes, least
recently used first; a key this consumer does not hold (evicted, another consumer's, a restart) gets
``prefix_unknown`` and the requester sends everything: correctness never depends on what is kept here.

A turn is kept as two ``Chain``s (ids, messages) that extend the turn it continued, so keeping it costs what
it adds, not its history. The budget counts what the held turns reach: each link once, however many held
turns share it, for as long as a held turn reaches it (a link is counted by reference: held turns at it and
held links after it), and each tools list once. Evicting a turn whose links no other held turn needs frees
them, then their parents if nothing else needs those, and so on: shared links never keep evicted turns'
memory alive past the budget.

Bytes are what CPython allocates for them, estimated without walking the history: 40 a token id (a list
slot and an int object), a message's strings as ``sys.getsizeof`` counts them plus its objects' own size, a
tools list's JSON values likewise. The constants were measured with tracemalloc (bench/inference_memory.py
prints accounted against measured).
"""

from __future__ import annotations

import os
import sys
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final, TypeVar

from pipeline.inference.chain import Chain
from schemas import ChatMessage, ToolSpec

T = TypeVar("T")

DEFAULT_BUDGET_BYTES: Final = 256 * 2**20
TOKEN_ID_BYTES: Final = 40
"""A token id in the lists the engines return: an 8-byte slot and an int object (28 bytes, 32 allocated)."""
MESSAGE_BYTES: Final = 720
"""A ChatMessage's own objects (the model, its __dict__, its fields-set) and its slot in a chunk."""
TOOL_CALL_BYTES: Final = 1_100
"""A ToolCall with its FunctionCall (two models, their dicts and fields-sets), without the strings."""
TOOL_BYTES: Final = 1_100
"""A ToolSpec with its FunctionSpec, without its name, description and parameters."""
TURN_BYTES: Final = 400
"""A held turn's own objects: its key, the HeldTurn, its place in the LRU order, two chain links."""


@dataclass(frozen=True, slots=True)
class HeldTurn:
    token_ids: Chain[int]
    messages: Chain[ChatMessage]
    tools: list[ToolSpec]


class HeldPrefixes:
    def __init__(self, budget_bytes: int = DEFAULT_BUDGET_BYTES) -> None:
        self.budget_bytes = budget_bytes
        self.bytes = 0
        """What the held turns reach, estimated in bytes: never above ``budget_bytes`` after a ``keep``."""
        self.tokens = 0
        """Token ids held in memory: each link of the held turns' chains counted once."""
        self.hits = 0
        self.misses = 0
        self.evicted = 0
        self._turns: OrderedDict[str, HeldTurn] = OrderedDict()
        self._tools: dict[int, tuple[list[ToolSpec], int, int]] = {}
        """id of a held tools list -> (the list, held turns using it, its bytes)."""

    def __len__(self) -> int:
        return len(self._turns)

    def keep(
        self, token_ids: Sequence[int], messages: Sequence[ChatMessage], tools: list[ToolSpec]
    ) -> str | None:
        """Keep a turn; its key, or None when it alone is over the budget."""
        if len(token_ids) * TOKEN_ID_BYTES + TURN_BYTES > self.budget_bytes:
            return None
        key = os.urandom(16).hex()  # as unguessable as a uuid4's hex, without building a UUID
        turn = HeldTurn(Chain.of(token_ids), Chain.of(messages), tools)
        self._turns[key] = turn
        self._hold(turn)
        while self.bytes > self.budget_bytes:
            evicted_key, evicted = self._turns.popitem(last=False)
            self._release(evicted)
            self.evicted += 1
            if evicted_key == key:  # its messages or tools alone are over the budget
                return None
        return key

    def take(self, key: str, token_count: int, message_count: int) -> HeldTurn | None:
        """The turn kept under ``key`` if it has that many tokens and messages (else None: not held)."""
        turn = self._turns.get(key)
        if turn is None or len(turn.token_ids) != token_count or len(turn.messages) != message_count:
            self.misses += 1
            return None
        self._turns.move_to_end(key)
        self.hits += 1
        return turn

    def _hold(self, turn: HeldTurn) -> None:
        self.bytes += TURN_BYTES
        self.tokens += self._hold_links(turn.token_ids, ids_bytes)
        self._hold_links(turn.messages, messages_bytes)
        tools, holders, size = self._tools.get(id(turn.tools), (turn.tools, 0, 0))
        if not holders:
            size = tools_bytes(tools)
            self.bytes += size
        self._tools[id(tools)] = (tools, holders + 1, size)

    def _release(self, turn: HeldTurn) -> None:
        self.bytes -= TURN_BYTES
        self.tokens -= self._release_links(turn.token_ids)
        self._release_links(turn.messages)
        tools, holders, size = self._tools[id(turn.tools)]
        if holders == 1:
            del self._tools[id(tools)]
            self.bytes -= size
        else:
            self._tools[id(tools)] = (tools, holders - 1, size)

    def _hold_links(self, link: Chain[T] | None, size_of: Callable[[Sequence[T]], int]) -> int:
        """One more holder of ``link``; a link held for the first time counts its bytes and holds its
        parent. Returns how many items became held."""
        added = 0
        while link is not None:
            link.holders += 1
            if link.holders > 1:
                break
            link.size = size_of(link.items)
            self.bytes += link.size
            added += len(link.items)
            link = link.parent
        return added

    def _release_links(self, link: Chain[T] | None) -> int:
        """One holder fewer of ``link``; a link no one holds now frees its bytes and releases its parent.
        Returns how many items were freed."""
        freed = 0
        while link is not None:
            link.holders -= 1
            if link.holders > 0:
                break
            self.bytes -= link.size
            freed += len(link.items)
            link = link.parent
        return freed


def ids_bytes(ids: Sequence[int]) -> int:
    return len(ids) * TOKEN_ID_BYTES


def messages_bytes(messages: Sequence[ChatMessage]) -> int:
    size = 0
    for message in messages:
        size += MESSAGE_BYTES + _strings_bytes(
            message.content, message.name, message.tool_call_id, message.reasoning_content
        )
        for call in message.tool_calls or ():
            size += TOOL_CALL_BYTES + _strings_bytes(call.id, call.function.name, call.function.arguments)
    return size


def _strings_bytes(*strings: str | None) -> int:
    return sum(sys.getsizeof(text) for text in strings if text is not None)


def tools_bytes(tools: list[ToolSpec]) -> int:
    """A tools list's size: computed once per list (continuing turns share their root's list)."""
    size = sys.getsizeof(tools)
    for tool in tools:
        function = tool.function
        size += TOOL_BYTES + _strings_bytes(function.name, function.description)
        size += _json_bytes(function.parameters)
    return size


def _json_bytes(value: object) -> int:
    """The memory of a JSON value held as Python objects: containers and their contents."""
    size = sys.getsizeof(value)
    if isinstance(value, dict):
        size += sum(_json_bytes(key) + _json_bytes(item) for key, item in value.items())
    elif isinstance(value, list):
        size += sum(_json_bytes(item) for item in value)
    return size
