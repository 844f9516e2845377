"""The database enforces the append rules, whoever writes: the append lock held, positions gapless.

Until now ``pipeline/log/store.py`` kept positions gapless and in commit order by convention: it takes the
append lock (a transaction-scoped advisory lock), reads the head and writes head+1, head+2, ... A role with
INSERT on ``events`` could skip that: insert at head+50 without the lock, commit, and leave positions that
tailers never yield. Two guards in the database make that impossible:

- ``events_append_guard``, a statement-level trigger after every INSERT or COPY into ``events``: the inserting
  transaction must hold the append lock, and the rows it added must be the positions right after the
  previous head with no gap (refused with SQLSTATE 42501 and a message naming the rule otherwise). The check
  runs once per statement (an index probe and an aggregate over the inserted rows), not per row.
- The advisory-lock functions are no longer executable by PUBLIC, only by the roles that append or
  materialize and by the migrating user: a read-only role (``turnstile sql``) cannot take the append lock and
  stall every append. Revoking them needs a superuser; without one this part is skipped with a warning (the
  trigger still holds) and an administrator can apply it later with the statements below.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-24
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

APPEND_LOCK = 0x7475726E73746C  # pipeline/log/store.py APPEND_LOCK (migrations do not import the library)
LOCKERS = ("turnstile_writer", "turnstile_materializer")
ADVISORY_FUNCTIONS = """
    SELECT p.oid::regprocedure::text FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
    WHERE n.nspname = 'pg_catalog' AND p.proname LIKE 'pg\\_%advisory\\_%'
"""


def upgrade() -> None:
    op.execute(
        f"""
        CREATE FUNCTION events_append_guard() RETURNS trigger LANGUAGE plpgsql AS $$
        DECLARE
            first_new bigint;
            last_new  bigint;
            added     bigint;
            previous  bigint;
        BEGIN
            IF NOT EXISTS (
                SELECT FROM pg_locks
                WHERE locktype = 'advisory' AND pid = pg_backend_pid() AND granted AND objsubid = 1
                  AND classid = ({APPEND_LOCK} >> 32)::oid AND objid = ({APPEND_LOCK} & 4294967295)::oid
            ) THEN
                RAISE EXCEPTION 'events are appended only while holding the append lock'
                    USING ERRCODE = 'insufficient_privilege',
                          HINT = 'append through the event store (pipeline.log.EventStore), which takes '
                                 || 'pg_advisory_xact_lock({APPEND_LOCK}) first';
            END IF;
            SELECT min(position), max(position), count(*) INTO first_new, last_new, added FROM appended;
            IF added = 0 THEN
                RETURN NULL;
            END IF;
            SELECT coalesce(max(position), 0) INTO previous FROM events WHERE position < first_new;
            IF first_new <> previous + 1 OR last_new - first_new + 1 <> added
               OR EXISTS (SELECT FROM events WHERE position > last_new) THEN
                RAISE EXCEPTION 'events must take the positions right after the head (%), without gaps; '
                                'got % rows at % .. %', previous, added, first_new, last_new
                    USING ERRCODE = 'insufficient_privilege';
            END IF;
            RETURN NULL;
        END
        $$
        """
    )
    op.execute(
        "CREATE TRIGGER events_append_guard AFTER INSERT ON events REFERENCING NEW TABLE AS appended "
        "FOR EACH STATEMENT EXECUTE FUNCTION events_append_guard()"
    )
    grantees = ", ".join([*LOCKERS, "CURRENT_USER"])
    op.execute(
        f"""
        DO $$
        DECLARE
            function text;
        BEGIN
            FOR function IN {ADVISORY_FUNCTIONS} LOOP
                EXECUTE format('REVOKE EXECUTE ON FUNCTION %s FROM PUBLIC', function);
                EXECUTE format('GRANT EXECUTE ON FUNCTION %s TO {grantees}', function);
            END LOOP;
        EXCEPTION
            WHEN insufficient_privilege THEN
                RAISE WARNING 'advisory locks stay executable by PUBLIC: revoking them needs a superuser'
                    USING HINT = 'as a superuser, for each pg_catalog.pg_*advisory_* function: REVOKE '
                                 || 'EXECUTE ... FROM PUBLIC; GRANT EXECUTE ... TO {grantees}';
        END
        $$
        """
    )


def downgrade() -> None:
    op.execute(
        f"""
        DO $$
        DECLARE
            function text;
        BEGIN
            FOR function IN {ADVISORY_FUNCTIONS} LOOP
                EXECUTE format('GRANT EXECUTE ON FUNCTION %s TO PUBLIC', function);
            END LOOP;
        EXCEPTION
            WHEN insufficient_privilege THEN NULL;
        END
        $$
        """
    )
    op.execute("DROP TRIGGER events_append_guard ON events")
    op.execute("DROP FUNCTION events_append_guard()")
