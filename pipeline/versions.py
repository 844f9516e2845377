"""Policy versions, where the two stacks meet: the subject trainers publish on, the stream that keeps the
newest of each policy, and the log that decides which versions exist.

Trainers append ``PolicyVersionPublished`` to the log (``policy-<policy>``; only the trainer's role may,
migration 0018) and then publish it on core NATS (``policy.<policy>.versions``). The JetStream stream
``POLICY_VERSIONS`` keeps the last message of each subject (derived, like every stream).

What arrives on NATS is a doorbell, not an order: anyone who can make a message appear on the subject (a
forged reply subject, a misconfigured server) could otherwise choose the weights every engine serves. An
inference consumer asks the log (``VersionLog``, through the view ``policy_versions``, which is all the
inference login may read) whether that version with that checkpoint was published, and at start and after a
reconnect it loads the newest version the log holds.
"""

from __future__ import annotations

import logging
from typing import Final

import psycopg
from nats.aio.client import Client as NatsConnection
from nats.errors import Error as NatsError
from nats.js.api import RetentionPolicy, StreamConfig
from nats.js.errors import BadRequestError

from pipeline.errors import StoreUnavailable
from pipeline.settings import jetstream, libpq_url

VERSIONS_STREAM: Final = "POLICY_VERSIONS"
LOOKUP_TIMEOUT: Final = 5.0

log = logging.getLogger(__name__)


def versions_subject(policy: str) -> str:
    """``policy.<policy>.versions``: trainers publish ``PolicyVersionPublished`` there."""
    return f"policy.{policy}.versions"


async def ensure_versions_stream(connection: NatsConnection, *, replicas: int = 1) -> bool:
    """Create ``POLICY_VERSIONS`` (the last message of each ``policy.*.versions``) unless it exists; whether
    it is there. A server or user without JetStream rights for it is logged, not fatal: live consumers still
    hear every version, only a consumer that starts later waits for the next one."""
    config = StreamConfig(
        name=VERSIONS_STREAM,
        subjects=[versions_subject("*")],
        retention=RetentionPolicy.LIMITS,
        max_msgs_per_subject=1,
        num_replicas=replicas,
    )
    try:
        await jetstream(connection, timeout=LOOKUP_TIMEOUT).add_stream(config)
    except BadRequestError:
        return True  # made with another configuration (by an operator): kept as it is
    except NatsError as error:
        log.warning("no stream %s (%s): consumers that start later miss versions", VERSIONS_STREAM, error)
        return False
    return True


class VersionLog:
    """The policy versions the log holds, read through the view ``policy_versions`` (migration 0018).

    A connection per look-up: versions arrive minutes apart, so holding one open would only add a reconnect
    path to get wrong; a PostgreSQL restart between two versions costs nothing. ``StoreUnavailable`` when
    the log cannot be read (the caller keeps its version and asks again at the next doorbell).
    """

    def __init__(self, database_url: str, *, timeout: float = LOOKUP_TIMEOUT) -> None:
        self.conninfo = libpq_url(database_url)
        self.timeout = timeout

    async def checkpoint(self, policy: str, version: int) -> str | None:
        """The checkpoint the log records for ``version`` of ``policy`` (None: no such version in it)."""
        row = await self._one(
            "SELECT checkpoint FROM policy_versions WHERE stream = %s AND version = %s "
            "ORDER BY position LIMIT 1",
            (f"policy-{policy}", version),
        )
        return None if row is None else str(row[0])

    async def newest(self, policy: str) -> tuple[int, str] | None:
        """The newest version of ``policy`` in the log and its checkpoint, or None before the first."""
        row = await self._one(
            "SELECT version, checkpoint FROM policy_versions WHERE stream = %s ORDER BY version DESC LIMIT 1",
            (f"policy-{policy}",),
        )
        return None if row is None else (int(str(row[0])), str(row[1]))

    async def _one(self, query: str, params: tuple[object, ...]) -> tuple[object, ...] | None:
        try:
            async with await psycopg.AsyncConnection.connect(
                self.conninfo, autocommit=True, connect_timeout=max(1, round(self.timeout))
            ) as connection:
                cursor = await connection.execute(query, params)
                return await cursor.fetchone()
        except psycopg.Error as error:
            raise StoreUnavailable(f"could not read policy versions from the log: {error}".strip()) from error
