"""Fixtures of the integration tests that several modules share."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from pipeline.log import EventStore
from pipeline.ui import create_app
from tests.conftest import Servers, login_url
from tests.support.agent_gateway import gateway_process
from tests.support.ui_episodes import Browsing, record_episodes


@pytest.fixture
async def browsing(
    store: EventStore, database_url: str, logins: dict[str, tuple[str, str]]
) -> AsyncIterator[Browsing]:
    """The episode browser as the reader login, over the episodes of ``record_episodes`` (materialized)."""
    recorded = await record_episodes(store)
    app = create_app(login_url(database_url, logins["turnstile_reader"]))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://ui") as client:
        yield Browsing(client, recorded)
    await app.state.browser.close()


@pytest.fixture
async def sandbox_gateway(servers: Servers, database_url: str) -> AsyncIterator[str]:
    """A real ``turnstile serve gateway`` for the sandbox backends' tests: its ``host:port``, what
    ``SandboxSpec.gateway`` takes."""
    async with gateway_process(database_url, servers.nats_url, "sandbox", "admin-sandbox") as url:
        yield url.removeprefix("http://")


@pytest.fixture
def sandbox_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where a sandbox backend under test keeps its host directories."""
    return tmp_path_factory.mktemp("sandboxes")
