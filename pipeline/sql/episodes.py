"""Episode ids picked by a user's SQL condition over the episodes read model (``turnstile rerun --all
--where``)."""

from __future__ import annotations

from pipeline.sql.readonly import run_readonly


def episode_ids_where(database_url: str, where: str | None, *, allow_superuser: bool = False) -> list[str]:
    """The ids of the episodes in the read model ``episodes`` for which ``where`` holds (all of them when it
    is None or empty), oldest first. Read-only, as ``run_readonly`` runs any query: ``where`` can do no
    more than the login of ``database_url`` can; ``SqlError`` when it does not run."""
    query = f"SELECT episode_id FROM episodes WHERE ({where or 'true'}) ORDER BY started_at"
    return [str(row[0]) for row in run_readonly(database_url, query, allow_superuser=allow_superuser).rows]
