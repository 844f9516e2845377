"""Session keys: API keys -> the open sessions (episodes) they may use. Keys are
``secrets.token_urlsafe(32)`` and only their SHA-256 digests are kept. A session started elsewhere (a
runner's episode, see ``pipeline.runners.proxy``) can be registered too: the gateway then serves its calls
and rewards but leaves starting and ending it to its owner."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import secrets
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from dataclasses import dataclass, field
from typing import Any, Final, TypeVar

from pipeline.dialects import ParseMemo
from pipeline.episodes import EpisodeSession
from pipeline.errors import TurnstileError
from pipeline.gateway.http_error import GatewayError
from pipeline.gateway.shared import SharedRecord

_T = TypeVar("_T")

ANSWERS_KEPT: Final = 8
"""Calls remembered per session for answering retries, newest first (each holds its reply and prompt ids:
a retry comes within seconds of its call, and a long conversation's ids are large)."""
ENDED_KEPT: Final = 100_000
"""Ended sessions remembered (newest first), so that their keys get 409 "has ended", not 401 "invalid key"."""


@dataclass(frozen=True, slots=True)
class EndedSession:
    session_id: str
    digest: bytes
    ended_at: float
    termination: str | None

    def conflict(self, what: str = "") -> GatewayError:
        """409 for a call on this ended session, saying what ended it and what to do instead."""
        ago = time.monotonic() - self.ended_at
        how = f" ({self.termination})" if self.termination else ""
        message = f"session {self.session_id} ended{how} {ago:.0f} s ago; its key no longer works"
        return GatewayError(409, message + (f": {what}" if what else ""))


def key_digest(api_key: str) -> bytes:
    return hashlib.sha256(api_key.encode()).digest()


Listener = Callable[[], Awaitable[bool]]
"""Whether a client that asked is still connected (``starlette.Request.is_disconnected``, negated)."""


@dataclass(frozen=True, slots=True)
class RetryKeys:
    """What marks a call as a retry of an earlier one: its ``Idempotency-Key``, the hash of its route and
    body, and whether the client says it retries (``x-stainless-retry-count``: None when not sent)."""

    idempotency_key: str | None
    body: bytes
    retry_count: int | None


@dataclass
class Answer:
    """A call of the session and its result (a task: retries that come while it runs wait for it), and the
    clients waiting for it."""

    task: asyncio.Task[Any]
    listeners: list[Listener] = field(default_factory=list)
    delivered: bool = False
    """The reply was handed to a live client (the call's or a retry's) after its turns were recorded."""

    async def result(self) -> Any:
        """The call's result, waited for without cancelling it when the waiter goes (a retry may come); 409
        when the session was closed while it ran (``SessionRegistry.close`` cancels its calls)."""
        try:
            return await asyncio.shield(self.task)
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if self.task.cancelled() and not (current is not None and current.cancelling()):
                raise GatewayError(409, "the session was closed while this call was in flight") from None
            raise

    async def listening(self) -> bool:
        """Whether any client that asked (the call, or a retry of it) is still there to get the reply."""
        for connected in list(self.listeners):
            if await connected():
                return True
        return False


class SessionEntry:
    """An open session as the gateway holds it: whose it is, when it was last used, its calls in flight."""

    def __init__(self, session: EpisodeSession, digest: bytes, *, owned: bool) -> None:
        self.session = session
        self.digest = digest
        self.owned = owned
        self.last_used = time.monotonic()
        self.calls: set[asyncio.Task[Any]] = set()
        self.disconnected_at: float | None = None
        """When a reply of this session last found its client gone (None: since then a call came): with no
        call for ``Gateway.gone_after`` seconds after that, the session ends ``aborted``."""
        self.tool_arguments: dict[str, str] = {}
        """Tool call id -> the arguments text the model wrote, for every turn served here: an API that
        sends arguments back parsed (Anthropic's ``tool_use.input``) gets the exact text restored."""
        self.answers: OrderedDict[bytes | str, Answer] = OrderedDict()
        """The latest calls by body hash and by ``Idempotency-Key``, for answering retries."""
        self.memos: dict[str, ParseMemo] = {}
        """Per dialect, what the session's recent calls parsed to (a call parses only what it adds)."""
        self.untrained_models: tuple[str, ...] = ()
        """Patterns (``fnmatch``, case-sensitive) of request ``model`` names whose calls are side calls, not
        for training (``SessionSpec.untrained_models``)."""
        self.shared: SharedRecord | None = None
        """The session as gateway replicas share it (``pipeline.gateway.shared``); None: this gateway's
        own."""
        self.touched_at = float("-inf")
        """When this replica last noted a call for the others (wall clock, ``SharedSessions.touch``)."""
        self.arguments_seen = 0
        """How many of the session's turns ``tool_arguments`` holds the calls of."""

    def prior(self, keys: RetryKeys) -> Answer | None:
        """The earlier call ``keys`` retry, if any: the same ``Idempotency-Key``; or the same body when the
        client says it retries (``x-stainless-retry-count`` > 0), or, from a client that does not say
        (no such header), while the earlier call runs or when its reply reached nobody. A body sent again
        after its reply was delivered, or with retry count 0, is a new call (an agent sampling again)."""
        if keys.idempotency_key is not None:
            answer = self.answers.get("idempotency:" + keys.idempotency_key)
            if answer is not None:
                return answer
        answer = self.answers.get(keys.body)
        if answer is None or keys.retry_count == 0:
            return None
        if keys.retry_count is not None or not answer.task.done():
            return answer
        return None if answer.delivered else answer

    def remember(self, keys: RetryKeys, answer: Answer) -> None:
        names: Iterable[bytes | str] = [keys.body]
        if keys.idempotency_key is not None:
            names = [keys.body, "idempotency:" + keys.idempotency_key]
        for name in names:
            self.answers[name] = answer
            self.answers.move_to_end(name)
        while len(self.answers) > ANSWERS_KEPT:
            self.answers.popitem(last=False)

    def forget(self, answer: Answer) -> None:
        """Drop a call that failed: a retry of it runs again."""
        for name in [name for name, known in self.answers.items() if known is answer]:
            del self.answers[name]

    def memo(self, dialect: str) -> ParseMemo:
        return self.memos.setdefault(dialect, ParseMemo())

    @property
    def session_id(self) -> str:
        return self.session.episode_id

    def start(self, work: Coroutine[Any, Any, _T]) -> asyncio.Task[_T]:
        """Start one call of this session as a task the session can wait for (or cancel) when it closes."""
        self.last_used = time.monotonic()
        task = asyncio.create_task(work)
        self.calls.add(task)
        task.add_done_callback(self._finished)
        return task

    def _finished(self, call: asyncio.Task[Any]) -> None:
        self.calls.discard(call)
        self.last_used = time.monotonic()


class SessionRegistry:
    """API keys -> open sessions. Keys are kept only as SHA-256 digests."""

    def __init__(self, *, ended_kept: int = ENDED_KEPT) -> None:
        self._by_digest: dict[bytes, SessionEntry] = {}
        self._by_id: dict[str, SessionEntry] = {}
        self._ended: OrderedDict[str, EndedSession] = OrderedDict()
        self._ended_digests: dict[bytes, str] = {}
        self._ended_kept = ended_kept

    def register(self, session: EpisodeSession, *, owned: bool = False) -> str:
        """A fresh key for ``session`` (``owned``: the gateway started it and ends it)."""
        if session.episode_id in self._by_id:
            raise TurnstileError(f"session {session.episode_id} is already registered")
        api_key = "ts-" + secrets.token_urlsafe(32)
        self.add(SessionEntry(session, key_digest(api_key), owned=owned))
        return api_key

    def add(self, entry: SessionEntry) -> SessionEntry:
        """Hold ``entry`` under its key's digest (a session another gateway replica started: its key is
        known here by its digest only, or one that ``close`` took away and that stays open after all)."""
        self._by_digest[entry.digest] = entry
        self._by_id[entry.session_id] = entry
        if self._ended.pop(entry.session_id, None) is not None:
            self._ended_digests.pop(entry.digest, None)
        return entry

    def lookup(self, api_key: str) -> SessionEntry | None:
        digest = key_digest(api_key)
        entry = self._by_digest.get(digest)
        return entry if entry is not None and hmac.compare_digest(entry.digest, digest) else None

    def get(self, session_id: str) -> SessionEntry | None:
        return self._by_id.get(session_id)

    def ended(self, session_id: str) -> EndedSession | None:
        """The session if it ended here recently (the newest ``ended_kept`` are remembered)."""
        return self._ended.get(session_id)

    def ended_by_key(self, api_key: str) -> EndedSession | None:
        session_id = self._ended_digests.get(key_digest(api_key))
        return None if session_id is None else self._ended.get(session_id)

    def mark_ended(self, session_id: str, termination: str) -> None:
        """Record how a closed session ended (shown in the 409 a later call gets)."""
        ended = self._ended.get(session_id)
        if ended is not None:
            self._ended[session_id] = EndedSession(session_id, ended.digest, ended.ended_at, termination)

    def entries(self) -> list[SessionEntry]:
        return list(self._by_id.values())

    def owned_count(self) -> int:
        return sum(entry.owned for entry in self._by_id.values())

    def __len__(self) -> int:
        return len(self._by_id)

    async def close(self, session_id: str, *, cancel: bool = False, wait: bool = True) -> SessionEntry | None:
        """Forget the session (its key stops working at once), then wait for its calls in flight to be
        recorded (unless not ``wait``: a call that finds its session ended elsewhere), or cancel them
        (``cancel``)."""
        entry = self._by_id.pop(session_id, None)
        if entry is None:
            return None
        self._by_digest.pop(entry.digest, None)
        self._ended[session_id] = EndedSession(session_id, entry.digest, time.monotonic(), None)
        self._ended_digests[entry.digest] = session_id
        while len(self._ended) > self._ended_kept:
            _, oldest = self._ended.popitem(last=False)
            self._ended_digests.pop(oldest.digest, None)
        calls = list(entry.calls) if wait or cancel else []
        if cancel:
            for call in calls:
                call.cancel()
        await asyncio.gather(*calls, return_exceptions=True)
        return entry
