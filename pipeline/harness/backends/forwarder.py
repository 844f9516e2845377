"""The sandbox's one way out: the gateway, forwarded over a Unix socket.

A sandbox without a network (bubblewrap's ``--unshare-net``, Docker's ``--network none``) still has its own
loopback. Two small forwarders make the gateway answer there and nothing else:

- on the host, ``serve_gateway_socket`` listens on a Unix socket in a directory bound into the sandbox and
  connects each client to the gateway's ``host:port``;
- inside, ``inside_forwarder.py`` (put into that directory by ``install``) listens on ``127.0.0.1:PORT``
  and relays each connection to the socket.

A Unix socket crosses the namespace boundary as a file, so no route, bridge or firewall rule is involved,
and the sandbox has no address from which anything else could be reached.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
from pathlib import Path

from pipeline.harness.backends import inside_forwarder

CHUNK = 65536
SCRIPT = "inside_forwarder.py"
SOCKET = "gateway.sock"


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


async def serve_gateway_socket(socket_path: Path, gateway_host: str, gateway_port: int) -> asyncio.Server:
    """The host side: a Unix socket at ``socket_path`` whose every connection is relayed to the gateway."""

    async def connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(gateway_host, gateway_port)
        except OSError:
            writer.close()  # the gateway is down: the client sees a closed connection, as it would directly
            return
        try:
            await asyncio.gather(_pipe(reader, upstream_writer), _pipe(upstream_reader, writer))
        finally:
            writer.close()
            upstream_writer.close()

    return await asyncio.start_unix_server(connect, sock=_bound_unix_socket(socket_path))


def _bound_unix_socket(path: Path) -> socket.socket:
    """A listening Unix socket at ``path``, however long ``path`` is.

    A Unix socket's address holds at most 107 bytes, and a sandbox directory under a long ``TMPDIR``
    (pytest's ``tmp_path``, a CI runner's work folder) passes that. Binding through ``/proc/self/fd/N/`` of
    the socket's directory makes the same file under a short name (the sandbox sees it as
    ``/run/turnstile/gateway.sock`` anyway)."""
    directory = os.open(path.parent, os.O_PATH | os.O_DIRECTORY)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(f"/proc/self/fd/{directory}/{path.name}")
        listener.listen(128)
    except BaseException:
        listener.close()
        raise
    finally:
        os.close(directory)
    return listener


def install(directory: Path) -> None:
    """Make ``directory`` (bound into a sandbox at some ``RUN``) and put the inside script in it."""
    directory.mkdir()
    shutil.copy(inside_forwarder.__file__, directory / SCRIPT)


def inside_command(interpreter: str, run: str, port: int, keys: list[str], argv: list[str]) -> list[str]:
    """``argv`` wrapped in the inside forwarder (on the host's Python), the directory bound at ``run``."""
    return [
        interpreter,
        "-I",
        "-S",
        f"{run}/{SCRIPT}",
        str(port),
        f"{run}/{SOCKET}",
        ",".join(keys),
        "--",
        *argv,
    ]


def socat_command(run: str, port: int, argv: list[str]) -> list[str]:
    """``argv`` behind Debian's ``socat`` as the inside forwarder: a C program starts in a fraction of
    Python's time (docs/sandboxes.md). ``sh`` starts it, waits until the port listens (its line in
    ``/proc/net/tcp``, state 0A) and becomes ``argv``, so the environment stays exactly the caller's (a
    command that starts at once may connect at once)."""
    listen = f"TCP-LISTEN:{port},bind=127.0.0.1,fork,reuseaddr"
    ready = (  # sh's own read: no process started per look
        f'ready() {{ while read -r _ a _ s _; do [ "$a $s" = "0100007F:{port:04X} 0A" ] && return 0; done'
        " < /proc/net/tcp; return 1; }"
    )
    script = f'{ready}; socat {listen} UNIX-CONNECT:{run}/{SOCKET} & until ready; do :; done; exec "$@"'
    return ["sh", "-c", script, "sh", *argv]
