"""Policy versions are written by the trainer's role only, and read by inference through one view.

An inference consumer loads a version only if the log holds it (``pipeline/versions.py``, ``VersionLog``): a
message on ``policy.<policy>.versions`` is a doorbell, not an order. For that check to mean anything, a
``PolicyVersionPublished`` in the log must come from a trainer: before this, every ``turnstile_writer``
(runners and the gateway too) could append one to ``policy-<policy>``.

- ``turnstile_trainer`` (a group role; the trainer's login joins it besides ``turnstile_writer``): the only
  role, with the owner of ``events``, that may append to a ``policy-*`` stream or an event of type
  ``PolicyVersionPublished``. ``append_events`` (v2) checks the caller's login (``session_user``: the
  function runs as ``turnstile_appender``); the append guard (v3) checks every other INSERT or COPY. Both
  refuse with SQLSTATE 42501 and a message naming the role. Events appended before this migration were
  written under the old rule; a log that a writer other than the trainer may have touched should be
  checked by hand (``SELECT * FROM policy_versions``).
- ``policy_versions``: the view of those events (policy, version, checkpoint, position). A view runs with
  its owner's privileges, so ``turnstile_inference`` (the inference consumers' login joins it) reads the
  versions and nothing else: no table, no other event, no write. The readers of the log read it too.

Revision ID: 0018
Revises: 0017
Create Date: 2026-11-27
"""

from collections.abc import Sequence

from alembic import op

from migrations.objects import replace

revision: str = "0018"
down_revision: str | None = "0017"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TRAINER = "turnstile_trainer"
INFERENCE = "turnstile_inference"
READERS = ("turnstile_writer", "turnstile_materializer", "turnstile_reader")


def _create_role(role: str) -> str:
    # As 0006 does: roles belong to the server, another database may have made it already.
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
    for role in (TRAINER, INFERENCE):
        op.execute(_create_role(role))
    op.execute(f"GRANT USAGE ON SCHEMA public TO {INFERENCE}")
    replace("turnstile_may_publish_versions", 1)
    replace("append_events", 2)
    replace("events_append_guard", 3)
    replace("policy_versions", 1)
    # 0006's default privileges grant SELECT on new views to the readers of the log already; said here too
    # for a database whose defaults were changed by hand.
    op.execute(f"GRANT SELECT ON policy_versions TO {INFERENCE}, {', '.join(READERS)}")


def downgrade() -> None:
    op.execute("DROP VIEW policy_versions")
    replace("events_append_guard", 2)
    replace("append_events", 1)
    op.execute("DROP FUNCTION turnstile_may_publish_versions(name)")
    op.execute(f"REVOKE USAGE ON SCHEMA public FROM {INFERENCE}")
    # The roles stay: they are shared by every database on the server, and others may still use them.
