"""The sandbox's one way out: the gateway, forwarded over a Unix socket.

A sandbox without a network (bubblewrap's ``--unshare-net``, Docker's ``--network none``) still has its own
loopback. Two small forwarders make the gateway answer there and nothing else:

- on the host, ``serve_gateway_socket`` listens on a Unix socket in a directory bound into the sandbox and
  connects each client to the gateway's ``host:port``;
- inside, this file run as a script (``python3 -I -S forwarder.py PORT SOCKET KEYS -- ARGV...``) listens on
  ``127.0.0.1:PORT``, relays each connection to that socket, and runs ARGV as its child: the command starts
  only once the port answers, and its exit code is the script's. ``KEYS`` (comma-separated names) are the
  variables the command gets: exactly the caller's, not the ``LC_CTYPE`` Python's start-up adds (PEP 538).

A Unix socket crosses the namespace boundary as a file, so no route, bridge or firewall rule is involved,
and the sandbox has no address from which anything else could be reached. The module imports only the
standard library because the sandbox runs it with the host's interpreter and no site-packages.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import sys
from pathlib import Path

CHUNK = 65536


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy ``reader`` to ``writer`` until end of stream, then half-close the writer."""
    try:
        while data := await reader.read(CHUNK):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (ConnectionError, OSError):
        writer.close()


async def _relay(
    client: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter],
) -> None:
    """Both directions of one connection until both ends are done."""
    try:
        await asyncio.gather(_pipe(client[0], upstream[1]), _pipe(upstream[0], client[1]))
    finally:
        for _, writer in (client, upstream):
            writer.close()


async def serve_gateway_socket(socket_path: str, gateway_host: str, gateway_port: int) -> asyncio.Server:
    """The host side: a Unix socket at ``socket_path`` whose every connection is relayed to the gateway."""

    async def connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            upstream = await asyncio.open_connection(gateway_host, gateway_port)
        except OSError:
            writer.close()  # the gateway is down: the client sees a closed connection, as it would directly
            return
        await _relay((reader, writer), upstream)

    return await asyncio.start_unix_server(connect, path=socket_path)


def install(directory: Path) -> None:
    """Make ``directory`` (bound into a sandbox) and put this script in it, for the sandbox to run."""
    directory.mkdir()
    shutil.copy(__file__, directory / "forwarder.py")


async def _inside(port: int, socket_path: str, keys: list[str], argv: list[str]) -> int:
    """The sandbox side: listen on 127.0.0.1:``port``, then run ``argv`` and return its exit code."""

    async def connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            upstream = await asyncio.open_unix_connection(socket_path)
        except OSError:
            writer.close()
            return
        await _relay((reader, writer), upstream)

    server = await asyncio.start_server(connect, "127.0.0.1", port)
    try:
        env = {key: os.environ[key] for key in keys if key in os.environ}
        process = await asyncio.create_subprocess_exec(*argv, env=env)
    except OSError as error:
        print(f"sandbox: cannot run {argv[0]!r}: {error}", file=sys.stderr)
        return 127
    # A signal to this script (the sandbox stopping) ends the command too.
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, process.send_signal, signum)
    code = await process.wait()
    server.close()
    return code if code >= 0 else 128 - code


def main(args: list[str]) -> int:
    """``PORT SOCKET KEYS -- ARGV...``"""
    port, socket_path, keys, separator, *argv = args
    if separator != "--" or not argv:
        print("usage: forwarder.py PORT SOCKET KEYS -- ARGV...", file=sys.stderr)
        return 2
    with contextlib.suppress(KeyboardInterrupt):
        return asyncio.run(_inside(int(port), socket_path, keys.split(","), argv))
    return 130


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
