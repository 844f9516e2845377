"""What the episode browser's routes share: the ``Browser`` (where to read, tokenizers, the engine once
opened), the page renderers' type, and the query string as the list pages parse it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import Request
from fastapi.responses import HTMLResponse
from sqlalchemy.ext.asyncio import AsyncEngine

from pipeline.log import EventStore
from pipeline.replay import load_tokenizer
from pipeline.ui.reader import check_login, reader_engine

Page = Callable[..., HTMLResponse]
"""``page(request, template, status=200, **context)`` or ``error_page(request, status, title, message)``."""


@dataclass
class Browser:
    """What the app holds: where to read, the tokenizers by policy, and the engine once opened."""

    reader_url: str
    allow_superuser: bool = False
    tokenizer_dirs: Mapping[str, Path] = field(default_factory=dict)  # policy -> directory; "*": any
    reruns: bool = False  # /episodes/ID/rerun runs agent code (the recorded agent, or rerun_agent)
    rerun_agent: str | None = None
    rerun_timeout: float = 60.0
    agents: dict[str, Any] = field(default_factory=dict)
    engine: AsyncEngine | None = None
    store: EventStore | None = None
    tokenizers: dict[Path, Any] = field(default_factory=dict)
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    async def open(self) -> tuple[AsyncEngine, EventStore]:
        async with self._lock:
            if self.engine is None or self.store is None:
                engine = reader_engine(self.reader_url)
                try:
                    await check_login(engine, allow_superuser=self.allow_superuser)
                except BaseException:
                    await engine.dispose()
                    raise
                # The store is used for reading only (load_episode, resolve_episode_id): it never appends.
                self.engine, self.store = engine, EventStore(engine)
            return self.engine, self.store

    async def close(self) -> None:
        if self.engine is not None:
            await self.engine.dispose()
        self.engine = self.store = None

    def tokenizer(self, policy: str) -> tuple[Any | None, str | None]:
        directory = self.tokenizer_dirs.get(policy) or self.tokenizer_dirs.get("*")
        if directory is None:
            return None, None
        if directory not in self.tokenizers:
            self.tokenizers[directory] = load_tokenizer(directory)
        return self.tokenizers[directory], str(directory)


def query_params(request: Request) -> dict[str, list[str]]:
    """The request's query string as name -> values (a name may be given several times: ``tag``)."""
    params: dict[str, list[str]] = {}
    for name, value in request.query_params.multi_items():
        params.setdefault(name, []).append(value)
    return params


def base_path(request: Request) -> str:
    """Where the app is mounted (``/ui`` in the gateway, empty alone): links are made under it."""
    return str(request.scope.get("root_path", "")).rstrip("/")
