"""The browser's database access: read-only, as the reader role, like ``turnstile sql``.

Every connection opens with ``default_transaction_read_only=on`` and switches to ``turnstile_reader``
(``SET ROLE``) before any query, so a page can only read; a statement timeout bounds every query. A
superuser login is refused unless allowed, for the reason ``turnstile sql`` gives: a query could switch
back to it. The pages send only queries of their own (no SQL from the URL), so the role is a second line.
"""

from __future__ import annotations

from typing import Any

import psycopg
import sqlalchemy as sa
import sqlalchemy.exc
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from pipeline.errors import TurnstileError
from pipeline.settings import sqlalchemy_url
from pipeline.sql import READER_ROLE

STATEMENT_TIMEOUT_MS = 30_000


class DatabaseUnavailable(TurnstileError):
    """PostgreSQL could not be reached or refused the reader login."""


def reader_engine(url: str, *, pool_size: int = 5) -> AsyncEngine:
    """An engine whose every connection is read-only and acts as the reader role."""
    engine = create_async_engine(
        sqlalchemy_url(url),
        pool_size=pool_size,
        max_overflow=pool_size,
        pool_pre_ping=True,
        connect_args={
            "options": f"-c default_transaction_read_only=on -c statement_timeout={STATEMENT_TIMEOUT_MS}",
            "application_name": "turnstile ui",
        },
    )

    @sa.event.listens_for(engine.sync_engine, "connect")
    def _enter_reader(dbapi_connection: Any, _record: Any) -> None:
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute(f"SET ROLE {READER_ROLE}")
        finally:
            cursor.close()
        dbapi_connection.commit()

    return engine


async def check_login(engine: AsyncEngine, *, allow_superuser: bool) -> None:
    """Refuse a superuser login (unless allowed) and a server where the reader role is missing, with what to
    do about it; raise ``DatabaseUnavailable`` when PostgreSQL cannot be reached."""
    try:
        async with engine.connect() as connection:
            row = (
                await connection.execute(
                    sa.text("SELECT rolsuper, current_user FROM pg_roles WHERE rolname = session_user")
                )
            ).one()
    except sqlalchemy.exc.DBAPIError as error:
        cause = error.orig
        if isinstance(cause, psycopg.errors.InvalidParameterValue):
            raise DatabaseUnavailable(
                f"role {READER_ROLE} does not exist on this server: run `turnstile migrate` first"
            ) from None
        if isinstance(cause, psycopg.errors.InsufficientPrivilege):
            raise DatabaseUnavailable(
                f"this login may not switch to role {READER_ROLE}; an administrator can allow it with "
                f"GRANT {READER_ROLE} TO <user>"
            ) from None
        first = str(cause or error).strip().splitlines()
        raise DatabaseUnavailable(f"cannot connect to PostgreSQL: {first[0] if first else error}") from None
    if row.rolsuper and not allow_superuser:
        raise DatabaseUnavailable(
            "the database login is a superuser: a query could switch back to it from the reader role. "
            "Connect as a reader login instead (TURNSTILE_READER_URL; `turnstile up` prints one), or pass "
            "--allow-superuser if you accept that"
        )
