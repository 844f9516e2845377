"""What a sticky consumer keeps of its recent turns, so a request that continues one need not send it again.

After each reply the consumer keeps the turn's prompt + completion ids, its messages (the reply appended)
and its tools under a fresh key (``LLMResponse.tokens_key``). A request that continues the turn names the
key (``prefix.key``) and carries only its new messages. Memory is bounded by a token budget, least recently
used first; a key this consumer does not hold (evicted, another consumer's, a restart) gets
``prefix_unknown`` and the requester sends everything: correctness never depends on what is kept here.

A turn is kept as a ``Chain`` that extends the turn it continued, so keeping it costs what it adds, not its
history. The budget counts the ids held in memory: each link once, however many held turns share it, for
as long as a held turn reaches it (a link is counted by reference: held turns at it and held links after
it). Evicting a turn whose link no other held turn needs frees that link, then its parent's if nothing else
needs that, and so on: shared links never keep evicted turns' ids alive past the budget.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from pipeline.inference.chain import Chain
from schemas import ChatMessage, ToolSpec

DEFAULT_BUDGET_TOKENS: Final = 4_000_000
"""Token ids are kept in the lists the engines returned (a reference and an int object each, ~40 bytes): at
most ~160 MB at this budget."""


@dataclass(frozen=True, slots=True)
class HeldTurn:
    token_ids: Chain[int]
    messages: Chain[ChatMessage]
    tools: list[ToolSpec]


class HeldPrefixes:
    def __init__(self, budget_tokens: int = DEFAULT_BUDGET_TOKENS) -> None:
        self.budget_tokens = budget_tokens
        self.tokens = 0
        """Token ids held in memory: each link of the held turns' chains counted once."""
        self.hits = 0
        self.misses = 0
        self._turns: OrderedDict[str, HeldTurn] = OrderedDict()

    def __len__(self) -> int:
        return len(self._turns)

    def keep(
        self, token_ids: Sequence[int], messages: Sequence[ChatMessage], tools: list[ToolSpec]
    ) -> str | None:
        """Keep a turn; its key, or None when it alone is over the budget."""
        if len(token_ids) > self.budget_tokens:
            return None
        key = os.urandom(16).hex()  # as unguessable as a uuid4's hex, without building a UUID
        turn = HeldTurn(Chain.of(token_ids), Chain.of(messages), tools)
        self._turns[key] = turn
        self._hold(turn.token_ids)
        while self.tokens > self.budget_tokens:
            _, evicted = self._turns.popitem(last=False)
            self._release(evicted.token_ids)
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

    def _hold(self, link: Chain[int] | None) -> None:
        """One more holder of ``link``; a link held for the first time counts its ids and holds its parent."""
        while link is not None:
            link.holders += 1
            if link.holders > 1:
                return
            self.tokens += len(link.items)
            link = link.parent

    def _release(self, link: Chain[int] | None) -> None:
        """One holder fewer of ``link``; a link no one holds now frees its ids and releases its parent."""
        while link is not None:
            link.holders -= 1
            if link.holders > 0:
                return
            self.tokens -= len(link.items)
            link = link.parent
