"""Consumer checkpoints: the last log position a consumer has fully processed.

A consumer saves its checkpoint in the same transaction as its outputs (invariant 5), so after a
crash it resumes exactly where its last committed outputs end.
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncConnection

from pipeline.log.tables import checkpoints


async def load_checkpoint(connection: AsyncConnection, name: str) -> int:
    position = await connection.scalar(sa.select(checkpoints.c.position).where(checkpoints.c.name == name))
    return int(position or 0)


async def save_checkpoint(connection: AsyncConnection, name: str, position: int) -> None:
    statement = insert(checkpoints).values(name=name, position=position)
    statement = statement.on_conflict_do_update(
        index_elements=[checkpoints.c.name],
        set_={"position": statement.excluded.position, "updated_at": sa.func.now()},
    )
    await connection.execute(statement)
