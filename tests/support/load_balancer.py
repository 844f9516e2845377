"""Debian's HAProxy on deploy/haproxy.cfg (what docker-compose.yml runs in front of the gateway replicas), on
a free loopback port, with the config's servers pointed at the given addresses."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from pipeline.dev.embedded import free_port
from tests.support.waiting import wait_until

CONFIG = Path(__file__).resolve().parents[2] / "deploy" / "haproxy.cfg"
SERVER = re.compile(r"^(\s+server \S+ )(\S+)( .*)$", re.MULTILINE)


def haproxy_binary() -> str:
    """Debian's haproxy (``apt-get install haproxy``; .ci/run installs it); missing: a skip, or under CI a
    failure, so that the step cannot pass empty."""
    found = shutil.which("haproxy") or next(
        (str(p) for p in (Path("/usr/sbin/haproxy"), Path("/sbin/haproxy")) if p.exists()), None
    )
    if found is None:
        missing = "haproxy is missing: apt-get install haproxy (Debian)"
        if os.environ.get("CI"):
            pytest.fail(missing)
        pytest.skip(missing)
    return found


def localized_config(servers: list[str], port: int) -> str:
    """deploy/haproxy.cfg listening on 127.0.0.1:``port``, its servers at ``servers`` (host:port, in
    order)."""
    text = CONFIG.read_text()
    found = SERVER.findall(text)
    assert len(found) == len(servers), f"deploy/haproxy.cfg has {len(found)} servers, not {len(servers)}"
    addresses = iter(servers)
    text = SERVER.sub(lambda match: f"{match.group(1)}{next(addresses)}{match.group(3)}", text)
    assert "bind *:8000" in text
    return text.replace("bind *:8000", f"bind 127.0.0.1:{port}")


@contextlib.asynccontextmanager
async def haproxy(servers: list[str], directory: Path) -> AsyncIterator[str]:
    """HAProxy in front of ``servers`` for the block; yields its URL once it accepts connections."""
    port = free_port()
    config = directory / "haproxy.cfg"
    config.write_text(localized_config(servers, port))
    process = await asyncio.create_subprocess_exec(
        haproxy_binary(), "-f", str(config), "-db",
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip

    async def listening() -> bool:
        assert process.returncode is None, f"haproxy exited with {process.returncode}"
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            return False
        writer.close()
        return True

    try:
        await wait_until(listening, 30, "haproxy listens")
        yield f"http://127.0.0.1:{port}"
    finally:
        if process.returncode is None:
            process.terminate()
            await process.wait()
