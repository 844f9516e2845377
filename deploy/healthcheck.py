"""Container healthchecks for docker-compose.yml: exit 0 when healthy, else 1 with the reason on stderr.

  healthcheck.py nats-subscribed SUBJECT [QUEUE]  this container's NATS user, connected from here,
                                                  subscribes SUBJECT (in queue group QUEUE)
  healthcheck.py nats-connected                   this container's NATS user is connected from here
  healthcheck.py postgres-session                 another session of this container's database user is open
  healthcheck.py http URL                         URL answers 2xx

The NATS checks ask the server's monitoring endpoint (TURNSTILE_NATS_MONITOR_URL, e.g. http://nats:8222;
compose does not publish it) for the connections of the user in TURNSTILE_NATS_URL whose address is one of
this container's. Standard library only, plus psycopg (in the image) for the PostgreSQL check.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import urllib.parse
import urllib.request
from typing import Any


def local_addresses() -> set[str]:
    # Loopback too: a process on the server's own host connects from there (no container connects so).
    found = {"127.0.0.1", "::1"}
    for name in {socket.gethostname(), socket.getfqdn()}:
        try:
            found.update(str(info[4][0]) for info in socket.getaddrinfo(name, None))
        except OSError:
            continue
    return found


def nats_connections() -> list[dict[str, Any]]:
    monitor = os.environ.get("TURNSTILE_NATS_MONITOR_URL", "http://nats:8222").rstrip("/")
    user = urllib.parse.urlsplit(os.environ.get("TURNSTILE_NATS_URL", "")).username or ""
    query = urllib.parse.urlencode({"auth": "true", "subs": "detail", "limit": "100000"})
    with urllib.request.urlopen(f"{monitor}/connz?{query}", timeout=5) as response:
        connections: list[dict[str, Any]] = json.load(response).get("connections") or []
    mine = local_addresses()
    return [c for c in connections if c.get("ip") in mine and (not user or c.get("authorized_user") == user)]


def nats_subscribed(subject: str, queue: str = "") -> str | None:
    for connection in nats_connections():
        for subscription in connection.get("subscriptions_list_detail") or []:
            if subscription.get("subject") == subject and subscription.get("qgroup", "") == queue:
                return None
    return f"no NATS connection from this container subscribes {subject!r}" + (
        f" in queue {queue!r}" if queue else ""
    )


def nats_connected() -> str | None:
    return None if nats_connections() else "no NATS connection from this container"


def postgres_session() -> str | None:
    import psycopg

    from pipeline.settings import Settings, libpq_url

    with psycopg.connect(libpq_url(Settings().require_database_url()), connect_timeout=5) as connection:
        row = connection.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE usename = current_user AND pid <> pg_backend_pid()"
        ).fetchone()
    return None if row and row[0] else "no other PostgreSQL session of this user is open"


def http_ok(url: str) -> str | None:
    with urllib.request.urlopen(url, timeout=5) as response:
        return None if 200 <= response.status < 300 else f"{url} answered {response.status}"


def main(argv: list[str]) -> int:
    checks = {
        "nats-subscribed": nats_subscribed,
        "nats-connected": nats_connected,
        "postgres-session": postgres_session,
        "http": http_ok,
    }
    if not argv or argv[0] not in checks:
        print(__doc__, file=sys.stderr)
        return 2
    try:
        problem = checks[argv[0]](*argv[1:])
    except Exception as error:  # unreachable server, refused login, bad arguments: unhealthy, and why
        problem = f"{type(error).__name__}: {error}"
    if problem:
        print(problem, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
