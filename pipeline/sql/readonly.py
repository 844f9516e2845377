"""``turnstile sql``: one query, read-only, and its result as a table, CSV or JSON.

A query runs in a ``READ ONLY`` transaction as the role ``turnstile_reader`` (``SET LOCAL ROLE``; made by
migration 0004, with SELECT on every table and view), under a statement timeout, and is always rolled back.
It is sent with the extended query protocol, which takes exactly one statement, so ``SELECT 1; DELETE ...``
is refused by PostgreSQL before anything runs. Statements that a read-only transaction would allow but that
reach outside the database or end the transaction (COPY, DO, SET, COMMIT ...) are refused before sending.

The role switch is a guard rail, not a security boundary, when the configured user is a superuser: a
SELECT can call ``set_config('role', ...)``; the read-only transaction still refuses every write. For a
hard boundary point ``TURNSTILE_DATABASE_URL`` at a login role that is not a superuser.

Values in JSON: timestamps and dates ISO 8601, intervals in seconds, UUIDs and other scalars as strings,
numerics as numbers, NaN and infinities as the strings PostgreSQL prints ("NaN", "Infinity"), bytea as
PostgreSQL's hex form (``"\\x0a0b"``), jsonb and arrays as JSON. Duplicate column names get ``_2``, ``_3``
suffixes as JSON keys. CSV uses the same text forms, except numeric exactly as stored, with NULL as an
empty field. The table is for people: numbers rounded, timestamps with a space, intervals as H:MM:SS,
bytea as its length.
"""

from __future__ import annotations

import csv
import datetime as dt
import io
import json
import math
import re
import uuid
from collections.abc import Mapping
from contextlib import suppress
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import psycopg
from psycopg import errors, sql
from rich.table import Table
from rich.text import Text

from pipeline.errors import TurnstileError
from pipeline.settings import libpq_url

READER_ROLE = "turnstile_reader"
DEFAULT_TIMEOUT_S = 60.0
READ_MODELS = (
    "tables episodes, turns, samples, batches, events; views episode_stats, reward_by_policy_version, "
    "group_rewards, turn_latency_by_consumer, prefix_break_rate_by_agent, batch_staleness, terminations"
)
QUERY_KINDS = "SELECT, WITH, VALUES, TABLE, EXPLAIN or SHOW"
# Statements PostgreSQL runs in a read-only transaction that still act outside it (files, programs,
# other sessions, transaction control, settings such as the role). Everything else goes to the server,
# whose read-only transaction refuses writes (INSERT, CREATE ...) in its own words.
REFUSED_STATEMENTS = frozenset(
    {
        "ABORT", "ANALYZE", "ANALYSE", "BEGIN", "CALL", "CHECKPOINT", "CLOSE", "CLUSTER", "COMMIT", "COPY",
        "DEALLOCATE", "DECLARE", "DISCARD", "DO", "END", "EXECUTE", "FETCH", "IMPORT", "LISTEN", "LOAD",
        "LOCK", "MOVE", "NOTIFY", "PREPARE", "REASSIGN", "REFRESH", "REINDEX", "RELEASE", "RESET",
        "ROLLBACK", "SAVEPOINT", "SECURITY", "SET", "START", "UNLISTEN", "VACUUM",
    }
)  # fmt: skip


class SqlError(TurnstileError):
    """PostgreSQL refused the query (syntax, unknown column, timeout ...)."""


class ReadOnlyViolation(SqlError):
    """The query tried to write, or to do something else than read."""


@dataclass(frozen=True)
class QueryResult:
    columns: list[str]
    rows: list[tuple[Any, ...]]
    truncated: bool = False  # limit_rows cut it short


def run_readonly(
    database_url: str,
    query: str,
    *,
    search_path: str | None = None,
    limit_rows: int | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    allow_superuser: bool = False,
    params: Mapping[str, Any] | None = None,
) -> QueryResult:
    """Run one query read-only as ``turnstile_reader``; ``search_path`` is a schema searched before public;
    ``params`` fill ``%(name)s`` placeholders (without them the text is sent as it is, ``%`` included).

    Refuses to run when the login is a superuser unless ``allow_superuser``: a query can switch back from
    the reader role to its login (``set_config('role', ...)``), and a superuser can then read server files
    or stop other sessions. Log in as a user that is not a superuser (``turnstile up`` prints one).
    """
    _check_statement(query)
    try:
        connection = psycopg.connect(
            libpq_url(database_url),
            connect_timeout=10,
            application_name="turnstile sql",
            options="-c default_transaction_read_only=on",
        )
    except psycopg.OperationalError as error:
        raise SqlError(f"cannot connect to PostgreSQL: {_first_line(str(error))}") from None
    try:
        connection.read_only = True  # the first statement opens the transaction with BEGIN READ ONLY
        if not allow_superuser:
            _refuse_superuser(connection)
        _enter_reader(connection, search_path, timeout_s)
        with connection.cursor() as cursor:
            # prepare=True sends Parse/Bind/Execute (the extended protocol), which takes one statement
            # only; without it psycopg uses the simple protocol, which runs every statement of the string.
            # (bytes: the query is the user's text, not a literal of ours.)
            cursor.execute(query.encode(), params, prepare=True)
            return _fetch(cursor, limit_rows)
    except psycopg.Error as error:
        raise _translate(error, query, timeout_s) from None
    finally:
        with suppress(psycopg.Error):
            connection.rollback()
        connection.close()


def _refuse_superuser(connection: psycopg.Connection[Any]) -> None:
    row = connection.execute("SELECT rolsuper FROM pg_roles WHERE rolname = session_user").fetchone()
    if row is not None and row[0]:
        raise SqlError(
            f"PostgreSQL user {connection.info.user!r} is a superuser: a query could switch back to it and "
            "read server files or stop other sessions. Connect as a reader login instead "
            "(TURNSTILE_READER_URL; `turnstile up` prints one), or pass --allow-superuser if you accept that"
        )


def _enter_reader(connection: psycopg.Connection[Any], search_path: str | None, timeout_s: float) -> None:
    try:
        connection.execute(
            sql.SQL("SET LOCAL statement_timeout = {}").format(sql.Literal(max(1, round(timeout_s * 1000))))
        )
        connection.execute(sql.SQL("SET LOCAL ROLE {}").format(sql.Identifier(READER_ROLE)))
    except errors.InvalidParameterValue:
        raise SqlError(
            f"role {READER_ROLE} does not exist on this server: run `turnstile migrate` first"
        ) from None
    except errors.InsufficientPrivilege:
        user = connection.info.user
        raise SqlError(
            f"user {user!r} may not switch to role {READER_ROLE}; an administrator can allow it with "
            f"GRANT {READER_ROLE} TO {user}"
        ) from None
    if search_path is None:
        return
    row = connection.execute(
        "SELECT has_schema_privilege(%s, oid, 'USAGE') FROM pg_namespace WHERE nspname = %s",
        (READER_ROLE, search_path),
    ).fetchone()
    if row is None:
        rebuilds = [
            name
            for (name,) in connection.execute(
                "SELECT nspname FROM pg_namespace WHERE nspname LIKE 'rm\\_%' ORDER BY nspname"
            ).fetchall()
        ]
        raise SqlError(
            f"schema {search_path!r} does not exist (schemas of rebuilt read models here: "
            f"{', '.join(rebuilds) or 'none'}; make one with `turnstile rematerialize --name NAME`)"
        )
    if not row[0]:
        raise SqlError(
            f"role {READER_ROLE} may not read schema {search_path!r} (rebuilt before rebuilds granted it): "
            f"as the login that made it (TURNSTILE_DATABASE_URL), GRANT USAGE ON SCHEMA {search_path} "
            f"TO {READER_ROLE}; GRANT SELECT ON ALL TABLES IN SCHEMA {search_path} TO {READER_ROLE}"
        )
    connection.execute(sql.SQL("SET LOCAL search_path TO {}, public").format(sql.Identifier(search_path)))


def _fetch(cursor: psycopg.Cursor[Any], limit_rows: int | None) -> QueryResult:
    if cursor.description is None:
        return QueryResult([], [])
    columns = [column.name for column in cursor.description]
    if limit_rows is None:
        return QueryResult(columns, cursor.fetchall())
    rows = cursor.fetchmany(limit_rows + 1)
    return QueryResult(columns, rows[:limit_rows], truncated=len(rows) > limit_rows)


_SKIP = re.compile(r"(?:\s+|--[^\n]*|\()+")
_WORD = re.compile(r"[A-Za-z_]+")


def _statement_start(query: str) -> int:
    """Where the statement begins: after whitespace, comments and opening parentheses."""
    index = 0
    while index < len(query):
        if skipped := _SKIP.match(query, index):
            index = skipped.end()
        elif query.startswith("/*", index):
            index = _block_comment_end(query, index)
        else:
            break
    return index


def statement_keyword(query: str) -> str:
    """The first keyword of a query, upper case ("" when it starts otherwise)."""
    word = _WORD.match(query, _statement_start(query))
    return word.group().upper() if word else ""


def _block_comment_end(query: str, start: int) -> int:
    depth, index = 0, start
    while index < len(query):
        if query.startswith("/*", index):
            depth, index = depth + 1, index + 2
        elif query.startswith("*/", index):
            depth, index = depth - 1, index + 2
            if depth == 0:
                return index
        else:
            index += 1
    return index


def _check_statement(query: str) -> None:
    keyword = statement_keyword(query)
    if query[_statement_start(query) :].strip(" \t\r\n;") == "":
        raise SqlError('the query is empty: give one SQL query, e.g. "SELECT * FROM episode_stats"')
    if keyword in REFUSED_STATEMENTS:
        raise ReadOnlyViolation(
            f"turnstile sql is read-only: it runs one query ({QUERY_KINDS}), and {keyword} is not one. "
            f"Read the read models instead ({READ_MODELS})"
        )


def _translate(error: psycopg.Error, query: str, timeout_s: float) -> SqlError:
    said = _describe(error, query)
    if isinstance(
        error, errors.ReadOnlySqlTransaction | errors.InsufficientPrivilege | errors.ActiveSqlTransaction
    ):
        return ReadOnlyViolation(
            f"turnstile sql is read-only: {said}\nIt runs one query ({QUERY_KINDS}) as role {READER_ROLE}; "
            f"read the read models instead ({READ_MODELS})"
        )
    if isinstance(error, errors.SyntaxError) and "multiple commands" in (error.diag.message_primary or ""):
        return ReadOnlyViolation(
            f"turnstile sql is read-only and runs one statement at a time: {said}\n"
            "Send each query on its own (a trailing ';' is fine)"
        )
    if isinstance(error, errors.QueryCanceled):
        return SqlError(
            f"the query ran longer than the statement timeout ({timeout_s:g} s) and was cancelled: "
            "narrow it (WHERE, LIMIT) or give it more time with --timeout"
        )
    return SqlError(f"PostgreSQL refused the query: {said}")


def _describe(error: psycopg.Error, query: str) -> str:
    """PostgreSQL's message, with the query line it points at (as psql shows it), detail and hint."""
    diag = error.diag
    parts = [diag.message_primary or _first_line(str(error))]
    if diag.statement_position and diag.statement_position.isdigit():
        parts.append(_pointer(query, int(diag.statement_position) - 1))
    if diag.message_detail:
        parts.append(f"  DETAIL: {diag.message_detail}")
    if diag.message_hint:
        parts.append(f"  HINT: {diag.message_hint}")
    return "\n".join(parts)


def _pointer(query: str, offset: int, width: int = 60) -> str:
    line_start = query.rfind("\n", 0, offset) + 1
    line_end = query.find("\n", offset)
    line = query[line_start : len(query) if line_end < 0 else line_end]
    column = offset - line_start
    start = max(0, min(column - width // 2, len(line) - width))
    shown = line[start : start + width]
    prefix = f"  LINE {query.count(chr(10), 0, line_start) + 1}: " + ("..." if start else "")
    suffix = "..." if start + width < len(line) else ""
    return f"{prefix}{shown}{suffix}\n{' ' * (len(prefix) + column - start)}^"


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else text


# -- formatting ----------------------------------------------------------------------------------------


def jsonable(value: Any) -> Any:
    """A value as JSON can hold it (see the module docstring for the forms)."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float | Decimal):
        number = float(value)
        if math.isnan(number):
            return "NaN"
        if math.isinf(number):
            return "Infinity" if number > 0 else "-Infinity"
        return number
    if isinstance(value, dt.datetime | dt.date | dt.time):
        return value.isoformat()
    if isinstance(value, dt.timedelta):
        return value.total_seconds()
    if isinstance(value, bytes | bytearray | memoryview):
        return "\\x" + bytes(value).hex()
    if isinstance(value, dict):
        return {str(key): jsonable(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(item) for item in value]
    if isinstance(value, uuid.UUID):
        return str(value)
    return str(value)


def text_value(value: Any) -> str:
    """A value as one CSV field: NULL empty, booleans true/false, JSON for jsonb and arrays."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return value
    if isinstance(value, Decimal):
        return str(value)  # exact, as PostgreSQL printed it
    if isinstance(value, dict | list | tuple):
        return json.dumps(jsonable(value), ensure_ascii=False)
    converted = jsonable(value)
    return converted if isinstance(converted, str) else str(converted)


def json_keys(columns: list[str]) -> list[str]:
    """Column names made unique (``?column?``, ``?column?_2``) to serve as JSON keys."""
    used: set[str] = set()
    keys = []
    for name in columns:
        key, count = name, 1
        while key in used:
            count += 1
            key = f"{name}_{count}"
        used.add(key)
        keys.append(key)
    return keys


def to_json(result: QueryResult) -> str:
    """A JSON array with one object per row, keyed by column name."""
    keys = json_keys(result.columns)
    records = [dict(zip(keys, (jsonable(value) for value in row), strict=True)) for row in result.rows]
    return json.dumps(records, ensure_ascii=False, allow_nan=False) + "\n"


def to_csv(result: QueryResult) -> str:
    """CSV with a header line."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(result.columns)
    for row in result.rows:
        writer.writerow([text_value(value) for value in row])
    return buffer.getvalue()


def _cell(value: Any) -> Text:
    if value is None:
        return Text("NULL", style="dim")
    if isinstance(value, bytes | bytearray | memoryview):
        return Text(f"<{len(bytes(value))} bytes>", style="dim")
    if isinstance(value, float | Decimal) and math.isfinite(value):
        return Text(_number(value))
    if isinstance(value, dt.timedelta):
        return Text(str(value))
    if isinstance(value, dt.datetime):
        return Text(value.isoformat(sep=" "))
    return Text(text_value(value))


def _number(value: float | Decimal) -> str:
    """Whole numbers in full, others to 6 significant digits (one decimal from a million on)."""
    size = abs(float(value))
    if size < 1e15 and value == int(value):
        return str(int(value))
    if 1e6 <= size < 1e15:
        return format(value, ".1f")
    return format(value, ".6g")


def to_table(result: QueryResult) -> Table:
    """A rich table: numbers right-aligned and rounded, intervals as H:MM:SS, bytea as its length."""
    table = Table(show_header=True, header_style="bold", show_lines=False)
    for index, name in enumerate(result.columns):
        numeric = any(
            isinstance(row[index], int | float | Decimal) and not isinstance(row[index], bool)
            for row in result.rows
        )
        table.add_column(Text(name), justify="right" if numeric else "left", overflow="fold")
    for row in result.rows:
        table.add_row(*(_cell(value) for value in row))
    return table
