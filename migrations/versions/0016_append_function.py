"""``append_events``: an append that names its expected version is one statement, so one message each way.

Before, the event store's lone append (``write_in_one_round_trip``) was BEGIN, the append lock, an INSERT and
COMMIT pipelined by psycopg, which flushes the socket at every statement: four sends that each woke the
server, and psycopg's pipeline machinery in Python around each. A lone append cost the appending process
about 1 ms of CPU (``bench/gateway.py`` at one episode, where every turn is a transaction of its own). Now
the store calls this function on an autocommit connection: one Bind/Execute, one reply.

The function does what the pipelined statements did, in the same order: it takes the append lock (waiting
at most the session's ``lock_timeout``), then reads the head and inserts the rows at head + 1, head + 2,
... . It is VOLATILE, so in READ COMMITTED each statement in it takes a new snapshot: the head is read after
the lock was granted and sees every append that committed before ours (invariant 4, as in
``pipeline/log/store.py``). The append guard (0007, 0015) checks the rows as it checks any INSERT, and the
statement's implicit transaction commits on return, which releases the lock. It runs with the caller's
privileges (SECURITY INVOKER): a role that may not INSERT into ``events`` gets the same refusal as before.
Only ``turnstile_writer`` (and the owner) may call it.

``positions`` are relative (1, 2, ...), one per row; ``data`` and ``metadata`` are JSON text, parsed by the
jsonb input function that COPY uses too, so the stored bytes are the same as the COPY path's. It returns the
head before the first new row.

Revision ID: 0016
Revises: 0015
Create Date: 2026-11-26
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0016"
down_revision: str | None = "0015"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

APPEND_LOCK = 0x7475726E73746C  # pipeline/log/store.py APPEND_LOCK (migrations do not import the library)
WRITER = "turnstile_writer"
SIGNATURE = "append_events(int8[], text[], int4[], uuid[], text[], text[], bytea[], text[], bytea[])"


def upgrade() -> None:
    op.execute(f"""
CREATE FUNCTION append_events(
    positions int8[], streams text[], versions int4[], event_ids uuid[], types text[], data text[],
    tokens bytea[], metadata text[], content_hashes bytea[]
) RETURNS int8 LANGUAGE plpgsql VOLATILE SECURITY INVOKER AS $$
DECLARE
    head int8;
BEGIN
    PERFORM pg_advisory_xact_lock({APPEND_LOCK});
    SELECT coalesce(max(position), 0) INTO head FROM events;
    INSERT INTO events (position, stream, version, event_id, type, data, tokens, metadata, content_hash)
    SELECT head + new.position, new.stream, new.version, new.event_id, new.type, new.data::jsonb,
           new.tokens, new.metadata::jsonb, new.content_hash
    FROM unnest(positions, streams, versions, event_ids, types, data, tokens, metadata, content_hashes)
         AS new(position, stream, version, event_id, type, data, tokens, metadata, content_hash);
    RETURN head;
END
$$
""")
    op.execute(f"REVOKE EXECUTE ON FUNCTION {SIGNATURE} FROM PUBLIC")
    op.execute(f"GRANT EXECUTE ON FUNCTION {SIGNATURE} TO {WRITER}")


def downgrade() -> None:
    op.execute(f"DROP FUNCTION {SIGNATURE}")
