"""Fuzzing the gateway with schemathesis: every route of its OpenAPI document, with bodies that follow the
request schemas and bodies that break them. Every answer is a 2xx or a 4xx in the API's own error shape (never
a 5xx), and everything the gateway recorded reads back, folds and materializes without a skip."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.python import asgi

from pipeline.gateway import create_gateway
from pipeline.log import InMemoryStore
from pipeline.log.appends import encode_event
from pipeline.materialize.config import MaterializerConfig
from pipeline.materialize.fold import Fold
from pipeline.materialize.records import LogRow
from tests.support.backends import PrefixEcho

ADMIN = {"Authorization": "Bearer admin-key"}
STORE = InMemoryStore()
APP = create_gateway(STORE, PrefixEcho(), admin_key="admin-key", policy_default="main", idle_timeout=None)
SCHEMA = schemathesis.openapi.from_asgi("/openapi.json", APP)
_lock = threading.Lock()


def a_session_key() -> str:
    """A fresh open session's key (made through the app itself, like any client)."""
    with asgi.get_client(APP) as client:
        created = client.post(f"http://{asgi.HOST}/admin/sessions", json={}, headers=ADMIN)
    assert created.status_code == 201, created.text
    return str(created.json()["api_key"])


FOLD = Fold(MaterializerConfig(batch_samples=1))


def fold_what_was_recorded() -> int:
    """Read back every event recorded since the last call and fold it as the materializer would."""
    recorded = asyncio.run(STORE.read_all(FOLD.position, limit=1_000_000))
    for event in recorded:
        assert event.problem is None, event.problem
        assert event.event is not None
        encoded = encode_event(event.event)
        data = json.loads(encoded.data)
        FOLD.apply(LogRow(event.position, event.stream, event.type, data, encoded.tokens, event.recorded_at))
    assert FOLD.skipped == 0
    return len(recorded)


@SCHEMA.parametrize()
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_the_gateway_answers_anything_with_a_2xx_or_a_4xx_and_records_only_what_folds(case: Any) -> None:
    with _lock:
        if case.path.startswith("/admin"):
            headers = dict(ADMIN)
        elif case.path == "/health":
            headers = {}
        else:
            headers = {"Authorization": f"Bearer {a_session_key()}"}
        response = case.call(headers=headers)
        fold_what_was_recorded()
    assert response.status_code < 500, (case.method, case.path, case.body, response.text)
    if response.status_code >= 400:
        body = response.json()
        if case.path in ("/v1/messages", "/v1/messages/count_tokens"):
            assert body["type"] == "error"
        elif case.path == "/v1/responses":
            assert body["error"]["type"] in ("invalid_request_error", "server_error")
        assert body["error"]["message"]
