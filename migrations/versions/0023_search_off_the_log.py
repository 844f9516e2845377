"""Search off the append path: the words of each turn in a read model, ``turn_search``, written by the
materializer, not by every append.

Migration 0022 indexed ``turnstile_turn_text(data)`` of every ``TurnCompleted`` event in place (GIN index
``events_turn_text``), so each durable append paid full-text indexing inside the append lock: PostgreSQL CPU
per event 6x (410 against 67 us), WAL 2.7x and a third of the ingest rate at 64 appenders (delta turns,
``bench/ingest.py --without-index events_turn_text``). Now:

- ``turn_search (position, episode_id, words)``: one row a turn, ``words`` its ``turnstile_turn_text``, with
  a GIN index on ``words`` (the browser's ``/search``, ``pipeline/ui/search.py``).
- A statement trigger on ``public.turn_rows`` (the turns the materializer COPYs in) fills it from the
  statement's transition table, joining ``events`` by position: the materializer's transaction pays for the
  words, and a turn is found once it is folded (seconds behind the log, once its episode has finished:
  the fold writes an episode's turns then). Rebuild schemas (``rm_<name>``) get no trigger (``CREATE
  TABLE ... LIKE`` copies none): the browser reads ``public``, and a rebuild or ``rematerialize
  --replace`` leaves ``turn_search`` as it is.
- Filled here from the turns already folded.

The readers' SELECT comes from the default privileges (migration 0006), as for 0022's rollups.

Revision ID: 0023
Revises: 0022
Create Date: 2026-11-27
"""

from collections.abc import Sequence

from alembic import op

from migrations.objects import replace

revision: str = "0023"
down_revision: str | None = "0022"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

OLD_INDEX = "events_turn_text ON events USING gin (turnstile_turn_text(data)) WHERE type = 'TurnCompleted'"


def upgrade() -> None:
    op.execute("DROP INDEX events_turn_text")
    op.execute(
        "CREATE TABLE turn_search "
        "(position bigint PRIMARY KEY, episode_id text NOT NULL, words tsvector NOT NULL)"
    )
    replace("turnstile_turn_search", 1)
    op.execute("REVOKE ALL ON FUNCTION turnstile_turn_search() FROM PUBLIC")
    op.execute(
        "CREATE TRIGGER turn_rows_search AFTER INSERT ON public.turn_rows REFERENCING NEW TABLE AS new_rows "
        "FOR EACH STATEMENT EXECUTE FUNCTION turnstile_turn_search()"
    )
    op.execute(
        "INSERT INTO turn_search (position, episode_id, words) "
        "SELECT e.position, substr(e.stream, length('episode-') + 1), turnstile_turn_text(e.data) "
        "FROM turn_rows t JOIN events e ON e.position = t.position"
    )
    # After the rows: one sort instead of an insert into the index per row.
    op.execute("CREATE INDEX turn_search_words ON turn_search USING gin (words)")


def downgrade() -> None:
    op.execute("DROP TRIGGER turn_rows_search ON public.turn_rows")
    op.execute("DROP FUNCTION turnstile_turn_search()")
    op.execute("DROP TABLE turn_search")
    op.execute(f"CREATE INDEX {OLD_INDEX}")
