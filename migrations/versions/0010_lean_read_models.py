"""Read models that reference the log instead of copying it.

``samples.arrays`` holds a sample's packed arrays only until the sample goes into a batch; then it is NULL
(the batch payload holds them, and ``turnstile rematerialize`` rebuilds them from the log). ``batches``
records each payload's size and sha256, so a rebuild can be checked byte for byte after the relay has let
published payloads leave the outbox (``turnstile serve relay --outbox-retention``): the relay may delete
them. Rebuild schemas (``rm_<name>``) get the same columns.

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-25
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

MATERIALIZER = "turnstile_materializer"


def _schemas() -> list[str]:
    connection = op.get_bind()
    rows = connection.exec_driver_sql(
        "SELECT schema_name FROM materializers WHERE schema_name <> 'public' "
        "AND schema_name IN (SELECT nspname FROM pg_namespace)"
    ).all()
    return ["public", *(row[0] for row in rows)]


def upgrade() -> None:
    for schema in _schemas():
        op.execute(f'ALTER TABLE "{schema}".samples ALTER COLUMN arrays DROP NOT NULL')
        op.execute(
            f'ALTER TABLE "{schema}".batches '
            "ADD COLUMN payload_bytes integer, ADD COLUMN payload_sha256 bytea"
        )
    op.execute(
        "COMMENT ON COLUMN samples.arrays IS 'input ids (int32), loss mask (uint8), logprobs (float32) until "
        "the sample is in a batch; then NULL: the batch payload holds them, the log rebuilds them'"
    )
    op.execute(
        "COMMENT ON COLUMN batches.payload_sha256 IS 'sha256 of the payload as published: a rebuild from the "
        "log gives the same bytes, also after the payload left the outbox'"
    )
    op.execute(f"GRANT DELETE ON batch_outbox TO {MATERIALIZER}")


def downgrade() -> None:
    op.execute(f"REVOKE DELETE ON batch_outbox FROM {MATERIALIZER}")
    for schema in _schemas():
        op.execute(f'ALTER TABLE "{schema}".batches DROP COLUMN payload_bytes, DROP COLUMN payload_sha256')
