"""An episode starts only in its own stream: ``EpisodeStarted`` with ``episode_id`` X goes in ``episode-X``.

Before, an ``EpisodeStarted`` could name any episode id in any episode stream, so two streams could claim one
episode; the read models key episodes by id, and the materializer skipped the second stream's samples. Stream
names are unique, so tying an episode's id to its stream's name makes episode ids unique as well, with no
index and no look-up: a check of the row itself. The append path refuses the same first, with a message that
names the episode and its stream (``pipeline/log/appends.py``); this constraint holds for every other writer
(the tables' owner by hand, an older release).

Existing logs: the constraint is added ``NOT VALID``, so the migration does not read the log and never fails
on it. Events already recorded stay as they are (the log is never rewritten); only rows inserted from now on
are checked. An old log whose episodes already share an id keeps being read as before: the read models keep
the first stream's episode and record the second's events in ``skipped_events`` (see docs/operations.md for
the query that lists such episodes). ``ALTER TABLE events VALIDATE CONSTRAINT events_episode_in_own_stream``
tells whether a log holds any.

Revision ID: 0021
Revises: 0020
Create Date: 2026-11-27
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0021"
down_revision: str | None = "0020"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

CONSTRAINT = "events_episode_in_own_stream"


def upgrade() -> None:
    # CASE, not OR: only a start's data is looked into (a turn's jsonb is never detoasted for this).
    op.execute(f"""
        ALTER TABLE events ADD CONSTRAINT {CONSTRAINT} CHECK (
            CASE WHEN type = 'EpisodeStarted'
                 THEN coalesce(stream = 'episode-' || (data ->> 'episode_id'), false) ELSE true END
        ) NOT VALID
    """)


def downgrade() -> None:
    op.execute(f"ALTER TABLE events DROP CONSTRAINT {CONSTRAINT}")
