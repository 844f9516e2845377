"""Policy versions on NATS, where the two stacks meet: the subject trainers publish on, and the stream that
keeps the newest version of each policy for consumers that were not listening.

Trainers publish ``PolicyVersionPublished`` on core NATS (``policy.<policy>.versions``); an inference consumer
that subscribes after a publish would never hear of it. The JetStream stream ``POLICY_VERSIONS`` captures
those subjects and keeps the last message of each (derived, like every stream: the log in Postgres is the
record), so a consumer reads it once its subscription is confirmed and loses nothing in between.
"""

from __future__ import annotations

import logging
from typing import Final

from nats.aio.client import Client as NatsConnection
from nats.errors import Error as NatsError
from nats.js.api import RetentionPolicy, StreamConfig
from nats.js.errors import BadRequestError, NotFoundError

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
        await connection.jetstream(timeout=LOOKUP_TIMEOUT).add_stream(config)
    except BadRequestError:
        return True  # made with another configuration (by an operator): kept as it is
    except NatsError as error:
        log.warning("no stream %s (%s): consumers that start later miss versions", VERSIONS_STREAM, error)
        return False
    return True


async def latest_version(connection: NatsConnection, policy: str) -> bytes | None:
    """The newest ``PolicyVersionPublished`` of ``policy`` kept by ``POLICY_VERSIONS`` (its JSON), or None."""
    js = connection.jetstream(timeout=LOOKUP_TIMEOUT)
    try:
        message = await js.get_last_msg(VERSIONS_STREAM, versions_subject(policy))
    except NotFoundError:
        return None  # no stream yet, or no version of this policy
    except NatsError as error:
        log.warning("could not read the newest version of %s from %s: %s", policy, VERSIONS_STREAM, error)
        return None
    return message.data
