"""Episode browser service: ``turnstile ui`` (read-only web pages over the log and the read models).

Wiring only: the app (``pipeline.ui``) on uvicorn in this process, until Ctrl-C or SIGTERM. The login is
checked before it listens, so a wrong URL or a superuser login fails at start with what to do.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console

from consumers.runtime import running, serve_until_stopped
from pipeline.errors import ConfigError
from pipeline.gateway import MAX_BODY_BYTES, READ_TIMEOUT, HttpServer, check_http_limits
from pipeline.ui import check_login, create_app, reader_engine


@dataclass(frozen=True)
class UiConfig:
    reader_url: str
    host: str = "127.0.0.1"
    port: int = 8080
    allow_superuser: bool = False
    tokenizer_dirs: Mapping[str, Path] = field(default_factory=dict)
    reruns: bool = False
    rerun_agent: str | None = None
    max_body_bytes: int = MAX_BODY_BYTES
    read_timeout: float = READ_TIMEOUT

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ConfigError(f"--port must be within 0..65535, got {self.port}")
        for policy, directory in self.tokenizer_dirs.items():
            if not directory.is_dir():
                raise ConfigError(f"--model {policy}={directory}: not a directory")
        check_http_limits(self.max_body_bytes, self.read_timeout)


async def serve_ui(
    config: UiConfig,
    *,
    stop: asyncio.Event | None = None,
    ready: Callable[[str], object] | None = None,
    console: Console | None = None,
) -> None:
    """Serve until Ctrl-C, SIGTERM or ``stop``; ``ready(url)`` once it listens."""
    console = console or Console(stderr=True)
    engine = reader_engine(config.reader_url, pool_size=1)
    try:
        await check_login(engine, allow_superuser=config.allow_superuser)
    finally:
        await engine.dispose()
    app = create_app(
        config.reader_url,
        allow_superuser=config.allow_superuser,
        tokenizer_dirs=config.tokenizer_dirs,
        reruns=config.reruns,
        rerun_agent=config.rerun_agent,
    )
    async with running("ui", stop=stop) as runtime:
        server = HttpServer(
            app,
            host=config.host,
            port=config.port,
            max_body_bytes=config.max_body_bytes,
            read_timeout=config.read_timeout,
        )
        url = await server.start()
        console.print(f"episode browser on {url}/episodes (read-only; Ctrl-C stops it)")
        if ready is not None:
            ready(url)
        await serve_until_stopped(server, runtime.stop)
