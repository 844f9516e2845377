"""Sessions that any gateway replica serves (``turnstile serve gateway --shared-sessions``).

A replica holds the sessions it has served lately (``SessionRegistry``, as a single gateway does) as a cache
of the log: before it serves a call, a reward or an end it catches the session up with the events other
replicas appended since (``EpisodeSession.refresh``: one read of the events after its version, usually
none), and a key it does not hold is looked up in the shared bucket (``pipeline.gateway.shared``) and its
session rebuilt from the log (``EpisodeSession.from_log``). Every append still names the stream's expected
version, so two replicas that serve one session at the same moment cannot fork it: the second gets
``WrongExpectedVersion``, catches up and answers 409 (retryable: the openai and anthropic SDKs send it
again, and the retry continues the conversation as recorded).

What changes from a single gateway, and why:

- A stopping replica leaves its sessions open (the others serve them), and sessions record no replica's
  lease: one that dies leaves nothing to close. If every replica is gone, the runners' orphan rule closes a
  session with no event for an hour as ``aborted`` (``pipeline.episodes.leases``).
- The idle timeout counts from the last call on any replica (each replica notes a call in the bucket at most
  every ``touch_every`` seconds) and any replica may end an idle session; the log's expected version makes
  that happen once, whichever replicas try.
- A call retried after the replica that recorded its turn died before answering is answered from that turn
  (still awaiting delivery, its conversation the same), not generated and recorded again.
- A reply's delivery (``TurnDelivered``) is appended as soon as it is handed over, not with the session's
  next event (which another replica may write): one append more per turn. A turn appended while another
  replica recorded a delivery is appended again at the new version (a delivery changes no conversation).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Mapping
from typing import Final

from nats.errors import Error as NatsError

from pipeline.dialects import ChatCall, ChatResult
from pipeline.episodes import EpisodeSession, chat_result, episode_stream
from pipeline.errors import StoreUnavailable
from pipeline.gateway.http_error import GatewayError
from pipeline.gateway.sessions import SessionEntry, SessionRegistry
from pipeline.gateway.shared import SharedRecord, SharedSessions
from pipeline.inference import LLMClient
from pipeline.log import RecordedEvent, Store
from schemas import EpisodeFinished

log = logging.getLogger(__name__)

TOUCH_EVERY_MAX: Final = 5.0
"""Seconds between two notes of a session's use in the bucket, at most (less with short timeouts)."""
LIST_EVERY_MAX: Final = 60.0
"""Seconds between two listings of every open session for the idle timeout, at most."""
RETRY_NOW: Final = {"Retry-After": "0"}


class Replicas:
    """A gateway's side of the sessions it shares with other replicas."""

    def __init__(
        self,
        shared: SharedSessions,
        store: Store,
        llm: LLMClient,
        registry: SessionRegistry,
        *,
        timeouts: tuple[float | None, ...] = (),
        policy_stores: Mapping[str, Store] | None = None,
    ) -> None:
        """``timeouts``: the gateway's idle and gone-after times (a call is noted often enough for both);
        ``policy_stores``: the policies recorded in a log of their own (the others are in ``store``)."""
        self.shared = shared
        self.store = store
        self.policy_stores = dict(policy_stores or {})
        self.llm = llm
        self.registry = registry
        self.touch_every = min([TOUCH_EVERY_MAX, *(t / 4 for t in timeouts if t)])
        self._listed_at = float("-inf")

    async def share(self, entry: SessionEntry) -> None:
        """A session this replica started: in the bucket, for the others."""
        session = entry.session
        record = SharedRecord(
            session.episode_id,
            entry.digest.hex(),
            session.max_turns,
            entry.untrained_models,
            policy=session.policy,
        )
        entry.shared = record
        session.shared = True
        async with self._reaching():
            await self.shared.add(record)
        entry.touched_at = time.time()

    async def current(self, entry: SessionEntry, *, touch: bool = True) -> None:
        """``entry`` caught up with the log (409 if it ended elsewhere); ``touch``: a call came."""
        try:
            await entry.session.refresh()
        except StoreUnavailable as error:
            raise GatewayError(503, str(error)) from None
        if entry.session.finished:
            raise await self._ended_elsewhere(entry)
        session = entry.session
        for reply in session.turns[entry.arguments_seen :]:
            entry.tool_arguments.update((call.id, call.function.arguments) for call in reply.tool_calls)
        entry.arguments_seen = len(session.turns)
        if touch and entry.shared is not None and time.time() - entry.touched_at >= self.touch_every:
            entry.touched_at = time.time()
            async with self._reaching():
                await self.shared.touch(entry.shared)

    async def adopt(self, digest: str, *, touch: bool = True) -> SessionEntry | None:
        """The session of a key this replica does not hold, taken up from the bucket and the log; None when
        no replica started a session with that key."""
        async with self._reaching():
            record = await self.shared.get(digest)
        if record is None:
            return None
        if record.ended is not None:
            raise GatewayError(409, ended_message(record.session_id, record.ended))
        held = self.registry.get(record.session_id)
        if held is None:
            held = await self._rebuilt(record)
        await self.current(held, touch=touch)
        return held

    async def adopt_by_id(self, session_id: str) -> SessionEntry | None:
        """``adopt`` by the session's id (the admin's routes); 409 when the log says it ended."""
        async with self._reaching():
            found = await self.shared.open_session(session_id)
        if found is not None:
            return await self.adopt(found.digest)
        recorded = await self._recorded_anywhere(session_id)
        last = recorded[-1].event if recorded else None
        if isinstance(last, EpisodeFinished):
            raise GatewayError(409, ended_message(session_id, last.termination))
        return None

    def _store_of(self, policy: str | None) -> Store:
        """The log a session of ``policy`` is recorded in."""
        return self.policy_stores.get(policy, self.store) if policy is not None else self.store

    async def _recorded_anywhere(self, session_id: str) -> list[RecordedEvent]:
        """The session's stream from whichever log holds it (the policy is not known without its record)."""
        for store in {id(store): store for store in (self.store, *self.policy_stores.values())}.values():
            recorded = await store.read_stream(episode_stream(session_id))
            if recorded:
                return recorded
        return []

    async def _rebuilt(self, record: SharedRecord) -> SessionEntry:
        store = self._store_of(record.policy)
        try:
            recorded = await store.read_stream(episode_stream(record.session_id))
        except StoreUnavailable as error:
            raise GatewayError(503, str(error)) from None
        session = EpisodeSession.from_log(store, self.llm, recorded, max_turns=record.max_turns)
        held = self.registry.get(record.session_id)  # taken up meanwhile by a concurrent call
        if held is not None:
            return held
        entry = SessionEntry(session, bytes.fromhex(record.digest), owned=True)
        entry.untrained_models = record.untrained_models
        entry.shared = record
        return self.registry.add(entry)

    async def lost_race(self, entry: SessionEntry, what: str) -> GatewayError:
        """The answer to a write that found the stream moved on: another replica recorded a call, a reward or
        the end of the session first. The expected version kept the two from forking it; the loser wrote
        nothing, and its client may send it again."""
        await self.current(entry, touch=False)
        return GatewayError(
            409,
            f"another gateway replica recorded a call, reward or end of session {entry.session_id} at the "
            f"same time; {what}: send it again (it continues the session as recorded)",
            code="session_moved_on",
            headers=RETRY_NOW,
        )

    async def _ended_elsewhere(self, entry: SessionEntry) -> GatewayError:
        """Forget a session that ended on another replica; the 409 its key gets."""
        last = entry.session.events[-1]
        termination = last.termination if isinstance(last, EpisodeFinished) else "done"
        await self.registry.close(entry.session_id, wait=False)
        self.registry.mark_ended(entry.session_id, termination)
        return GatewayError(409, ended_message(entry.session_id, termination))

    async def ended(self, entry: SessionEntry, termination: str) -> None:
        """The session ended here: every replica's lookup of its key says so."""
        if entry.shared is not None:
            async with self._reaching():
                await self.shared.end(entry.shared, termination)

    async def idle_sessions(self, idle_timeout: float) -> list[SessionEntry]:
        """The sessions, of any replica, with no call for ``idle_timeout`` seconds and none in flight here,
        caught up with the log (the caller ends them; if another replica does too, the stream's expected
        version lets one of them through)."""
        if time.monotonic() - self._listed_at < min(idle_timeout / 4, LIST_EVERY_MAX):
            return []  # listed lately (the reaper runs every few seconds; the listing reads every session)
        self._listed_at = time.monotonic()
        cutoff = time.time() - idle_timeout
        local_cutoff = time.monotonic() - idle_timeout
        async with self._reaching():
            listed = await self.shared.open_sessions()
        idle = []
        for found in listed:
            held = self.registry.get(found.session_id)
            if found.last_used >= cutoff or (
                held is not None and (held.calls or held.last_used >= local_cutoff)
            ):
                continue
            with contextlib.suppress(GatewayError):  # ended meanwhile
                entry = held or await self.adopt(found.digest, touch=False)
                if entry is not None:
                    if held is not None:
                        await self.current(entry, touch=False)
                    idle.append(entry)
        return idle

    async def called_elsewhere(self, entry: SessionEntry, cutoff: float) -> bool:
        """Whether a call of ``entry`` came to another replica since ``cutoff`` (this replica's monotonic
        clock)."""
        async with self._reaching():
            found = await self.shared.open_session(entry.session_id)
        return found is not None and found.last_used > time.time() - (time.monotonic() - cutoff)

    async def record_delivered(self, entry: SessionEntry) -> None:
        """Record a reply's delivery now: the session's next event may be written by another replica."""
        try:
            await entry.session.record_delivered()
        except Exception as error:  # the turn stays undelivered in the log: no sample unless continued
            log.warning("session %s: recording a delivery failed (%s)", entry.session_id, error)

    def recorded_answer(self, entry: SessionEntry, call: ChatCall) -> ChatResult | None:
        """A retried call answered from the turn another replica recorded for it and never handed over."""
        if call.n != 1 or call.previous_turn is not None:
            return None
        session = entry.session
        reply = session.undelivered_turn(call.messages, call.tools)
        if reply is None:
            return None
        return chat_result(session.episode_id, [reply], whole_prompt=call.whole_prompt_ids)

    @contextlib.asynccontextmanager
    async def _reaching(self) -> AsyncIterator[None]:
        """NATS failures of the bucket as 503: the client may retry, on this replica or another."""
        try:
            yield
        except (NatsError, TimeoutError) as error:
            raise GatewayError(
                503,
                f"the gateways' shared session store (NATS KV {self.shared.bucket}) did not answer: "
                f"{error!r}",
                headers={"Retry-After": "1"},
            ) from None


def ended_message(session_id: str, termination: str) -> str:
    return (
        f"session {session_id} ended ({termination}); its key no longer works: a session takes calls and "
        "rewards only while it is open (its samples are made when it ends): post the reward first, then end "
        "it"
    )
