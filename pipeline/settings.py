"""Settings from ``TURNSTILE_*`` environment variables, and URL helpers."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import urlsplit

from nats.aio.client import Client as NatsConnection
from nats.js import JetStreamContext
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from pipeline.errors import ConfigError

SERVERS_FILE = "servers.env"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TURNSTILE_", extra="ignore")

    database_url: str | None = Field(default=None, description="PostgreSQL URL; unset: embedded servers")
    database_urls: str = Field(
        default="",
        description="logs of their own for some policies, 'policy=postgresql://... other=postgresql://...' "
        "(entries apart by whitespace): a policy named here is recorded in, and read from, its database; any "
        "other policy in database_url (docs/scale.md)",
    )
    reader_url: str | None = Field(
        default=None, description="PostgreSQL URL for readers (`turnstile sql`); unset: database_url"
    )
    admin_database_url: str | None = Field(
        default=None,
        description="PostgreSQL URL of the database's owner, for migrations; unset: database_url",
    )
    nats_url: str | None = Field(default=None, description="NATS URL; unset: embedded servers")
    data_dir: Path = Field(default=Path(".turnstile"), description="where embedded servers keep their data")
    max_event_bytes: int = Field(default=16 * 1024 * 1024, ge=1024, description="largest event accepted")

    def running_servers(self) -> dict[str, str]:
        """What a running ``turnstile up`` wrote to ``servers.env`` (removed when it stops): in
        ``data_dir`` (TURNSTILE_DATA_DIR, default ``.turnstile``), or else in the current directory when
        that is a data directory itself (a command run inside the directory given to ``up --data-dir``)."""
        found: dict[str, str] = {}
        for path in (self.data_dir / SERVERS_FILE, Path(SERVERS_FILE)):
            if path.is_file():
                for line in path.read_text().splitlines():
                    key, _, value = line.removeprefix("export ").partition("=")
                    found[key.strip()] = value.strip()
                break
        return found

    def policy_database_urls(self) -> dict[str, str]:
        """TURNSTILE_DATABASE_URLS as policy -> URL (``parse_policy_urls``)."""
        return parse_policy_urls(self.database_urls)

    def require_database_url(self, policy: str | None = None) -> str:
        """The log of ``policy``: its own database where TURNSTILE_DATABASE_URLS names one, else the
        database of every other policy (TURNSTILE_DATABASE_URL, or that of a running `turnstile up`)."""
        if policy is not None and (url := self.policy_database_urls().get(policy)):
            return url
        if not self.database_url and (url := self.running_servers().get("TURNSTILE_DATABASE_URL")):
            return url
        if not self.database_url:
            raise ConfigError(
                "no database: set TURNSTILE_DATABASE_URL (e.g. postgresql://user@host:5432/db), "
                "or start embedded servers with `turnstile up` (in this directory, or export what it prints)"
            )
        return self.database_url

    def require_reader_url(self) -> str:
        """Where readers connect: TURNSTILE_READER_URL, the reader login of a running `turnstile up`, or
        the database URL."""
        if self.reader_url:
            return self.reader_url
        if not self.database_url and (url := self.running_servers().get("TURNSTILE_READER_URL")):
            return url
        return self.require_database_url()

    def require_admin_database_url(self) -> str:
        """Where migrations connect: TURNSTILE_ADMIN_DATABASE_URL, the owner of a running `turnstile up`,
        or the database URL."""
        if self.admin_database_url:
            return self.admin_database_url
        if not self.database_url and (url := self.running_servers().get("TURNSTILE_ADMIN_DATABASE_URL")):
            return url
        return self.require_database_url()

    def require_nats_url(self) -> str:
        if not self.nats_url and (url := self.running_servers().get("TURNSTILE_NATS_URL")):
            return url
        if not self.nats_url:
            raise ConfigError(
                "no NATS server: set TURNSTILE_NATS_URL (e.g. nats://127.0.0.1:4222), "
                "or start embedded servers with `turnstile up` (in this directory, or export what it prints)"
            )
        return self.nats_url


POLICY_NAME = re.compile(r"[A-Za-z0-9_-]+")
"""What a policy may be called: a token of NATS subjects (``llm.<policy>.requests``)."""


def parse_policy_urls(text: str) -> dict[str, str]:
    """``policy=url`` entries apart by whitespace (a URL holds none; commas are libpq's host lists) as a
    mapping, each URL checked to be PostgreSQL's; ConfigError naming the entry that is not."""
    found: dict[str, str] = {}
    for entry in text.split():
        policy, equals, url = entry.partition("=")
        if not equals or not POLICY_NAME.fullmatch(policy) or not url:
            raise ConfigError(
                f"TURNSTILE_DATABASE_URLS entry {entry!r}: write policy=postgresql://user@host:port/db, "
                "entries apart by spaces (policy names: letters, digits, '_' and '-')"
            )
        if policy in found:
            raise ConfigError(f"TURNSTILE_DATABASE_URLS names policy {policy!r} twice; give it one database")
        sqlalchemy_url(url)  # refuses what is not a PostgreSQL URL, naming it
        found[policy] = url
    return found


def sqlalchemy_url(url: str) -> str:
    """The SQLAlchemy form of a PostgreSQL URL, using the psycopg 3 driver."""
    for prefix in ("postgresql+psycopg://", "postgresql://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix) :]
    raise ConfigError(f"not a PostgreSQL URL: {url!r}; expected postgresql://user@host:port/database")


def libpq_url(url: str) -> str:
    """The libpq form of a PostgreSQL URL (what psycopg.connect and psql take)."""
    return "postgresql://" + sqlalchemy_url(url)[len("postgresql+psycopg://") :]


def nats_servers(url: str) -> list[str]:
    """The servers of a NATS URL: one, or several separated by commas (the nodes of a cluster, as the
    ``nats`` CLI takes them). A client connects to one and moves to another when that one goes away; once
    connected it also learns the cluster's other nodes from the server."""
    servers = [part.strip() for part in url.split(",") if part.strip()]
    if not servers:
        raise ConfigError(f"no NATS server in {url!r}: give nats://host:port, or several separated by commas")
    return servers


def nats_inbox_prefix(url: str) -> str:
    """The inbox prefix for connections made with ``url``: ``_INBOX_<user>`` when the URL logs in with a user
    and password, else NATS's default ``_INBOX``.

    Replies (LLM replies, JetStream API answers, pulled messages) come to inboxes under this prefix. With
    role credentials (deploy/nats.conf) each role may subscribe only to its own prefix and inference may
    answer only to the requester roles' prefixes: no role reads another's replies, and no request can make
    a consumer publish its reply onto a stream subject. A URL with a token and no user keeps the default (the
    token is a secret, never a subject).
    """
    parts = urlsplit(url.split(",")[0])
    if not parts.username or parts.password is None:
        return "_INBOX"
    if not re.fullmatch(r"[A-Za-z0-9_-]+", parts.username):
        raise ConfigError(
            f"NATS user {parts.username!r} cannot name an inbox prefix (_INBOX_<user>); use letters, digits, "
            "'_' or '-' in NATS user names"
        )
    return f"_INBOX_{parts.username}"


def jetstream_api_prefix(inbox_prefix: str) -> str:
    """The subject prefix of the JetStream API for a connection with ``inbox_prefix``: ``JS.<user>.API`` for
    a login (``_INBOX_<user>``), else NATS's own ``$JS.API``.

    deploy/nats.conf puts each role in a NATS account of its own and JetStream in another one, which exports
    its API; each role imports it under ``JS.<role>.API``. A request through an import is answered in the
    requester's own account, whatever reply subject it names: a pulled message or an API answer can never
    land on a stream subject or on a subject another role hears (issue 36). The embedded server of
    ``turnstile up`` has no logins and no accounts: there the API keeps its own subjects.
    """
    user = inbox_prefix.removeprefix("_INBOX_") if inbox_prefix.startswith("_INBOX_") else ""
    return f"JS.{user}.API" if user else "$JS.API"


def jetstream(connection: NatsConnection, *, timeout: float = 5.0) -> JetStreamContext:
    """The JetStream context of ``connection`` through its role's API prefix (see ``jetstream_api_prefix``;
    the user is read back from the connection's inbox prefix, which ``nats_inbox_prefix`` sets)."""
    inbox_prefix = connection.new_inbox().split(".", 1)[0]
    return connection.jetstream(prefix=jetstream_api_prefix(inbox_prefix), timeout=timeout)
