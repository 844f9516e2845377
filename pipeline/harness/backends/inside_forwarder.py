"""The sandbox side of the gateway forwarder (see ``forwarder``), run inside as a script on the host's Python:

    python3 -I -S inside_forwarder.py PORT SOCKET KEYS -- ARGV...

Listens on ``127.0.0.1:PORT``, relays each connection to the Unix socket ``SOCKET``, runs ARGV as its child
with exactly the variables named in ``KEYS`` (comma-separated: not the ``LC_CTYPE`` Python's own start-up
adds, PEP 538) and exits with its code. The command starts only once the port is listening.

It runs once per command, so it is written for start-up time: the C modules ``_socket`` and ``_thread``
rather than ``socket`` and ``threading`` (whose imports, like asyncio's, cost more than the rest of a
sandbox's start: docs/sandboxes.md has the figures), and ``os.posix_spawnp``. No signal handling: the
sandbox ends by SIGKILL of its whole pid namespace.
"""

from __future__ import annotations

import _socket
import _thread
import os
import sys

CHUNK = 65536


def _pipe(source: _socket.socket, target: _socket.socket) -> None:
    """Copy until end of stream, then half-close ``target`` so the other side sees the end too."""
    try:
        while data := source.recv(CHUNK):
            target.sendall(data)
        target.shutdown(_socket.SHUT_WR)
    except OSError:
        pass


def _pipe_then_release(source: _socket.socket, target: _socket.socket, done: _thread.LockType) -> None:
    try:
        _pipe(source, target)
    finally:
        done.release()


def _connection(client: _socket.socket, socket_path: str) -> None:
    """Both directions of one connection (one in a thread of its own), then both sockets closed."""
    upstream = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    try:
        upstream.connect(socket_path)
    except OSError:
        client.close()  # the host side is gone: the client sees a closed connection, as it would directly
        upstream.close()
        return
    done = _thread.allocate_lock()
    done.acquire()
    _thread.start_new_thread(_pipe_then_release, (upstream, client, done))
    _pipe(client, upstream)
    done.acquire()
    client.close()
    upstream.close()


def _serve(listener: _socket.socket, socket_path: str) -> None:
    while True:
        fd, _ = listener._accept()  # type: ignore[attr-defined]  # the C socket's accept: a descriptor
        _thread.start_new_thread(_connection, (_socket.socket(fileno=fd), socket_path))


def main(args: list[str]) -> int:
    if len(args) < 5 or args[3] != "--":
        print("usage: inside_forwarder.py PORT SOCKET KEYS -- ARGV...", file=sys.stderr)
        return 2
    port, socket_path, keys, argv = int(args[0]), args[1], args[2].split(","), args[4:]
    listener = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", port))
    listener.listen(128)
    _thread.start_new_thread(_serve, (listener, socket_path))
    env = {key: os.environ[key] for key in keys if key in os.environ}
    try:
        child = os.posix_spawnp(argv[0], argv, env)
    except OSError as error:
        print(f"sandbox: cannot run {argv[0]!r}: {error}", file=sys.stderr)
        return 127
    _, status = os.waitpid(child, 0)
    code = os.waitstatus_to_exitcode(status)
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
