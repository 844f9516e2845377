"""Engines and migrations."""

from __future__ import annotations

import asyncio
from importlib import resources

from alembic import command
from alembic.config import Config
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from pipeline.settings import sqlalchemy_url


def create_engine(url: str, *, pool_size: int = 10) -> AsyncEngine:
    return create_async_engine(
        sqlalchemy_url(url), pool_size=pool_size, max_overflow=pool_size, pool_pre_ping=True
    )


def alembic_config(url: str) -> Config:
    here = resources.files("migrations")
    config = Config(str(here / "alembic.ini"))
    config.set_main_option("script_location", str(here))
    config.set_main_option("version_locations", str(here / "versions"))
    config.attributes["url"] = url
    return config


def migrate(url: str) -> None:
    """Bring the database to the newest schema (alembic upgrade head); safe to run again, and concurrently."""
    command.upgrade(alembic_config(url), "head")


async def migrate_async(url: str) -> None:
    await asyncio.to_thread(migrate, url)
