"""Which PostgreSQL login each command needs, and a refusal by PostgreSQL said in one line that names it.

``turnstile up`` prints three logins (docs/operations.md): the services' (``TURNSTILE_DATABASE_URL``), the
reader's (``TURNSTILE_READER_URL``) and the database owner's (``TURNSTILE_ADMIN_DATABASE_URL``, migrations
only). A command run with a login that lacks a privilege used to end in a driver traceback ("permission
denied for table runners"); ``refusal`` turns that into what was refused, the login that was refused and the
login the command needs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final
from urllib.parse import urlsplit

from pipeline.settings import Settings

SERVICES: Final = (
    "the services' login: TURNSTILE_DATABASE_URL (`turnstile up` prints login 'turnstile'; a deployment's "
    "service logins are in docs/deployment.md)"
)
READER: Final = (
    "a reader login: TURNSTILE_READER_URL (`turnstile up` prints login 'turnstile_analyst'), or the "
    "services' login in TURNSTILE_DATABASE_URL"
)
OWNER: Final = (
    "the database owner: TURNSTILE_ADMIN_DATABASE_URL (`turnstile up` prints it, for migrations only)"
)
READERS: Final = frozenset({"sql", "episodes", "plot", "ui"})


def command_of(argv: Sequence[str]) -> str:
    """The command in ``argv`` (after the program): ``run``, ``serve materializer`` ..."""
    words = [word for word in argv if not word.startswith("-")]
    if words[:1] in (["serve"], ["model"]):
        return " ".join(words[:2])
    return words[0] if words else ""


def needed_login(command: str) -> str:
    if command == "migrate":
        return OWNER
    return READER if command in READERS else SERVICES


def login_used(command: str) -> str | None:
    """The user of the URL ``command`` connects with, as the command itself resolves it."""
    settings = Settings()
    try:
        if command == "migrate":
            url = settings.require_admin_database_url()
        elif command in READERS:
            url = settings.require_reader_url()
        else:
            url = settings.require_database_url()
    except Exception:
        return None
    return urlsplit(url).username


def permission_denied(error: BaseException) -> BaseException | None:
    """PostgreSQL's ``insufficient_privilege`` (SQLSTATE 42501) in ``error``: itself, the driver error a
    SQLAlchemy error wraps, or one of a group's; None if it is not one."""
    if isinstance(error, BaseExceptionGroup):
        for inner in error.exceptions:
            if (found := permission_denied(inner)) is not None:
                return found
        return None
    original = getattr(error, "orig", None) or error
    return original if getattr(original, "sqlstate", None) == "42501" else None


def refusal(command: str, denied: BaseException) -> str:
    """One line: what PostgreSQL refused, to which login, and the login ``command`` needs."""
    reason = str(denied).splitlines()[0] if str(denied) else type(denied).__name__
    login = login_used(command)
    who = f"login {login!r}" if login else "the login given"
    return f"PostgreSQL refused {who} for `turnstile {command}` ({reason}); run it as {needed_login(command)}"
