"""What a sticky consumer keeps of its recent turns, so a request that continues one need not send it again.

After each reply the consumer keeps the turn's prompt + completion ids, its messages (the reply appended)
and its tools under a fresh key (``LLMResponse.tokens_key``). A request that continues the turn names the
key (``prefix.key``) and carries only its new messages. Memory is bounded by a token budget, least recently
used first; a key this consumer does not hold (evicted, another consumer's, a restart) gets
``prefix_unknown`` and the requester sends everything: correctness never depends on what is kept here.
"""

from __future__ import annotations

import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Final

from schemas import ChatMessage, ToolSpec

DEFAULT_BUDGET_TOKENS: Final = 4_000_000
"""Token ids are kept as the lists the engines take (8 bytes a reference; a turn shares its parent's int
objects), so a continuation costs a copy of references, not a conversion: at most ~150 MB at this budget."""


@dataclass(frozen=True, slots=True)
class HeldTurn:
    token_ids: list[int]
    messages: list[ChatMessage]
    tools: list[ToolSpec]


class HeldPrefixes:
    def __init__(self, budget_tokens: int = DEFAULT_BUDGET_TOKENS) -> None:
        self.budget_tokens = budget_tokens
        self.tokens = 0
        self.hits = 0
        self.misses = 0
        self._turns: OrderedDict[str, HeldTurn] = OrderedDict()

    def __len__(self) -> int:
        return len(self._turns)

    def keep(self, token_ids: list[int], messages: list[ChatMessage], tools: list[ToolSpec]) -> str | None:
        """Keep a turn; its key, or None when it alone is over the budget."""
        if len(token_ids) > self.budget_tokens:
            return None
        key = uuid.uuid4().hex
        self._turns[key] = HeldTurn(token_ids, messages, tools)
        self.tokens += len(token_ids)
        while self.tokens > self.budget_tokens:
            _, evicted = self._turns.popitem(last=False)
            self.tokens -= len(evicted.token_ids)
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
