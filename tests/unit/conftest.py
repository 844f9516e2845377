"""The unit tier runs without servers: a test here that asks for PostgreSQL or NATS fails at once, naming the
tier it belongs to."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def servers() -> None:
    pytest.fail("tests/unit uses no servers: a test that needs PostgreSQL or NATS goes in tests/integration")
