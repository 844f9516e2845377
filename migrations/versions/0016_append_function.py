"""``append_events``: an append that names its expected version is one statement, checked by construction.

Before, the event store's lone append (``write_in_one_round_trip``) was BEGIN, the append lock, an INSERT and
COMMIT pipelined by psycopg, which flushes the socket at every statement: four sends that each woke the
server, and psycopg's pipeline machinery in Python around each. A lone append cost the appending process
about 1 ms of CPU (``bench/gateway.py`` at one episode, where every turn is a transaction of its own), and
the append guard (0007, 0015) about half of the ~0.7 ms it cost PostgreSQL: its transition table, the look-up
in ``pg_locks`` (a copy of the whole lock table) and five queries. Now the store calls this function on an
autocommit connection: one Bind/Execute, one reply, one implicit transaction that commits on return.

The function does in this order what the guard checks after the fact: it takes the append lock (waiting at
most the session's ``lock_timeout``), reads the head, checks that each stream's new versions start right
after its last one and leave no gap (the guard's SQLSTATE 23514 and message), and inserts the rows at
head + 1, head + 2, ... in the order given. It is VOLATILE, so in READ COMMITTED each statement in it takes a
new snapshot: the head and the versions are read after the lock was granted and see every append that
committed before (invariant 4, as in ``pipeline/log/store.py``). Event ids stay unique by their index.

It runs as ``turnstile_appender`` (SECURITY DEFINER; its search_path is ``public, pg_temp``, so a caller's
temporary table cannot stand in for ``events``), a role that cannot log in and that
no one is granted: only this function acts as it. The guard's trigger now fires unless the current user is
that role, so rows written by the function are not checked twice, and every other INSERT or COPY into
``events`` (the store's batches, any role's own statements) is checked as before. Only
``turnstile_writer`` (and the owner) may call it.

Making the role own the function needs a superuser, or a migrating user that may SET ROLE to it
(``GRANT turnstile_appender TO <that user>``); without either, the migration stops and says so.

Revision ID: 0016
Revises: 0015
Create Date: 2026-11-26
"""

from collections.abc import Sequence

from alembic import op

from migrations.objects import replace

revision: str = "0016"
down_revision: str | None = "0015"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

APPENDER = "turnstile_appender"
WRITER = "turnstile_writer"
SIGNATURE = "append_events(text[], int4[], uuid[], text[], text[], bytea[], text[], bytea[])"
GUARD_TRIGGER = (
    "CREATE TRIGGER events_append_guard AFTER INSERT ON events REFERENCING NEW TABLE AS appended "
    "FOR EACH STATEMENT {when}EXECUTE FUNCTION events_append_guard()"
)

# The function: migrations/sql/append_events/v1.sql (pipeline/log/store.py's APPEND_LOCK in decimal there).


def upgrade() -> None:
    op.execute(f"""
        DO $$
        BEGIN
            IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '{APPENDER}') THEN
                CREATE ROLE {APPENDER} NOLOGIN;
            END IF;
        EXCEPTION
            WHEN duplicate_object OR unique_violation THEN NULL;  -- made meanwhile by another database
            WHEN insufficient_privilege THEN
                RAISE EXCEPTION 'creating role {APPENDER} needs CREATEROLE'
                    USING HINT = 'ask an administrator to run: CREATE ROLE {APPENDER} NOLOGIN; '
                                 || 'then migrate again';
        END
        $$
    """)
    op.execute(f"GRANT USAGE ON SCHEMA public TO {APPENDER}")
    op.execute(f"GRANT SELECT, INSERT ON events TO {APPENDER}")
    # 0007 took the advisory-lock functions from PUBLIC where it could (as a superuser): give the lock back
    # to the role that now takes it.
    op.execute(f"""
        DO $$
        BEGIN
            GRANT EXECUTE ON FUNCTION pg_catalog.pg_advisory_xact_lock(bigint) TO {APPENDER};
        EXCEPTION
            WHEN insufficient_privilege THEN NULL;  -- not a superuser: 0007 could not revoke it from PUBLIC
        END
        $$
    """)
    replace("append_events", 1)
    op.execute(f"""
        DO $$
        BEGIN
            ALTER FUNCTION {SIGNATURE} OWNER TO {APPENDER};
        EXCEPTION
            WHEN insufficient_privilege THEN
                RAISE EXCEPTION 'making {APPENDER} own append_events needs a superuser, or a migrating user '
                                'that may SET ROLE {APPENDER}'
                    USING HINT = 'as a superuser: GRANT {APPENDER} TO ' || current_user
                                 || '; then migrate again';
        END
        $$
    """)
    op.execute(f"REVOKE EXECUTE ON FUNCTION {SIGNATURE} FROM PUBLIC")
    op.execute(f"GRANT EXECUTE ON FUNCTION {SIGNATURE} TO {WRITER}")
    op.execute("DROP TRIGGER events_append_guard ON events")
    op.execute(GUARD_TRIGGER.format(when=f"WHEN (current_user <> '{APPENDER}') "))


def downgrade() -> None:
    op.execute("DROP TRIGGER events_append_guard ON events")
    op.execute(GUARD_TRIGGER.format(when=""))
    op.execute(f"DROP FUNCTION {SIGNATURE}")
    op.execute(f"""
        DO $$
        BEGIN
            REVOKE EXECUTE ON FUNCTION pg_catalog.pg_advisory_xact_lock(bigint) FROM {APPENDER};
        EXCEPTION
            WHEN insufficient_privilege THEN NULL;
        END
        $$
    """)
    op.execute(f"REVOKE SELECT, INSERT ON events FROM {APPENDER}")
    op.execute(f"REVOKE USAGE ON SCHEMA public FROM {APPENDER}")
    # The role stays: roles are shared by every database on the server, and others may still use it.
