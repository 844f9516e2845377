"""Waiting on a condition in tests, under a generous bound (a loaded machine is slow, never wrong)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable


async def wait_until(
    condition: Callable[[], bool | Awaitable[bool]], within: float, what: str, *, every: float = 0.1
) -> None:
    """Return once ``condition()`` holds; ``AssertionError`` naming ``what`` after ``within`` seconds."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        result = condition()
        if result if isinstance(result, bool) else await result:
            return
        await asyncio.sleep(every)
    raise AssertionError(f"timed out after {within} s waiting for {what}")
