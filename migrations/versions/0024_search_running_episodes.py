"""Search finds a running episode's turns: the live materializer indexes each turn as it tails the log, not
when the turn's episode finishes.

Migration 0023 filled ``turn_search`` from a trigger on ``public.turn_rows``, and the fold writes an episode's
turns there only when the episode finishes: a turn of a running episode (hours, for a Claude Code run) was
not found until then. Now:

- ``turnstile_index_turns(positions)``: the words of the ``TurnCompleted`` events at those positions into
  ``turn_search``, SECURITY DEFINER and granted to turnstile_materializer alone. The live materializer
  (``main``, schema ``public``) calls it in each step's transaction with the turns of open episodes that the
  step folded (``Writes.searched``), before it writes ``turn_rows``. Still off the append path: nothing
  changes on ``events``.
- The trigger on ``turn_rows`` passes over the turns indexed already before it computes their words (the
  function and the trigger both keep a row that is there: ``position`` is the key, no duplicates), and
  indexes the rest, so a materializer of an earlier release still fills the index.
- A turn that says more different words than a tsvector holds (1 MB of them) made ``turnstile_turn_text``
  fail, and with it the materializer's step (the trigger's, under 0023): both now index such a turn by the
  words of its first 250,000 characters (``turnstile_turn_words``, only after a statement failed so).
- Filled here with what the new fold would have indexed up to the live materializer's checkpoint: the turns
  of episodes still running, and of episodes whose fold was skipped (``skipped_events``: no ``turn_rows``),
  so ``turn_search`` is what a refold from the log gives.

What search holds: every ``TurnCompleted`` the live materializer has passed while its episode was open
(started, not finished): the turns of finished episodes as before, of running ones, and of episodes that
never finish or whose fold was skipped. Rebuilds (``rm_<name>``) do not write it, as before.

Revision ID: 0024
Revises: 0023
Create Date: 2026-11-27
"""

from collections.abc import Sequence

from alembic import op

from migrations.objects import replace

revision: str = "0024"
down_revision: str | None = "0023"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# The turns each open episode held when the live materializer stopped: after its start, before its finish.
FOLDED_OPEN_TURNS = """
    SELECT turnstile_index_turns(ARRAY(
        SELECT e.position FROM episodes ep JOIN events e ON e.stream = ep.stream
        WHERE e.type = 'TurnCompleted' AND e.position > ep.started_position
          AND (ep.finished_position IS NULL OR e.position < ep.finished_position)
          AND e.position <= (
              SELECT coalesce(max(position), 0) FROM checkpoints WHERE name = 'materializer:main'
          )
          AND NOT EXISTS (SELECT FROM turn_search s WHERE s.position = e.position)
    ))
"""


def upgrade() -> None:
    replace("turnstile_turn_words", 1)
    replace("turnstile_index_turns", 1)
    op.execute("REVOKE ALL ON FUNCTION turnstile_index_turns(bigint[]) FROM PUBLIC")
    op.execute("GRANT EXECUTE ON FUNCTION turnstile_index_turns(bigint[]) TO turnstile_materializer")
    replace("turnstile_turn_search", 2)
    op.execute(FOLDED_OPEN_TURNS)


def downgrade() -> None:
    replace("turnstile_turn_search", 1)
    op.execute("DROP FUNCTION turnstile_index_turns(bigint[])")
    op.execute("DROP FUNCTION turnstile_turn_words(jsonb)")
    # 0023 holds the turns of turn_rows only
    op.execute(
        "DELETE FROM turn_search s WHERE NOT EXISTS (SELECT FROM turn_rows t WHERE t.position = s.position)"
    )
