"""Search's SQL says each thing once: the fields a turn's words come from in one function, the index's
INSERT in one statement.

- ``turnstile_turn_said(data)``: what a turn adds, as one JSON array of its words' strings (new messages'
  text; the reply's text, reasoning and tool call arguments). ``turnstile_turn_text`` and
  ``turnstile_turn_words`` both read it; each had its own copy of the list.
- ``turnstile_index_turns``: one INSERT, run again with ``turnstile_turn_words`` if ``turnstile_turn_text``
  fails on a turn with more different words than a tsvector holds; it had the statement twice.
- The trigger on ``turn_rows`` (``turnstile_turn_search``) indexes its new rows through
  ``turnstile_index_turns``; it had a third copy of the statement.

Nothing indexed changes: the same words for every turn (tests/integration/test_ui_pages.py searches both
ways in, the huge turn included).

Revision ID: 0026
Revises: 0025
Create Date: 2026-11-27
"""

from collections.abc import Sequence

from alembic import op

from migrations.objects import replace

revision: str = "0026"
down_revision: str | None = "0025"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    replace("turnstile_turn_said", 1)
    replace("turnstile_turn_text", 2)
    replace("turnstile_turn_words", 2)
    replace("turnstile_index_turns", 2)
    replace("turnstile_turn_search", 3)


def downgrade() -> None:
    replace("turnstile_turn_search", 2)
    replace("turnstile_index_turns", 1)
    replace("turnstile_turn_words", 1)
    replace("turnstile_turn_text", 1)
    op.execute("DROP FUNCTION turnstile_turn_said(jsonb)")
