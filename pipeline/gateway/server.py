"""An ASGI app on uvicorn inside the running event loop (the gateway's own process, or a runner's)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, Literal

import uvicorn

from pipeline.errors import TurnstileError
from pipeline.gateway.limits import MAX_BODY_BYTES, READ_TIMEOUT, BoundedRequests, header_timeout_protocol


class _Server(uvicorn.Server):
    """uvicorn that leaves signals to its host (``handle_signals=False``): a gateway inside a runner must
    not take Ctrl-C away from it."""

    def __init__(self, config: uvicorn.Config, *, handle_signals: bool) -> None:
        super().__init__(config)
        self.handle_signals = handle_signals

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if self.handle_signals:
            with super().capture_signals():
                yield
        else:
            yield


class HttpServer:
    """An ASGI app on uvicorn in the running event loop: ``await start()`` (port 0: a free one), ``url``,
    ``await stop()``."""

    def __init__(
        self,
        app: Any,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        handle_signals: bool = False,
        lifespan: Literal["on", "off"] = "on",
        max_body_bytes: int = MAX_BODY_BYTES,
        read_timeout: float | None = READ_TIMEOUT,
        outermost: Callable[[Any], Any] | None = None,
    ) -> None:
        """``outermost``: middleware around everything, the bounds' refusals too (``RequestMetrics``)."""
        # every request bounded (pipeline/gateway/limits.py): its body's size, and the time its parts take
        self.app = BoundedRequests(app, max_body_bytes=max_body_bytes, read_timeout=read_timeout)
        if outermost is not None:
            self.app = outermost(self.app)
        self.read_timeout = read_timeout
        self.host, self.port = host, port
        self.handle_signals = handle_signals
        self.lifespan = lifespan
        self._server: _Server | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    async def start(self) -> str:
        family, kind, _, _, address = socket.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)[0]
        # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on such sockets; without it a small reply can
        # wait ~40 ms for a delayed ACK (Nagle).
        sock = socket.socket(family, kind, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as error:
            sock.close()
            raise TurnstileError(f"cannot listen on {self.host}:{self.port}: {error.strerror}") from None
        self.port = sock.getsockname()[1]
        protocol = header_timeout_protocol(self.read_timeout) if self.read_timeout is not None else None
        config = uvicorn.Config(
            self.app,
            log_level="warning",
            access_log=False,
            lifespan=self.lifespan,
            backlog=4096,
            http=protocol or "auto",
        )
        self._server = _Server(config, handle_signals=self.handle_signals)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]), name=f"http-{self.port}")
        while not self._server.started:
            if self._task.done():
                self._task.result()
                raise TurnstileError(f"the HTTP server on {self.url} stopped while starting")
            await asyncio.sleep(0.01)
        return self.url

    @property
    def stopped(self) -> bool:
        return self._task is None or self._task.done()

    async def wait(self) -> None:
        """Until the server stops (``stop()``, or a signal when it handles them)."""
        if self._task is not None:
            await asyncio.shield(self._task)

    async def stop(self) -> None:
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            await self._task


@contextlib.asynccontextmanager
async def serving_http(app: Any, *, host: str = "127.0.0.1", port: int = 0) -> AsyncIterator[str]:
    """Serve ``app`` for the block; yields its root URL."""
    server = HttpServer(app, host=host, port=port)
    url = await server.start()
    try:
        yield url
    finally:
        await server.stop()
