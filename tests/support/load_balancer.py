"""Debian's HAProxy on deploy/haproxy.cfg (what docker-compose.yml runs in front of the gateway replicas), on
a free loopback port, with the config's servers pointed at the given addresses; two gateway replicas behind
it, and the replica that holds a call, to kill."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import signal
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from pipeline.dev.embedded import free_port
from tests.support.agent_gateway import gateway_process
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


@dataclass(frozen=True)
class Replica:
    url: str
    pid: int


@contextlib.asynccontextmanager
async def gateway_replicas(
    database_url: str, nats_url: str, policy: str, admin_key: str, directory: Path
) -> AsyncIterator[tuple[str, list[Replica]]]:
    """Two ``turnstile serve gateway --shared-sessions`` processes and HAProxy in front: the balancer's URL,
    and the replicas."""
    pids: list[int] = []
    shared = ("--shared-sessions",)
    async with (
        gateway_process(database_url, nats_url, policy, admin_key, pids=pids, options=shared) as one,
        gateway_process(database_url, nats_url, policy, admin_key, pids=pids, options=shared) as two,
        haproxy([one.removeprefix("http://"), two.removeprefix("http://")], directory) as balancer,
    ):
        yield balancer, [Replica(url, pid) for url, pid in zip([one, two], pids, strict=True)]


async def sessions_held(replica: Replica, admin_key: str) -> list[dict[str, Any]]:
    """``GET /admin/sessions`` of one replica, asked directly (not through the balancer)."""
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {admin_key}"}, timeout=30) as http:
        listed: list[dict[str, Any]] = (await http.get(f"{replica.url}/admin/sessions")).json()["data"]
    return listed


async def kill_holding_replica(replicas: list[Replica], admin_key: str, session_id: str) -> Replica:
    """SIGKILL the replica that has a call of the session in flight; that replica."""
    for replica in replicas:
        held = await sessions_held(replica, admin_key)
        if any(s["session_id"] == session_id and s["calls_in_flight"] for s in held):
            os.kill(replica.pid, signal.SIGKILL)
            return replica
    raise AssertionError(f"no replica has a call of session {session_id} in flight")
