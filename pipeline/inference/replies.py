"""The replies an inference consumer keeps for answering retries: a client that resends a request (the same
request id and bytes) after its reply was lost gets the same reply, not a second generation.

A retry comes within seconds of its request, so only the newest replies are kept, bounded two ways, oldest
dropped first: by count (``max_replies``) and by bytes (``max_bytes``). The count alone was not a bound on
memory: a reply carries every prompt id of a request sent whole, up to the NATS server's max_payload each.
A request whose reply was dropped and that comes again is generated again; nothing else depends on what is
kept here.
"""

from __future__ import annotations

import uuid
from collections import OrderedDict
from typing import Final

DEFAULT_REPLIES: Final = 4096
DEFAULT_BYTES: Final = 64 * 2**20
ENTRY_BYTES: Final = 400
"""A kept reply's own objects besides its body: the request id, the digest, the tuple, its place in order."""


class RetryReplies:
    """Request id -> (digest of the request's bytes, the reply's body), the newest ``max_replies`` within
    ``max_bytes`` (0 of either: nothing is kept)."""

    def __init__(self, max_replies: int = DEFAULT_REPLIES, max_bytes: int = DEFAULT_BYTES) -> None:
        self.max_replies = max_replies
        self.max_bytes = max_bytes
        self.bytes = 0
        """What the kept replies take: each body's length plus ``ENTRY_BYTES``."""
        self.evicted = 0
        """Replies dropped (or never kept: larger than ``max_bytes`` alone) to stay within the bounds."""
        self._replies: OrderedDict[uuid.UUID, tuple[bytes, bytes]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._replies)

    def get(self, request_id: uuid.UUID) -> tuple[bytes, bytes] | None:
        return self._replies.get(request_id)

    def keep(self, request_id: uuid.UUID, digest: bytes, body: bytes) -> None:
        size = _size(body)
        if size > self.max_bytes or self.max_replies < 1:
            self.evicted += 1
            return
        known = self._replies.pop(request_id, None)
        if known is not None:
            self.bytes -= _size(known[1])
        self._replies[request_id] = (digest, body)
        self.bytes += size
        while len(self._replies) > self.max_replies or self.bytes > self.max_bytes:
            _, (_, dropped) = self._replies.popitem(last=False)
            self.bytes -= _size(dropped)
            self.evicted += 1


def _size(body: bytes) -> int:
    return len(body) + ENTRY_BYTES
