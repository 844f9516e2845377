"""The store contract (``tests/support/store_contract.py``) against both adapters of the store port."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from pipeline.log import EventStore, InMemoryStore
from tests.support.store_contract import StoreContract


class TestEventStore(StoreContract):
    """PostgreSQL: ``store`` is the conftest fixture (a migrated database of the test's own)."""

    @pytest.fixture
    async def small_store(self, database_url: str) -> AsyncIterator[EventStore]:
        store = await EventStore.connect(database_url, max_event_bytes=64 * 1024)
        yield store
        await store.close()


class TestInMemoryStore(StoreContract):
    @pytest.fixture
    async def store(self) -> AsyncIterator[InMemoryStore]:
        store = InMemoryStore()
        yield store
        await store.close()

    @pytest.fixture
    async def small_store(self) -> AsyncIterator[InMemoryStore]:
        store = InMemoryStore(max_event_bytes=64 * 1024)
        yield store
        await store.close()
