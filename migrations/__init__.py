"""Alembic migrations: every table, index, trigger, view, role and SQL function of Turnstile."""
