"""Engines and migrations."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from importlib import resources
from typing import TYPE_CHECKING

import psycopg
from psycopg import sql
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from pipeline.settings import libpq_url, sqlalchemy_url

if TYPE_CHECKING:  # alembic is imported where it runs: a service that does not migrate never needs it
    from alembic.config import Config

# The group roles of migrations 0004 and 0006 (their privileges on the tables are granted there).
WRITER_ROLE = "turnstile_writer"
MATERIALIZER_ROLE = "turnstile_materializer"
READER_ROLE = "turnstile_reader"
TRAINER_ROLE = "turnstile_trainer"
"""Appends policy versions (migration 0018); its login joins turnstile_writer too."""


def create_engine(url: str, *, pool_size: int = 10) -> AsyncEngine:
    return create_async_engine(
        sqlalchemy_url(url), pool_size=pool_size, max_overflow=pool_size, pool_pre_ping=True
    )


def alembic_config(url: str) -> Config:
    from alembic.config import Config

    here = resources.files("migrations")
    config = Config(str(here / "alembic.ini"))
    config.set_main_option("script_location", str(here))
    config.set_main_option("version_locations", str(here / "versions"))
    config.attributes["url"] = url
    return config


def migrate(url: str) -> None:
    """Bring the database to the newest schema (alembic upgrade head); safe to run again, and concurrently."""
    from alembic import command

    command.upgrade(alembic_config(url), "head")


async def migrate_async(url: str) -> None:
    await asyncio.to_thread(migrate, url)


def with_user(url: str, user: str, password: str | None = None) -> str:
    """``url`` logging in as ``user`` (with ``password``, or none) instead."""
    changed = make_url(libpq_url(url)).set(username=user, password=password)
    return libpq_url(changed.render_as_string(hide_password=False))


@dataclass(frozen=True)
class Logins:
    """The URLs of the everyday logins ``make_logins`` made."""

    services: str  # runs the services and the everyday commands: appends, read models, rebuilds
    reader: str  # `turnstile sql` and other readers: reads only


def make_logins(owner_url: str, *, services: str = "turnstile", reader: str = "turnstile_analyst") -> Logins:
    """Make (or keep) two logins that are not superusers on a migrated database, for `turnstile up`: the
    superuser that made the database stays for migrations only.

    ``services`` joins turnstile_writer, turnstile_materializer and turnstile_trainer (the demo's trainer
    publishes versions with it) and may create schemas (rebuilds);
    ``reader`` joins turnstile_reader only. Without passwords: for servers that trust local logins (the
    embedded PostgreSQL); a deployment makes its logins with passwords (deploy/postgres-init.sql).
    """
    with psycopg.connect(libpq_url(owner_url), autocommit=True) as connection:
        database = connection.info.dbname
        for user, roles in (
            (services, [WRITER_ROLE, MATERIALIZER_ROLE, TRAINER_ROLE]),
            (reader, [READER_ROLE]),
        ):
            exists = connection.execute("SELECT FROM pg_roles WHERE rolname = %s", (user,)).fetchone()
            if exists is None:
                connection.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(user)))
            connection.execute(
                sql.SQL("GRANT {} TO {}").format(
                    sql.SQL(", ").join(map(sql.Identifier, roles)), sql.Identifier(user)
                )
            )
        connection.execute(
            sql.SQL("GRANT CREATE ON DATABASE {} TO {}").format(
                sql.Identifier(database), sql.Identifier(services)
            )
        )
    return Logins(with_user(owner_url, services), with_user(owner_url, reader))
