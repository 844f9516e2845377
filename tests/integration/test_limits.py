"""Bounded requests (pipeline/gateway/limits.py): a body over the limit is refused with 413 as it is read
(the gateway's memory does not grow with it), a body that stalls gets 408, a client that stalls in its
headers is disconnected, and a body under the limit is served as before."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import httpx
import psutil
import pytest

from pipeline.gateway import HttpServer
from tests.conftest import Servers
from tests.support.agent_gateway import gateway_process

MIB = 1024 * 1024


async def echo_length(scope: dict, receive, send) -> None:  # type: ignore[no-untyped-def]
    """An ASGI app that reads the whole body and answers its length."""
    if scope["type"] != "http":
        return
    size, more = 0, True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        size += len(message.get("body", b""))
        more = message.get("more_body", False)
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": str(size).encode()})


async def chunks(total: int, size: int = MIB) -> AsyncIterator[bytes]:
    """``total`` bytes, streamed (chunked: no Content-Length), a MiB at a time."""
    sent = 0
    while sent < total:
        yield b"x" * min(size, total - sent)
        sent += size


async def test_bodies_over_the_limit_are_refused_as_read_and_stalls_are_cut_off() -> None:
    server = HttpServer(echo_length, max_body_bytes=MIB, read_timeout=1.0)  # bounded by HttpServer itself
    url = await server.start()
    try:
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            ok = await client.post("/", content=b"y" * 1000)
            assert (ok.status_code, ok.text) == (200, "1000")
            declared = await client.post("/", content=b"y" * (MIB + 1))  # Content-Length over: not read
            assert declared.status_code == 413
            assert declared.json()["error"]["type"] == "request_too_large"
            assert "--max-body-mib" in declared.json()["error"]["message"]
            streamed = await client.post("/", content=chunks(6 * MIB))  # chunked: counted as it comes
            assert streamed.status_code == 413  # read to its end and dropped: the client gets its answer
        # a body that stops arriving: 408 after the read timeout (the server's outer bound, 1 s)
        reader, writer = await asyncio.open_connection(server.host, server.port)
        writer.write(b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 100\r\n\r\n0123456789")
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), 60)
        assert answer.startswith(b"HTTP/1.1 408"), answer[:80]
        assert b"request_timeout" in answer
        writer.close()
        # headers that never end (slowloris): the connection is closed
        reader, writer = await asyncio.open_connection(server.host, server.port)
        writer.write(b"POST / HTTP/1.1\r\nHost: t\r\n")
        await writer.drain()
        assert await asyncio.wait_for(reader.read(), 60) == b""  # closed by the server, nothing sent
        writer.close()
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            try:  # past 8x the limit the server stops reading and closes: the 413 if the client reads it
                endless = await client.post("/", content=chunks(1024 * MIB))
                assert endless.status_code == 413
            except httpx.TransportError:
                pass  # or the reset of a connection it was still writing to
    finally:
        await server.stop()


@pytest.fixture
async def gateway_pid_url(servers: Servers, database_url: str) -> AsyncIterator[tuple[int, str, str]]:
    key, pids = uuid.uuid4().hex, []
    async with gateway_process(database_url, servers.nats_url, "limits", key, pids=pids) as url:
        yield pids[0], url, key


async def test_a_200_mb_body_to_the_gateway_is_refused_without_holding_it(
    gateway_pid_url: tuple[int, str, str],
) -> None:
    """Before: read whole before its 400 (RSS 239 -> 1,254 MB). Now 413 at 32 MiB, memory flat."""
    pid, url, key = gateway_pid_url
    gateway = psutil.Process(pid)
    before = gateway.memory_info().rss
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        session = await client.post("/admin/sessions", headers={"Authorization": f"Bearer {key}"}, json={})
        assert session.status_code in (200, 201), session.text
        headers = {"Authorization": f"Bearer {session.json()['api_key']}", "Content-Type": "application/json"}
        refused = await client.post("/v1/chat/completions", headers=headers, content=chunks(200 * MIB))
        assert refused.status_code == 413, refused.text
        assert refused.json()["error"]["code"] == "request_too_large"
        declared = await client.post("/v1/messages", headers=headers, content=b"{" + b" " * (40 * MIB) + b"}")
        assert declared.status_code == 413
    grew = gateway.memory_info().rss - before
    assert grew < 100 * MIB, f"the gateway grew {grew / MIB:.0f} MiB"
