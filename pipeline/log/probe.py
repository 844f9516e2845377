"""A round trip to PostgreSQL on a connection held open between trips: how a service notices a server
restart even when the server is back before the next trip (the restart ends the held connection)."""

from __future__ import annotations

import contextlib
from typing import Any

import psycopg

from pipeline.settings import libpq_url


class DatabaseProbe:
    """``await probe.ping()`` returns once PostgreSQL answered ``SELECT 1``, and raises the driver's error
    when it did not (the connection is then dropped and made anew on the next ping)."""

    def __init__(self, url: str, *, connect_timeout: int = 5) -> None:
        self.url, self.connect_timeout = libpq_url(url), connect_timeout
        self._connection: psycopg.AsyncConnection[Any] | None = None

    async def ping(self) -> None:
        try:
            if self._connection is None:
                self._connection = await psycopg.AsyncConnection.connect(
                    self.url,
                    autocommit=True,
                    connect_timeout=self.connect_timeout,
                    application_name="turnstile probe",
                )
            await self._connection.execute("SELECT 1")
        except BaseException:
            await self.close()
            raise

    async def close(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            with contextlib.suppress(psycopg.Error, OSError):  # a broken connection may fail to close too
                await connection.close()
