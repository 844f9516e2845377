"""Running one host process for a sandbox command: its output kept (the tail of it), its time limit enforced.

Shared by the backends that drive a command-line tool per command (``bwrap``, ``docker exec``): each hands
over the argv and what ends the command's whole process tree when the limit passes.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence

from pipeline.harness.sandbox import ExecResult

OUTPUT_LIMIT = 1 << 20
"""Bytes of a command's output kept: the last MiB (an agent's log can be long; the end says how it ended)."""


class OutputTail:
    """The last ``limit`` bytes of a stream, kept in chunks so a long stream costs no more than its tail."""

    def __init__(self, limit: int = OUTPUT_LIMIT) -> None:
        self.limit = limit
        self.chunks: deque[bytes] = deque()
        self.size = 0
        self.dropped = 0

    def add(self, chunk: bytes) -> None:
        self.chunks.append(chunk)
        self.size += len(chunk)
        while self.size - len(self.chunks[0]) >= self.limit:
            first = self.chunks.popleft()
            self.size -= len(first)
            self.dropped += len(first)

    def text(self) -> str:
        kept = b"".join(self.chunks)
        note = f"[{self.dropped} bytes of output left out]\n" if self.dropped else ""
        return note + kept.decode("utf-8", errors="replace")


async def _collect(stream: asyncio.StreamReader, tail: OutputTail) -> None:
    while chunk := await stream.read(65536):
        tail.add(chunk)


async def run_limited(
    argv: Sequence[str],
    *,
    limit_s: float,
    on_timeout: Callable[[asyncio.subprocess.Process], Awaitable[None]],
    pass_fds: Sequence[int] = (),
    env: Mapping[str, str] | None = None,
) -> ExecResult:
    """Run ``argv`` with stdout and stderr together; past ``limit_s`` call ``on_timeout`` (which must end the
    command and everything it started) and report ``exit_code=None`` with the output so far."""
    started = time.monotonic()
    process = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        pass_fds=pass_fds,
        env=env,
    )
    assert process.stdout is not None
    tail = OutputTail()
    reading = asyncio.create_task(_collect(process.stdout, tail))
    try:
        code: int | None = await asyncio.wait_for(process.wait(), limit_s)
    except TimeoutError:
        code = None
        await on_timeout(process)
        await process.wait()
    except asyncio.CancelledError:
        # The harness gave up on this command (Ctrl-C): it must not outlive the caller.
        await on_timeout(process)
        await process.wait()
        raise
    finally:
        # A process the command left behind may hold the pipe open: the output ends with the command.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(reading), 5)
        reading.cancel()
    return ExecResult(exit_code=code, output=tail.text(), seconds=time.monotonic() - started)


async def kill_process(process: asyncio.subprocess.Process) -> None:
    """SIGKILL one process (a bwrap whose pid namespace then ends with it)."""
    with contextlib.suppress(ProcessLookupError):
        process.kill()
