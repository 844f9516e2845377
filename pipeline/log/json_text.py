"""``JsonText``: JSON already serialized, kept apart from the store so that the pure fold can make it without
importing a database driver (``store.JsonTextBinaryDumper`` sends it to PostgreSQL)."""

from __future__ import annotations


class JsonText(str):
    """JSON that is already text: sent to a jsonb column as is."""
