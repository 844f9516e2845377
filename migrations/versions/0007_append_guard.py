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

from migrations.objects import replace

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# The guard: migrations/sql/events_append_guard/v*.sql. They write pipeline/log/store.py's APPEND_LOCK
# (0x7475726E73746C) in decimal: migrations do not import the library.
LOCKERS = ("turnstile_writer", "turnstile_materializer")
ADVISORY_FUNCTIONS = """
    SELECT p.oid::regprocedure::text FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
    WHERE n.nspname = 'pg_catalog' AND p.proname LIKE 'pg\\_%advisory\\_%'
"""


def upgrade() -> None:
    replace("events_append_guard", 1)
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
