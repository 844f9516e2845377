"""What gateway replicas share about their sessions, so that any replica serves any session: a NATS KV bucket
(``GATEWAY_SESSIONS``) beside the event log.

The log holds everything a call continues from (the episode's turns, its version for the next append); the
bucket holds only what the log does not: which key digest names which session, the session's limits (its
``max_turns``, its ``untrained_models``), when a call last came (for the idle timeout, across replicas) and
how it ended (so that its key gets 409 on every replica). Keys, per session:

- ``key.<sha-256 of the API key, hex>``: the session (``SharedRecord``); kept after the end, marked ended.
- ``open.<session id, hex>``: while it is open, its key digest and when a call last came; removed at the
  end (without a delete marker: the open ones are listed with one STREAM.INFO, for the idle timeout).

Why NATS KV and not a PostgreSQL table: the gateway reaches NATS already, JetStream is there, and in
deploy/nats.conf only the gateway's account imports the bucket's subjects (nothing else can read a key
digest); a lookup, a touch and the listing cost the log's primary nothing (its appends are what limit it);
and the bucket's ``max_age`` forgets ended sessions with no job to clean up. No decision rests on the bucket
alone: two replicas that race on a session are told apart by the stream's expected version in the log.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, replace
from typing import Final

from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, StorageType
from nats.js.errors import BucketNotFoundError, KeyNotFoundError, NotFoundError
from nats.js.kv import KeyValue

BUCKET: Final = "GATEWAY_SESSIONS"
KEPT_S: Final = 7 * 24 * 3600.0
"""How long the bucket keeps a key after its last write (``max_age``): ended sessions are forgotten then
(their keys get 401 instead of 409). A session's ``key.`` record is written when it starts and when it ends:
a session shared by replicas lasts at most this long (the idle timeout, an hour by default, ends it first
unless calls keep coming)."""


@dataclass(frozen=True, slots=True)
class SharedRecord:
    """A session as every replica may look it up by its key's digest."""

    session_id: str
    digest: str
    """SHA-256 of the session's API key, hex."""
    max_turns: int | None = None
    untrained_models: tuple[str, ...] = ()
    ended: str | None = None
    """How it ended (a termination), once it has."""
    policy: str | None = None
    """Its policy, whose log records it (``TURNSTILE_DATABASE_URLS``); None: the default log (a record
    written before policies had logs of their own)."""

    def encode(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def decode(cls, data: bytes) -> SharedRecord:
        fields = json.loads(data)
        return cls(
            session_id=fields["session_id"],
            digest=fields["digest"],
            max_turns=fields.get("max_turns"),
            untrained_models=tuple(fields.get("untrained_models") or ()),
            ended=fields.get("ended"),
            policy=fields.get("policy"),
        )


@dataclass(frozen=True, slots=True)
class OpenSession:
    """An open session as listed for the idle timeout: its digest and when a call last came (wall clock)."""

    session_id: str
    digest: str
    last_used: float

    @classmethod
    def decode(cls, data: bytes) -> OpenSession:
        value = json.loads(data)
        return cls(value["session_id"], value["digest"], float(value["last_used"]))


def id_key(session_id: str) -> str:
    # session ids are free text (``SessionSpec.episode_id``); KV keys take [-/_=.a-zA-Z0-9] only
    return "open." + session_id.encode().hex()


class SharedSessions:
    """The bucket: ``await SharedSessions.open(js)``; the records by digest, the open sessions by id."""

    def __init__(self, js: JetStreamContext, kv: KeyValue, bucket: str) -> None:
        self._js = js
        self._kv = kv
        self.bucket = bucket

    @classmethod
    async def open(cls, js: JetStreamContext, bucket: str = BUCKET) -> SharedSessions:
        """The bucket, made if it is not there (every replica may be the first to start)."""
        try:
            kv = await js.key_value(bucket)
        except (BucketNotFoundError, NotFoundError):
            config = KeyValueConfig(bucket=bucket, history=1, ttl=KEPT_S, storage=StorageType.FILE)
            kv = await js.create_key_value(config)
        return cls(js, kv, bucket)

    async def add(self, record: SharedRecord) -> None:
        """A new session: its record, and its place among the open ones."""
        await self._kv.put("key." + record.digest, record.encode())
        await self.touch(record)

    async def get(self, digest: str) -> SharedRecord | None:
        try:
            entry = await self._kv.get("key." + digest)
        except KeyNotFoundError:
            return None
        return None if entry.value is None else SharedRecord.decode(entry.value)

    async def open_session(self, session_id: str) -> OpenSession | None:
        """An open session by its id (the admin's routes name sessions by id): its key digest and when a
        call last came."""
        try:
            entry = await self._kv.get(id_key(session_id))
        except KeyNotFoundError:
            return None
        return None if not entry.value else OpenSession.decode(entry.value)

    async def touch(self, record: SharedRecord) -> None:
        """A call came now (what the idle timeout of every replica counts from)."""
        value = {"session_id": record.session_id, "digest": record.digest, "last_used": time.time()}
        await self._kv.put(id_key(record.session_id), json.dumps(value).encode())

    async def end(self, record: SharedRecord, termination: str) -> None:
        """The session ended: its key says how (409 on every replica), and it leaves the open ones (a purge
        of its subject, which leaves no delete marker behind for the listing to step over)."""
        await self._kv.put("key." + record.digest, replace(record, ended=termination).encode())
        await self._js.purge_stream(
            f"KV_{self.bucket}", subject=f"$KV.{self.bucket}.{id_key(record.session_id)}"
        )

    async def open_sessions(self) -> list[OpenSession]:
        """Every open session (one STREAM.INFO for their keys, then one read each)."""
        info = await self._js.stream_info(f"KV_{self.bucket}", subjects_filter=f"$KV.{self.bucket}.open.>")
        found = []
        for subject in info.state.subjects or {}:
            try:
                entry = await self._kv.get(subject.removeprefix(f"$KV.{self.bucket}."))
            except KeyNotFoundError:
                continue  # ended since the listing
            if entry.value:
                found.append(OpenSession.decode(entry.value))
        return found
