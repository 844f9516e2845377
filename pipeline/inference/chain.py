"""An immutable sequence built from the chunks it was extended by, sharing the chunks before.

A consumer keeps each turn it answers (prompt + completion ids, messages) so the next turn need not send
them again; a 100-turn conversation's prompt reaches 32k ids. Copying the whole turn to keep it costs
O(history) a turn; a ``Chain`` that extends its parent's costs only the new items. Reading it whole walks
its chunks at C speed (``tolist``, iteration); its length and its last item are O(1).

The chunks are the lists the chain was given (never copied, so never mutate one after handing it over).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Any, TypeVar, overload

T = TypeVar("T")


class Chain(Sequence[T]):
    __slots__ = ("_length", "holders", "items", "parent", "size")

    def __init__(self, parent: Chain[T] | None, items: Sequence[T]) -> None:
        self.parent = parent
        self.items = items
        """This link's own chunk: what it adds to ``parent``."""
        self._length = (len(parent) if parent is not None else 0) + len(items)
        self.holders = 0
        """How many held turns and held child links need this link (kept by ``HeldPrefixes``)."""
        self.size = 0
        """The bytes ``HeldPrefixes`` counted for this link while it is held."""

    @classmethod
    def of(cls, items: Sequence[T]) -> Chain[T]:
        """``items`` as a chain: itself if it is one, else one link over the sequence (not copied)."""
        return items if isinstance(items, Chain) else cls(None, items)

    def then(self, items: Sequence[T]) -> Chain[T]:
        """This chain followed by ``items``, in O(1): a new link that shares this one."""
        return Chain(self, items) if items else self

    def chunks(self) -> list[Sequence[T]]:
        """The chunks from the first, non-empty ones only."""
        found = []
        link: Chain[T] | None = self
        while link is not None:
            if link.items:
                found.append(link.items)
            link = link.parent
        found.reverse()
        return found

    def tolist(self) -> list[T]:
        """A new list of the items (one C-speed extend per chunk)."""
        whole: list[T] = []
        for chunk in self.chunks():
            whole += chunk
        return whole

    def __len__(self) -> int:
        return self._length

    def __iter__(self) -> Iterator[T]:
        return itertools.chain.from_iterable(self.chunks())

    @overload
    def __getitem__(self, index: int) -> T: ...

    @overload
    def __getitem__(self, index: slice) -> list[T]: ...

    def __getitem__(self, index: int | slice) -> T | list[T]:
        """An item, or a slice as a list; O(the links after it), so O(1) near the end."""
        if isinstance(index, slice):
            start, stop, step = index.indices(self._length)
            if step != 1:
                return self.tolist()[index]
            return self._range(start, stop)
        position = index + self._length if index < 0 else index
        if not 0 <= position < self._length:
            raise IndexError("chain index out of range")
        link: Chain[T] | None = self
        while link is not None:
            offset = link._length - len(link.items)
            if position >= offset:
                return link.items[position - offset]
            link = link.parent
        raise AssertionError("unreachable: the links' lengths add up to the chain's")

    def _range(self, start: int, stop: int) -> list[T]:
        pieces = []
        link: Chain[T] | None = self
        while link is not None and stop > start:
            offset = link._length - len(link.items)
            if offset < stop:
                pieces.append(link.items[max(start - offset, 0) : stop - offset])
                stop = offset
            link = link.parent
        whole: list[T] = []
        for piece in reversed(pieces):
            whole += piece
        return whole

    def __eq__(self, other: object) -> bool:
        """Equal to any list, tuple or chain of the same items (``[1] == Chain.of([1])`` too)."""
        if not isinstance(other, list | tuple | Chain):
            return NotImplemented
        if len(other) != self._length:
            return False
        return self.tolist() == (other if isinstance(other, list) else list(other))

    __hash__: Any = None  # equal to lists, which have no hash

    def __repr__(self) -> str:
        return f"Chain({self.tolist()!r})"


def as_list(items: Sequence[T]) -> list[T]:
    """``items`` as a list: itself when it is one, else a new one (a chain's at C speed)."""
    if isinstance(items, list):
        return items
    return items.tolist() if isinstance(items, Chain) else list(items)
