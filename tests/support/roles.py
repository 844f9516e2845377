"""NATS with deploy/nats.conf's users and permissions, and connections as each role (fixtures shared by
tests/e2e/test_deploy.py and tests/integration/test_security.py through conftest.py)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import nats
import pytest
from nats.aio.client import Client as NatsConnection

from pipeline.dev.embedded import EmbeddedNats, free_port
from pipeline.settings import nats_inbox_prefix

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
ROLES = ("runner", "gateway", "inference", "relay", "trainer", "harness", "admin")


@dataclass
class RoleNats:
    """A nats-server running deploy/nats.conf, on loopback ports of its own."""

    port: int
    monitor_port: int
    passwords: dict[str, str]

    def url(self, role: str) -> str:
        return f"nats://{role}:{self.passwords[role]}@127.0.0.1:{self.port}"


def password_variable(role: str) -> str:
    return "TURNSTILE_NATS_ADMIN_PASSWORD" if role == "admin" else f"TURNSTILE_{role.upper()}_PASSWORD"


def start_deploy_nats(
    directory: Path, environment: dict[str, str]
) -> tuple[subprocess.Popen[bytes], int, int]:
    """nats-server on deploy/nats.conf as it is, but for its JetStream directory (flags move its ports)."""
    directory.mkdir(parents=True, exist_ok=True)
    text = (DEPLOY / "nats.conf").read_text()
    assert text.count('store_dir: "/data/jetstream"') == 1
    config = directory / "nats.conf"
    config.write_text(text.replace('store_dir: "/data/jetstream"', f'store_dir: "{directory / "jetstream"}"'))
    port, monitor_port, log = free_port(), free_port(), directory / "nats.log"
    process = subprocess.Popen(
        [
            str(EmbeddedNats.binary()), "-c", str(config), "-a", "127.0.0.1", "-p", str(port),
            "-m", str(monitor_port), "-l", str(log),
        ],
        env={**os.environ, **environment}, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, start_new_session=True,
    )  # fmt: skip
    deadline = time.monotonic() + 30
    while not (log.exists() and "Server is ready" in log.read_text(errors="replace")):
        if process.poll() is not None:
            raise AssertionError(
                f"nats-server refused deploy/nats.conf: {process.stderr and process.stderr.read()!r}"
            )
        assert time.monotonic() < deadline, "nats-server with deploy/nats.conf did not start"
        time.sleep(0.05)
    return process, port, monitor_port


@pytest.fixture(scope="module")
def role_nats(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RoleNats]:
    passwords = {role: f"{role}-{uuid.uuid4().hex}" for role in ROLES}
    environment = {password_variable(role): password for role, password in passwords.items()}
    process, port, monitor_port = start_deploy_nats(tmp_path_factory.mktemp("deploy-nats"), environment)
    try:
        yield RoleNats(port, monitor_port, passwords)
    finally:
        process.terminate()
        process.wait(timeout=30)


class Connected:
    """A connection as one role, recording the errors the server sends it (permission violations)."""

    def __init__(self, nc: NatsConnection, errors: list[str]) -> None:
        self.nc = nc
        self.errors = errors

    @classmethod
    async def open(cls, server: RoleNats, role: str) -> Connected:
        errors: list[str] = []

        async def on_error(error: Exception) -> None:
            errors.append(str(error))

        url = server.url(role)
        connection = await nats.connect(
            url, error_cb=on_error, allow_reconnect=False, inbox_prefix=nats_inbox_prefix(url)
        )
        return cls(connection, errors)

    async def refused(self, what: str, subject: str) -> bool:
        """Whether the server refused ``what`` ("publish" or "subscription") on ``subject`` (the refusal
        comes asynchronously; waited for under a generous bound)."""
        await self.nc.flush()
        expected = f'permissions violation for {what} to "{subject}"'
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if any(expected.lower() in error.lower() for error in self.errors):
                return True
            await asyncio.sleep(0.02)
        return False


@pytest.fixture
async def connect(role_nats: RoleNats) -> AsyncIterator[Callable[[str], Awaitable[Connected]]]:
    opened: list[Connected] = []

    async def open_role(role: str) -> Connected:
        opened.append(await Connected.open(role_nats, role))
        return opened[-1]

    yield open_role
    for connected in opened:
        await connected.nc.close()
