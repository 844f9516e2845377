"""Random ids: ``new_uuid()``, a version-4 UUID as ``uuid.uuid4()`` makes it, for a fraction of its CPU.

Every turn mints several (its event and turn ids, the request's id) and every other event one.
``uuid.uuid4()`` asks the kernel for 16 random bytes each time (a system call) and builds its UUID
through ``UUID.__init__``, which checks and converts its argument in Python. Here the random bytes come
from the same source (``os.urandom``) 256 ids at a time, the version and variant bits are set with two
integer operations, and the value is stored the way ``UUID.__init__`` stores it. The buffer is dropped in
a child process after ``fork``, so no two processes hand out the same bytes. The result is an ordinary
``uuid.UUID`` (equal, hashable, pickled and printed like any); tests/unit/test_ids.py holds it to
``uuid.uuid4()``'s form.
"""

from __future__ import annotations

import os
import uuid
from typing import Final

_CLEAR: Final = ~((0xF000 << 64) | (0xC000 << 48))
_VERSION_4: Final = (0x4000 << 64) | (0x8000 << 48)  # version 4, RFC 4122 variant
_UNKNOWN: Final = uuid.SafeUUID.unknown
_BATCH: Final = 256
_new = object.__new__
_set = object.__setattr__


class _Random:
    """Random 128-bit values, read from ``os.urandom`` ``_BATCH`` at a time."""

    def __init__(self) -> None:
        self.values: list[int] = []

    def take(self) -> int:
        if not self.values:
            raw = os.urandom(16 * _BATCH)
            self.values = [int.from_bytes(raw[i : i + 16]) for i in range(0, len(raw), 16)]
        return self.values.pop()

    def forget(self) -> None:
        self.values = []


_random = _Random()
os.register_at_fork(after_in_child=_random.forget)


def new_uuid() -> uuid.UUID:
    """A random UUID (version 4) from ``os.urandom``: what ``uuid.uuid4()`` returns, made cheaper."""
    made = _new(uuid.UUID)
    _set(made, "int", (_random.take() & _CLEAR) | _VERSION_4)
    _set(made, "is_safe", _UNKNOWN)
    return made
