"""Logs per policy (TURNSTILE_DATABASE_URLS, docs/scale.md): one policy recorded on a PostgreSQL server of its
own, every other policy in the default database. The gateway routes each session's appends to its policy's
log and holds its lease on both; a runner records only in its policy's log; a materializer on each log makes
batches of that log's policy only. Real servers: the session's PostgreSQL, a second embedded one, NATS."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import nats
import openai
import psycopg
import pytest

from consumers.gateway import GatewayConfig, serve_gateway
from consumers.inference import InferenceConfig
from consumers.materializer import serve_materializer
from pipeline.dev.embedded import EmbeddedPostgres, scratch_dir
from pipeline.gateway import SharedSessions, create_gateway, serving_http
from pipeline.inference import NatsLLMClient
from pipeline.log import EventStore
from pipeline.log.db import migrate
from pipeline.materialize import MaterializerConfig
from pipeline.settings import Settings, libpq_url
from tests.conftest import Servers, with_database
from tests.support.backends import RuleBackend, echo_rule
from tests.support.processes import running
from tests.support.serving import serving
from tests.support.waiting import wait_until

ADMIN = "admin-" + uuid.uuid4().hex
TURNSTILE = [sys.executable, "-m", "consumers.cli"]


def rows(url: str, query: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(libpq_url(url)) as connection:
        return connection.execute(query).fetchall()  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def second_server() -> Iterator[tuple[str, str]]:
    """A PostgreSQL server of its own (the other policy's primary) and a migrated template database on it."""
    with scratch_dir("turnstile-test-policy-log-") as directory:
        server = EmbeddedPostgres(directory / "postgres")
        server.start()
        try:
            with psycopg.connect(server.url, autocommit=True) as admin:
                admin.execute('CREATE DATABASE "policy_log_template"')
            migrate(with_database(server.url, "policy_log_template"))
            yield server.url, "policy_log_template"
        finally:
            server.stop()


@pytest.fixture
def second_log(second_server: tuple[str, str]) -> Iterator[str]:
    """A freshly migrated database of this test's own on the second server."""
    url, template = second_server
    name = f"policy_log_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(url, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}" TEMPLATE "{template}"')
    yield with_database(url, name)
    with psycopg.connect(url, autocommit=True) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
async def policies(servers: Servers) -> AsyncIterator[tuple[str, str]]:
    """Two policies, each served by a scripted inference consumer: the first recorded in the default
    database, the second in a log of its own."""
    names = (f"shared{uuid.uuid4().hex[:8]}", f"apart{uuid.uuid4().hex[:8]}")
    configs = [InferenceConfig(servers.nats_url, name, backend="scripted") for name in names]
    async with serving(configs[0], RuleBackend(echo_rule)), serving(configs[1], RuleBackend(echo_rule)):
        yield names


async def one_session(admin: httpx.AsyncClient, policy: str) -> str:
    """A gateway session of ``policy`` with one call and a reward, ended ``done``: its id."""
    created = await admin.post("/admin/sessions", json={"policy": policy})
    assert created.status_code == 201, created.text
    session = created.json()
    async with openai.AsyncOpenAI(base_url=session["base_url"], api_key=session["api_key"]) as client:
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hello"}])
    headers = {"Authorization": f"Bearer {session['api_key']}"}
    async with httpx.AsyncClient(base_url=session["base_url"], headers=headers) as http:
        rewarded = await http.post("session/reward", json={"value": 1.0})
    assert rewarded.status_code == 200, rewarded.text
    ended = await admin.post(f"/admin/sessions/{session['session_id']}/end", json={})
    assert ended.status_code == 200, ended.text
    return str(session["session_id"])


async def materialize_until_batched(url: str) -> None:
    """The materializer service on the log at ``url`` until it has written a batch."""
    stop = asyncio.Event()
    config = MaterializerConfig(batch_samples=1, advantage="none")
    service = asyncio.create_task(serve_materializer(url, config, stop=stop))
    try:
        await wait_until(
            lambda: service.done() or rows(url, "SELECT count(*) FROM batches")[0][0] > 0, 60, "a batch"
        )
    finally:
        stop.set()
        await asyncio.wait_for(service, 60)


async def test_gateway_records_each_policy_in_its_own_log_and_each_log_is_batched_apart(
    servers: Servers, database_url: str, second_log: str, policies: tuple[str, str]
) -> None:
    shared, apart = policies
    # a third policy in the same log: the gateway opens one store and one lease there, not two
    mapping = f"{apart}={second_log} idle{uuid.uuid4().hex[:8]}={second_log}"
    settings = Settings(database_url=database_url, database_urls=mapping)
    config = GatewayConfig(
        settings.require_database_url(),
        servers.nats_url,
        admin_key=ADMIN,
        port=0,
        policy_database_urls=settings.policy_database_urls(),
    )
    stop = asyncio.Event()
    ready: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    service = asyncio.create_task(serve_gateway(config, stop=stop, ready=ready.set_result))
    try:
        url = await asyncio.wait_for(ready, 60)
        async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {ADMIN}"}) as admin:
            ids = {policy: await one_session(admin, policy) for policy in policies}
    finally:
        stop.set()
        await asyncio.wait_for(service, 60)

    logs = {shared: database_url, apart: second_log}
    for policy, log in logs.items():
        assert rows(log, "SELECT DISTINCT stream FROM events") == [(f"episode-{ids[policy]}",)]
        started = rows(
            log, "SELECT data->>'policy', metadata->>'runner' FROM events WHERE type = 'EpisodeStarted'"
        )
        assert [policy for policy, _ in started] == [policy]
        # the gateway's lease is in this log too: had it died, whoever starts next here closes its sessions
        [(_, runner)] = started
        assert rows(log, f"SELECT stopped_at IS NOT NULL FROM runners WHERE runner_id = '{runner}'") == [
            (True,)
        ]
    assert rows(database_url, "SELECT count(*) FROM events WHERE type = 'TurnCompleted'") == [(1,)]
    assert rows(second_log, "SELECT count(*) FROM events WHERE type = 'TurnCompleted'") == [(1,)]

    for policy, log in logs.items():  # a materializer per log, each given its log by its policy
        await materialize_until_batched(settings.require_database_url(policy))
        batched = rows(log, "SELECT b.policy, o.subject FROM batches b JOIN batch_outbox o USING (batch_id)")
        assert batched == [(policy, f"batches.{policy}")]
        # the browser's search index of each log holds that log's turn, indexed by its own materializer
        assert rows(log, "SELECT episode_id FROM turn_search") == [(ids[policy],)]


async def test_a_runner_records_only_in_its_policys_log(
    servers: Servers, database_url: str, second_log: str, policies: tuple[str, str], tmp_path: Path
) -> None:
    _, apart = policies
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"question": q, "answer": 0}) + "\n" for q in ("a?", "b?", "c?")))
    env = {k: v for k, v in os.environ.items() if not k.startswith("TURNSTILE_")}
    env |= {
        "TURNSTILE_DATABASE_URL": database_url,
        "TURNSTILE_DATABASE_URLS": f"{apart}={second_log}",
        "TURNSTILE_NATS_URL": servers.nats_url,
    }
    async with running(
        *TURNSTILE, "run", "--agent", "pipeline.examples.single_turn:SingleTurnAgent", "--tasks", str(tasks),
        "--policy", apart, env=env, stderr=asyncio.subprocess.PIPE,
    ) as process:  # fmt: skip
        _, stderr = await asyncio.wait_for(process.communicate(), 180)
        assert process.returncode == 0, stderr.decode()
    finished = rows(second_log, "SELECT data->>'termination' FROM events WHERE type = 'EpisodeFinished'")
    assert finished == [("done",)] * 3
    assert rows(second_log, "SELECT DISTINCT data->>'policy' FROM events WHERE type = 'EpisodeStarted'") == [
        (apart,)
    ]
    assert rows(database_url, "SELECT count(*) FROM events") == [(0,)]
    assert rows(database_url, "SELECT count(*) FROM runners") == [(0,)]  # not even its lease


async def test_replicas_sharing_sessions_serve_each_policys_sessions_from_its_own_log(
    servers: Servers, database_url: str, second_log: str, policies: tuple[str, str]
) -> None:
    """``--shared-sessions`` with ``TURNSTILE_DATABASE_URLS``: a session started on one replica and called
    on the other is taken up from its policy's log (the shared record names the policy), its turns recorded
    there; once ended, the other replica finds it ended in that log by its id alone."""
    shared, apart = policies
    bucket = f"GATEWAY_SESSIONS_{uuid.uuid4().hex[:8]}"
    connection = await nats.connect(servers.nats_url)
    default, own = await EventStore.connect(database_url), await EventStore.connect(second_log)
    llm = await NatsLLMClient.connect(servers.nats_url)
    admin_headers = {"Authorization": f"Bearer {ADMIN}"}
    try:
        apps = [
            create_gateway(
                default,
                llm,
                admin_key=ADMIN,
                shared=await SharedSessions.open(connection.jetstream(), bucket),
                policy_stores={apart: own},
            )
            for _ in range(3)
        ]
        async with (
            serving_http(apps[0]) as first,
            serving_http(apps[1]) as second,
            serving_http(apps[2]) as third,
            httpx.AsyncClient(base_url=first, headers=admin_headers) as admin_first,
            httpx.AsyncClient(base_url=second, headers=admin_headers) as admin_second,
            httpx.AsyncClient(base_url=third, headers=admin_headers) as admin_third,
        ):
            ids = {}
            for policy in policies:
                created = await admin_first.post("/admin/sessions", json={"policy": policy})
                assert created.status_code == 201, created.text
                session = created.json()
                ids[policy] = session["session_id"]
                messages = [{"role": "user", "content": "hello"}]
                for url in (first, second, second):  # the first call here, the others on the other replica
                    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=session["api_key"]) as client:
                        reply = await client.chat.completions.create(model="m", messages=messages)
                    messages += [reply.choices[0].message.model_dump(exclude_none=True)]
                    messages += [{"role": "user", "content": "and then?"}]
                ended = await admin_second.post(f"/admin/sessions/{session['session_id']}/end", json={})
                assert ended.status_code == 200, ended.text
            for policy in policies:  # a replica that never held it: found ended in the policy's log
                looked_up = await admin_third.get(f"/admin/sessions/{ids[policy]}")
                assert looked_up.status_code == 409, looked_up.text
                assert "ended" in looked_up.json()["error"]["message"]
        for policy, log in {shared: database_url, apart: second_log}.items():
            assert rows(log, "SELECT DISTINCT stream FROM events") == [(f"episode-{ids[policy]}",)]
            turns = rows(
                log, "SELECT data->>'parent_turn_id' IS NULL FROM events WHERE type = 'TurnCompleted'"
            )
            assert turns == [(True,), (False,), (False,)]  # one lineage across the replicas
            assert rows(log, "SELECT data->>'termination' FROM events WHERE type = 'EpisodeFinished'") == [
                ("done",)
            ]
    finally:
        await llm.close()
        await default.close()
        await own.close()
        with contextlib.suppress(Exception):
            await connection.jetstream().delete_key_value(bucket)
        await connection.close()
