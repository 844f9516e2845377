"""Replaceable SQL objects (functions, views), each version written once.

Version ``N`` of object ``name`` is ``migrations/sql/<name>/v<N>.sql``: the statement that creates it
(``CREATE OR REPLACE``), its body exactly as the migration that introduced it ran it. A migration that
changes an object adds the next file and calls ``replace(name, N)`` in ``upgrade`` and
``replace(name, N - 1)`` in ``downgrade``; nothing retypes an older body. A file is never edited once a
migration has shipped with it (alembic's "replaceable objects" recipe, one object version per file).
"""

from importlib.resources import files

from alembic import op


def sql(name: str, version: int) -> str:
    """The text of version ``version`` of the SQL object ``name``."""
    return files("migrations").joinpath("sql", name, f"v{version}.sql").read_text(encoding="utf-8")


def replace(name: str, version: int) -> None:
    """Create (or replace) the SQL object ``name`` as its version ``version``."""
    op.execute(sql(name, version))
