"""The harness's side of the gateway's admin HTTP API, and its record of the sessions it holds open.

A harness talks to the gateway only over ``/admin/sessions`` (it may run on another machine). The sessions
it opened and has not ended are journalled as files under its state directory, one per session, while a
lock on that directory says the harness is alive; the next harness of the same owner (after a kill -9, a
power cut) takes the lock and ends each journalled session ``aborted``, so no episode stays open.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from pipeline.errors import ConfigError, TurnstileError

ADMISSION_WAIT_S = 600.0
"""How long opening a session waits out the gateway's 429 (``--max-open-sessions``, staleness)."""


class GatewayUnavailable(TurnstileError):
    """The gateway could not be reached or refused the admin call."""


class AdminClient:
    """``POST /admin/sessions`` and a session's reward and end, with the admin key."""

    def __init__(self, url: str, admin_key: str) -> None:
        self.url = url.rstrip("/")
        self._http = httpx.AsyncClient(
            base_url=self.url, headers={"Authorization": f"Bearer {admin_key}"}, timeout=60
        )

    async def close(self) -> None:
        await self._http.aclose()

    async def _post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        try:
            return await self._http.post(path, json=body)
        except httpx.HTTPError as error:
            raise GatewayUnavailable(
                f"the gateway at {self.url} cannot be reached ({type(error).__name__}: {error}); "
                "is `turnstile serve gateway` running there?"
            ) from None

    @staticmethod
    def _check(response: httpx.Response, what: str) -> dict[str, Any]:
        if response.status_code == 401:
            raise ConfigError(f"the gateway refused the admin key ({what}): pass the gateway's --admin-key")
        if response.status_code >= 300:
            raise GatewayUnavailable(f"{what}: the gateway answered {response.status_code}: {response.text}")
        body: dict[str, Any] = response.json()
        return body

    async def open_session(self, spec: dict[str, Any]) -> dict[str, Any]:
        """A new session (``session_id``, ``api_key``, ``base_url``), waiting while admission refuses."""
        deadline = asyncio.get_running_loop().time() + ADMISSION_WAIT_S
        while True:
            response = await self._post("/admin/sessions", spec)
            if response.status_code != 429 or asyncio.get_running_loop().time() > deadline:
                return self._check(response, "opening a session")
            await asyncio.sleep(float(response.headers.get("retry-after", "1")))

    async def describe(self, session_id: str) -> dict[str, Any]:
        try:
            response = await self._http.get(f"/admin/sessions/{session_id}")
        except httpx.HTTPError as error:
            raise GatewayUnavailable(f"the gateway at {self.url} cannot be reached: {error}") from None
        return self._check(response, f"reading session {session_id}")

    async def reward(self, session_id: str, value: float) -> None:
        self._check(
            await self._post(f"/admin/sessions/{session_id}/reward", {"value": value, "source": "verifier"}),
            f"posting the reward of session {session_id}",
        )

    async def end(
        self, session_id: str, termination: str | None, error: str | None, metrics: dict[str, float]
    ) -> bool:
        """End the session; False if it had already ended or is unknown (404, 409): nothing left open."""
        body: dict[str, Any] = {"error": error, "metrics": metrics}
        if termination is not None:
            body["termination"] = termination
        response = await self._post(f"/admin/sessions/{session_id}/end", body)
        if response.status_code in (404, 409):
            return False
        self._check(response, f"ending session {session_id}")
        return True


class Journal:
    """The owner's state directory: a lock while its harness lives, a file per session it holds open."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.sessions = directory / "sessions"
        self._lock: int | None = None

    def acquire(self, owner: str) -> None:
        """Take the owner's lock, or a ``ConfigError``: another harness of this owner is running."""
        self.sessions.mkdir(parents=True, exist_ok=True)
        handle = os.open(self.directory / "lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(handle)
            raise ConfigError(
                f"another harness runs as owner {owner!r} (it holds {self.directory / 'lock'}): "
                "give this one its own --owner"
            ) from None
        self._lock = handle

    def release(self) -> None:
        if self._lock is not None:
            os.close(self._lock)  # closing the descriptor drops the lock
            self._lock = None

    def add(self, session_id: str, gateway: str) -> None:
        (self.sessions / session_id).write_text(gateway)

    def remove(self, session_id: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            (self.sessions / session_id).unlink()

    def left_open(self) -> Iterator[tuple[str, str]]:
        """(session id, gateway URL) of each session a previous harness left open."""
        for path in sorted(self.sessions.iterdir()):
            yield path.name, path.read_text().strip()
