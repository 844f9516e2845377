"""Group roles for the services; ``events`` is append-only for every one of them.

- ``turnstile_writer`` (runners, the gateway, trainers): appends events (INSERT, never UPDATE, DELETE or
  TRUNCATE), holds runner leases (``runners``), records trained batches (``trained_batches``).
- ``turnstile_materializer`` (the materializer and its outbox relay): writes the read models, the batch
  outbox and its checkpoint; reads the log and cannot append to it.
- ``turnstile_reader`` (0004, ``turnstile sql``): reads.

All of them read every table and view. Login users join a role (``GRANT turnstile_writer TO runner``;
``deploy/postgres-init.sql`` does it for docker compose). The user that runs the migrations owns the tables
and keeps every privilege: only the owner can change or delete a recorded event. A later migration that adds
a table grants writes on it here-style; reading it is granted by default.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-25
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

WRITER = "turnstile_writer"
MATERIALIZER = "turnstile_materializer"
READER = "turnstile_reader"

# What each role may write besides reading everything; events gets INSERT only.
WRITES: dict[str, dict[str, str]] = {
    WRITER: {"events": "INSERT", "runners": "INSERT, UPDATE", "trained_batches": "INSERT"},
    MATERIALIZER: {
        table: "INSERT, UPDATE"  # the relay's SELECT ... FOR UPDATE on the outbox needs UPDATE too
        for table in (
            "episodes",
            "turns",
            "samples",
            "batches",
            "batch_outbox",
            "materializers",
            "checkpoints",
        )
    },
}


def _create_role(role: str) -> str:
    # Roles belong to the server, not to a database: another database on this server (the tests make one per
    # test), deploy/postgres-init.sql, or a concurrent migration elsewhere may have made it already.
    return f"""
        DO $$
        BEGIN
            IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '{role}') THEN
                CREATE ROLE {role} NOLOGIN;
            END IF;
        EXCEPTION
            WHEN duplicate_object OR unique_violation THEN NULL;
            WHEN insufficient_privilege THEN
                RAISE EXCEPTION 'creating role {role} needs CREATEROLE'
                    USING HINT = 'ask an administrator to run: CREATE ROLE {role} NOLOGIN; '
                                 || 'then migrate again';
        END
        $$
        """


def upgrade() -> None:
    for role, writes in WRITES.items():
        op.execute(_create_role(role))
        op.execute(f"GRANT USAGE ON SCHEMA public TO {role}")
        op.execute(f"GRANT SELECT ON ALL TABLES IN SCHEMA public TO {role}")
        # Tables and views this user creates later (later migrations) are readable too.
        op.execute(f"ALTER DEFAULT PRIVILEGES GRANT SELECT ON TABLES TO {role}")
        for table, privileges in writes.items():
            op.execute(f"GRANT {privileges} ON {table} TO {role}")
    # Whatever was granted before (by hand, or by an older deployment): the log is append-only.
    op.execute(f"REVOKE UPDATE, DELETE, TRUNCATE ON events FROM {WRITER}, {MATERIALIZER}, {READER}, PUBLIC")


def downgrade() -> None:
    for role, writes in WRITES.items():
        for table, privileges in writes.items():
            op.execute(f"REVOKE {privileges} ON {table} FROM {role}")
        op.execute(f"ALTER DEFAULT PRIVILEGES REVOKE SELECT ON TABLES FROM {role}")
        op.execute(f"REVOKE SELECT ON ALL TABLES IN SCHEMA public FROM {role}")
        op.execute(f"REVOKE USAGE ON SCHEMA public FROM {role}")
    # The roles stay: they are shared by every database on the server, and other databases may still use them.
