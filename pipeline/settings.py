"""Settings from ``TURNSTILE_*`` environment variables, and URL helpers."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from pipeline.errors import ConfigError

SERVERS_FILE = "servers.env"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TURNSTILE_", extra="ignore")

    database_url: str | None = Field(default=None, description="PostgreSQL URL; unset: embedded servers")
    nats_url: str | None = Field(default=None, description="NATS URL; unset: embedded servers")
    data_dir: Path = Field(default=Path(".turnstile"), description="where embedded servers keep their data")
    max_event_bytes: int = Field(default=16 * 1024 * 1024, ge=1024, description="largest event accepted")

    def running_servers(self) -> dict[str, str]:
        """What a running ``turnstile up`` wrote to ``<data_dir>/servers.env`` (removed when it stops)."""
        path = self.data_dir / SERVERS_FILE
        found = {}
        if path.is_file():
            for line in path.read_text().splitlines():
                key, _, value = line.removeprefix("export ").partition("=")
                found[key.strip()] = value.strip()
        return found

    def require_database_url(self) -> str:
        if not self.database_url and (url := self.running_servers().get("TURNSTILE_DATABASE_URL")):
            return url
        if not self.database_url:
            raise ConfigError(
                "no database: set TURNSTILE_DATABASE_URL (e.g. postgresql://user@host:5432/db), "
                "or start embedded servers with `turnstile up` (in this directory, or export what it prints)"
            )
        return self.database_url

    def require_nats_url(self) -> str:
        if not self.nats_url and (url := self.running_servers().get("TURNSTILE_NATS_URL")):
            return url
        if not self.nats_url:
            raise ConfigError(
                "no NATS server: set TURNSTILE_NATS_URL (e.g. nats://127.0.0.1:4222), "
                "or start embedded servers with `turnstile up` (in this directory, or export what it prints)"
            )
        return self.nats_url


def sqlalchemy_url(url: str) -> str:
    """The SQLAlchemy form of a PostgreSQL URL, using the psycopg 3 driver."""
    for prefix in ("postgresql+psycopg://", "postgresql://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix) :]
    raise ConfigError(f"not a PostgreSQL URL: {url!r}; expected postgresql://user@host:port/database")


def libpq_url(url: str) -> str:
    """The libpq form of a PostgreSQL URL (what psycopg.connect and psql take)."""
    return "postgresql://" + sqlalchemy_url(url)[len("postgresql+psycopg://") :]
