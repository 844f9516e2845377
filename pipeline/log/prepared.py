"""One prepared statement run through libpq itself (``psycopg.pq``), for the event store's lone append.

At one episode every turn is an append of its own, and each is one statement (``append_events``, migration
0016) on the writer's autocommit connection. Run through a psycopg cursor, that statement pays for what a
cursor does for any query: the query converted and looked up in the prepared-statement cache, every
parameter passed to a dumper, the result wrapped for fetching, and a wait that arms a timer besides the
socket's reader. The parameters here are bytes in PostgreSQL's binary form already (``binary_arrays``) and
the result is one integer, so none of that is needed: ``PreparedStatement`` sends the statement by name
with ``PGconn.send_query_prepared`` and waits for the socket with the event loop's reader alone. What it
saves per append is in docs/benchmarks-gateway.md.

Errors come out as psycopg's own (``psycopg.errors.error_from_result``: an ``IntegrityError`` for a refused
row, ``LockNotAvailable`` for the append lock, ``OperationalError`` for a lost connection), so the writer
handles them as it handles a cursor's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, Final

import psycopg
from psycopg import pq
from psycopg.errors import error_from_result

_BAD: Final = (pq.ExecStatus.FATAL_ERROR, pq.ExecStatus.BAD_RESPONSE, pq.ExecStatus.NONFATAL_ERROR)


class PreparedStatement:
    """A statement prepared once per connection (``PREPARE name (types) AS query``, by SQL: libpq runs a
    statement prepared that way by its name) and run with binary parameters, one text value back."""

    def __init__(self, name: str, types: Sequence[str], query: str) -> None:
        self.name = name
        self._name = name.encode()
        self._formats = [pq.Format.BINARY] * len(types)
        self._prepare = f"PREPARE {name} ({', '.join(types)}) AS {query}"
        self._prepared_on: psycopg.AsyncConnection[Any] | None = None

    async def run(self, connection: psycopg.AsyncConnection[Any], params: Sequence[bytes]) -> bytes | None:
        """Run the statement on ``connection`` (autocommit, used by nobody else meanwhile) with ``params``;
        the first column of its first row, as text (None for NULL or no row)."""
        if self._prepared_on is not connection:
            await connection.execute(self._prepare)
            self._prepared_on = connection
        pgconn = connection.pgconn
        pgconn.send_query_prepared(self._name, params, param_formats=self._formats)
        try:
            first = await _results(pgconn)
        except BaseException:
            # Cancelled or broken with the statement in flight: the connection's state is unknown, so it is
            # not used again (the writer sees it broken and connects anew).
            pgconn.finish()
            raise
        if first is None:
            raise psycopg.OperationalError(f"no result for {self.name}: the connection was lost")
        if first.status in _BAD:
            raise error_from_result(first, encoding=connection.info.encoding)
        return first.get_value(0, 0) if first.ntuples else None


async def _results(pgconn: pq.abc.PGconn) -> pq.abc.PGresult | None:
    """Send what is left of the statement, then read its results: the first error, else the last result."""
    loop = asyncio.get_running_loop()
    while pgconn.flush():  # 1: a large append is still being sent
        await _ready(loop, pgconn.socket, write=True)
    first: pq.abc.PGresult | None = None
    while True:
        pgconn.consume_input()
        while pgconn.is_busy():
            await _ready(loop, pgconn.socket, write=False)
            pgconn.consume_input()
        result = pgconn.get_result()
        if result is None:
            return first
        if first is None or (result.status in _BAD and first.status not in _BAD):
            first = result  # the first error wins, as psycopg reports it


async def _ready(loop: asyncio.AbstractEventLoop, fileno: int, *, write: bool) -> None:
    """Until ``fileno`` can be written (``write``) or read: one future, woken by the loop's watcher."""
    ready = loop.create_future()
    watch, unwatch = (loop.add_writer, loop.remove_writer) if write else (loop.add_reader, loop.remove_reader)

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    watch(fileno, wake)
    try:
        await ready
    finally:
        unwatch(fileno)
