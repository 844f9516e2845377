"""Alembic environment: runs the migrations on the database named by the caller or by the settings."""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context

from pipeline.settings import Settings, sqlalchemy_url

# One migrator at a time: services started together (docker compose, parallel tests) may all run
# `turnstile migrate`; the others wait on this lock and then find nothing left to do.
MIGRATION_LOCK_KEY = 0x7475726E  # "turn"


def run_migrations_online() -> None:
    url = context.config.attributes.get("url") or context.config.get_main_option("sqlalchemy.url")
    if not url:
        url = Settings().require_database_url()
    engine = sa.create_engine(sqlalchemy_url(url), poolclass=sa.pool.NullPool)
    with engine.connect() as connection:
        connection.execute(sa.text("SELECT pg_advisory_lock(:key)"), {"key": MIGRATION_LOCK_KEY})
        try:
            connection.commit()
            context.configure(connection=connection, transaction_per_migration=True)
            with context.begin_transaction():
                context.run_migrations()
            connection.commit()
        finally:
            connection.execute(sa.text("SELECT pg_advisory_unlock(:key)"), {"key": MIGRATION_LOCK_KEY})
            connection.commit()
    engine.dispose()


run_migrations_online()
