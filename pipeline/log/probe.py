"""A round trip to PostgreSQL on a connection held open between trips: how a service notices a server
restart even when the server is back before the next trip (the restart ends the held connection)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import psycopg

from pipeline.settings import libpq_url


class DatabaseProbe:
    """``await probe.ping()`` returns once PostgreSQL answered ``SELECT 1``, and raises the driver's error
    when it did not, or ``TimeoutError`` after ``timeout`` seconds (a server killed mid-answer may leave the
    connection silent); the connection is then dropped and made anew on the next ping."""

    def __init__(self, url: str, *, timeout: float = 10.0) -> None:
        self.url, self.timeout = libpq_url(url), timeout
        self._connection: psycopg.AsyncConnection[Any] | None = None

    async def ping(self) -> None:
        try:
            async with asyncio.timeout(self.timeout):
                await self._round_trip()
        except BaseException:
            await self.close()
            raise

    async def _round_trip(self) -> None:
        if self._connection is None:
            self._connection = await psycopg.AsyncConnection.connect(
                self.url, autocommit=True, application_name="turnstile probe"
            )
        await self._connection.execute("SELECT 1")

    async def close(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            with contextlib.suppress(psycopg.Error, OSError):  # a broken connection may fail to close too
                await connection.close()
