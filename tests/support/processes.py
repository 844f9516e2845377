"""Processes a test starts, stopped whatever happens: a failed assertion or a timed-out wait in the test must
not leave a service running on the machine (it would hold ports, consume a stream, write to a database)."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
from collections.abc import AsyncIterator, Iterator
from typing import Any


@contextlib.asynccontextmanager
async def running(*command: str, **options: Any) -> AsyncIterator[asyncio.subprocess.Process]:
    """``asyncio.create_subprocess_exec(*command, **options)``, killed on the way out if still running."""
    process = await asyncio.create_subprocess_exec(*command, **options)
    try:
        yield process
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


@contextlib.contextmanager
def stopping(process: subprocess.Popen[Any]) -> Iterator[subprocess.Popen[Any]]:
    """``process`` (started with ``subprocess.Popen``), killed on the way out if still running."""
    try:
        yield process
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
