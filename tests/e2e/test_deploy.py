"""docker-compose.yml and the role rules it deploys, checked without Docker.

- The compose file: every service's command parses with the real CLI (``deploy/check_compose.py``).
- NATS: a nats-server started from ``deploy/nats.conf`` itself (its users and permissions), driven with each
  role's credentials: what a role may do works, what it may not is refused by the server.
- PostgreSQL: the group roles of migration 0006, each through a login user that is a member of it (as
  deploy/postgres-init.sql makes the compose users; no ``SET ROLE``): ``events`` is append-only for all.
- The whole compose file run as local processes (slow): its services, commands, environments, credentials,
  init script and healthchecks, until the closed loop publishes a policy version that inference serves.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import nats
import nats.errors
import nats.js.errors
import psycopg
import pytest

from consumers.inference import InferenceConfig
from pipeline.batches.relay import (
    BATCHES_STREAM,
    OBJECT_HEADER,
    OutboxRelay,
    batch_subject,
    ensure_batches_stream,
    read_batch_message,
)
from pipeline.dev.embedded import EmbeddedPostgres, free_port
from pipeline.gateway.shared import BUCKET, SharedRecord, SharedSessions
from pipeline.inference.client import NatsLLMClient
from pipeline.log import EventStore
from pipeline.log.db import create_engine
from pipeline.log.store import APPEND_LOCK
from pipeline.runners.taskqueue import ensure_tasks_stream
from pipeline.settings import jetstream, libpq_url
from pipeline.versions import ensure_versions_stream
from schemas import ChatMessage, LLMRequest, PolicyVersionPublished
from tests.conftest import login_url
from tests.integration.test_relay import insert_batch
from tests.support.backends import RuleBackend, echo_rule
from tests.support.load_balancer import SERVER, haproxy_binary, localized_config
from tests.support.roles import Connected, RoleNats, start_deploy_nats
from tests.support.serving import serving
from tests.support.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"deploy_{name}", DEPLOY / f"{name}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


check_compose = _load("check_compose")


# -- the compose file ------------------------------------------------------------------------------------


def test_every_compose_command_parses_with_the_turnstile_cli() -> None:
    compose = check_compose.load_compose(env={})  # the defaults, as a bare `docker compose up` has them
    assert check_compose.problems(compose) == []
    commands = {
        name: args
        for name, service in compose["services"].items()
        for args in check_compose.turnstile_invocations(service)
    }
    assert set(commands) == {
        "migrate", "model", "inference", "inference-gpu", "materializer", "relay", "trainer", "gateway-1",
        "gateway-2", "runner", "submit", "ui",
    }  # fmt: skip
    assert commands["model"] == ["model", "init-tiny", "/models/.tiny-build"]
    for args in {tuple(args[: 2 if args[0] in ("serve", "model") else 1]) for args in commands.values()}:
        shown = subprocess.run(
            [sys.executable, "-m", "consumers.cli", *args, "--help"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert shown.returncode == 0, f"turnstile {' '.join(args)} --help: {shown.stderr[-2000:]}"


def test_the_compose_check_finds_what_is_wrong() -> None:
    compose = check_compose.load_compose(env={"TURNSTILE_POLICY": "other"})
    services = compose["services"]
    assert "other" in services["runner"]["command"]  # interpolated: --policy ${TURNSTILE_POLICY:-demo}
    services["runner"]["command"] = [a.replace("--agent", "--agnet") for a in services["runner"]["command"]]
    services["trainer"]["command"] = ["serve", "trainer", "--policy", "p"]
    services["relay"]["environment"]["TURNSTILE_NATS_URL"] = "nats://stranger:pw@nats:4222"
    services["gateway-1"]["environment"]["TURNSTILE_DATABASE_URL"] = (
        "postgresql://stranger:pw@postgres/turnstile"
    )
    services["materializer"]["depends_on"] = {"migrations": {"condition": "service_completed_successfully"}}
    del services["nats"]["environment"]["TURNSTILE_TRAINER_PASSWORD"]
    found = "\n".join(check_compose.problems(compose))
    assert "service runner: `turnstile serve runner`: No such option: --agnet" in found
    assert "service trainer: `turnstile serve trainer`: Missing option '--model'" in found
    assert "service relay: NATS user 'stranger' is not in deploy/nats.conf" in found
    assert "service gateway-1: PostgreSQL user 'stranger' is not made by deploy/postgres-init.sql" in found
    assert "service materializer: depends on 'migrations', which is no service" in found
    assert "service nats: nats.conf reads TURNSTILE_TRAINER_PASSWORD" in found
    with pytest.raises(check_compose.ComposeError, match="TURNSTILE_X is required: say so"):
        check_compose.interpolate("${TURNSTILE_X:?say so}", {})
    assert check_compose.interpolate("$$a ${B:-b} ${C-c} ${D:-d}", {"C": "", "D": ""}) == "$a b  d"


# -- NATS: deploy/nats.conf's users and permissions --------------------------------------------------------


def new_policy() -> str:
    return f"deploy{uuid.uuid4().hex[:10]}"


async def test_wrong_or_missing_credentials_are_refused(role_nats: RoleNats) -> None:
    with pytest.raises(nats.errors.Error, match=r"[Aa]uthorization"):
        await nats.connect(
            f"nats://runner:wrong@127.0.0.1:{role_nats.port}", allow_reconnect=False, max_reconnect_attempts=0
        )
    with pytest.raises(nats.errors.Error, match=r"[Aa]uthorization"):
        await nats.connect(
            f"nats://127.0.0.1:{role_nats.port}", allow_reconnect=False, max_reconnect_attempts=0
        )


async def test_a_runner_cannot_publish_batches_nor_pose_as_an_inference_consumer(
    connect: Callable[[str], Awaitable[Connected]],
) -> None:
    policy = new_policy()
    admin, runner = await connect("admin"), await connect("runner")
    await ensure_batches_stream(admin.nc)

    await runner.nc.publish(batch_subject(policy), b"forged")
    assert await runner.refused("publish", batch_subject(policy))
    with pytest.raises((nats.errors.TimeoutError, nats.errors.NoRespondersError)):
        await jetstream(runner.nc).publish(batch_subject(policy), b"forged", timeout=1.0)
    info = await jetstream(admin.nc).stream_info(BATCHES_STREAM, subjects_filter=batch_subject(policy))
    assert not (info.state.subjects or {}).get(batch_subject(policy))  # nothing stored

    await runner.nc.subscribe(f"llm.{policy}.requests", queue="inference")
    assert await runner.refused("subscription", f"llm.{policy}.requests")
    await runner.nc.publish(f"policy.{policy}.versions", b"{}")
    assert await runner.refused("publish", f"policy.{policy}.versions")


async def test_runners_use_the_task_queue_and_the_gateway_only_sends_requests(
    connect: Callable[[str], Awaitable[Connected]],
) -> None:
    policy = new_policy()
    runner, gateway = await connect("runner"), await connect("gateway")
    await ensure_tasks_stream(runner.nc)
    js = jetstream(runner.nc)
    ack = await js.publish(f"tasks.{policy}", b'{"x": 1}', timeout=5.0)
    assert ack.stream == "TASKS"
    subscription = await js.pull_subscribe(f"tasks.{policy}", durable=f"runners-{policy}", stream="TASKS")
    [message] = await subscription.fetch(1, timeout=5.0)
    await message.in_progress()
    await message.ack_sync(timeout=5.0)
    assert runner.errors == []

    await gateway.nc.publish(f"tasks.{policy}", b"{}")
    assert await gateway.refused("publish", f"tasks.{policy}")


async def test_only_the_gateway_reaches_the_bucket_its_replicas_share(
    connect: Callable[[str], Awaitable[Connected]],
) -> None:
    gateway = await connect("gateway")
    shared = await SharedSessions.open(jetstream(gateway.nc))  # made by the first gateway, with its login
    record = SharedRecord(f"deploy-{uuid.uuid4().hex}", uuid.uuid4().hex * 2, max_turns=3)
    await shared.add(record)
    assert await shared.get(record.digest) == record
    assert record.session_id in {found.session_id for found in await shared.open_sessions()}
    await shared.end(record, "done")
    assert (await shared.get(record.digest) or record).ended == "done"
    assert await shared.open_session(record.session_id) is None
    assert gateway.errors == []

    for role in ("runner", "relay", "trainer", "inference"):
        other = await connect(role)
        with pytest.raises((nats.errors.TimeoutError, nats.errors.NoRespondersError, nats.js.errors.Error)):
            await SharedSessions.open(jetstream(other.nc, timeout=1.0))
        await other.nc.publish(f"$KV.{BUCKET}.key.{record.digest}", b"{}")
        assert await other.refused("publish", f"$KV.{BUCKET}.key.{record.digest}")
    assert (await shared.get(record.digest) or record).ended == "done"  # nothing forged


async def test_a_runner_request_is_answered_by_an_inference_consumer_with_heartbeats(
    connect: Callable[[str], Awaitable[Connected]], role_nats: RoleNats
) -> None:
    policy = new_policy()
    inference = await connect("inference")
    config = InferenceConfig(
        role_nats.url("inference"), policy, backend="scripted", consumer_id="c1", heartbeat_interval=0.2
    )
    slow = RuleBackend(echo_rule, delay=1.5)  # heartbeats to the caller's inbox, then the reply
    async with serving(config, slow):
        for role in ("runner", "gateway"):
            llm = await NatsLLMClient.connect(
                role_nats.url(role), heartbeat_timeout=1.0, timeout=30, wait_for_consumer=5.0
            )
            try:
                first = await llm(
                    LLMRequest(
                        policy=policy,
                        episode_id=f"e-{role}",
                        messages=[ChatMessage(role="user", content="hi")],
                    )
                )
                again = await llm(
                    LLMRequest(
                        policy=policy,
                        episode_id=f"e-{role}",
                        messages=[ChatMessage(role="user", content="hi")],
                    )
                )
            finally:
                await llm.close()
            assert first.text == "reply 1"
            assert again.consumer_id == "c1"  # the sticky subject llm.<policy>.requests.<consumer> works too
    assert slow.requests_seen == 4

    # An inference consumer only replies (it publishes nowhere else) and serves in its queue group only.
    await inference.nc.publish(batch_subject(policy), b"x")
    assert await inference.refused("publish", batch_subject(policy))
    await inference.nc.publish(f"llm.{policy}.requests", b"x")
    assert await inference.refused("publish", f"llm.{policy}.requests")
    await inference.nc.subscribe(f"llm.{policy}.requests")
    assert await inference.refused("subscription", f"llm.{policy}.requests")


async def test_the_relay_publishes_batches_and_the_trainer_reads_them_and_publishes_versions(
    connect: Callable[[str], Awaitable[Connected]],
    role_nats: RoleNats,
    database_url: str,
    logins: dict[str, tuple[str, str]],
) -> None:
    policy = new_policy()
    relay, trainer = await connect("relay"), await connect("trainer")
    engine = create_engine(database_url, pool_size=2)
    try:
        outbox = OutboxRelay(engine, relay.nc)
        await insert_batch(database_url, f"small-{policy}", policy, b"small")
        await insert_batch(database_url, f"large-{policy}", policy, b"L" * (outbox.inline_limit + 1))
        assert await outbox.publish_pending() == 2  # the large one through the object store
    finally:
        await engine.dispose()
    assert relay.errors == []
    await relay.nc.publish(f"tasks.{policy}", b"{}")
    assert await relay.refused("publish", f"tasks.{policy}")

    await ensure_batches_stream(trainer.nc)
    subscription = await jetstream(trainer.nc).pull_subscribe(
        batch_subject(policy), durable=f"trainer-{policy}", stream=BATCHES_STREAM
    )
    messages = await subscription.fetch(2, timeout=5.0)
    assert [await read_batch_message(trainer.nc, m) for m in messages] == [
        b"small",
        b"L" * (outbox.inline_limit + 1),
    ]
    assert OBJECT_HEADER in messages[1].headers
    for message in messages:
        await message.ack_sync(timeout=5.0)

    # As publish_policy_version does it, each with its role's own login: the log first (the trainer's
    # PostgreSQL login), then the stream and the publish it keeps.
    store = await EventStore.connect(login_url(database_url, logins["turnstile_trainer"]))

    async def publish_version(number: int) -> None:
        version = PolicyVersionPublished(
            policy=policy, version=number, checkpoint=f"/checkpoints/v{number:06}"
        )
        await store.append(f"policy-{policy}", [version])
        await trainer.nc.publish(f"policy.{policy}.versions", version.model_dump_json().encode())
        await trainer.nc.flush()

    try:
        assert await ensure_versions_stream(trainer.nc)
        await publish_version(1)  # before any inference consumer runs: nobody hears it live
        backend = RuleBackend(echo_rule)
        config = InferenceConfig(
            role_nats.url("inference"), policy, backend="scripted", consumer_id="c2",
            database_url=login_url(database_url, logins["turnstile_inference"]),
        )  # fmt: skip
        async with serving(config, backend):
            assert backend.policy_version == 1  # loaded from the log at start, before serving a request
            await publish_version(2)
            await wait_until(lambda: backend.policy_version == 2, 30, "the consumer to load version 2")
    finally:
        await store.close()
    assert trainer.errors == []

    await trainer.nc.publish(f"tasks.{policy}", b"{}")
    assert await trainer.refused("publish", f"tasks.{policy}")
    await trainer.nc.publish(batch_subject(policy), b"x")
    assert await trainer.refused("publish", batch_subject(policy))
    await trainer.nc.publish(f"llm.{policy}.requests", b"x")
    assert await trainer.refused("publish", f"llm.{policy}.requests")


# -- PostgreSQL: the group roles of migration 0006, each used by a login of its own ------------------------

EVENT = (
    "INSERT INTO events (position, stream, version, event_id, type, data, content_hash) "
    "VALUES (1, 'episode-x', 1, gen_random_uuid(), 'EpisodeStarted', '{\"episode_id\": \"x\"}', '\\x00')"
)
REFUSED = psycopg.errors.InsufficientPrivilege
LOCK = f"SELECT pg_advisory_xact_lock({APPEND_LOCK})"  # appends hold it (migration 0007 checks)


@pytest.fixture
def as_role(database_url: str, logins: dict[str, tuple[str, str]]) -> Callable[..., None]:
    def run(role: str, *statements: str) -> None:
        """Log in as the user of group role ``role`` (no SET ROLE), run the statements in one transaction
        and commit."""
        user = logins[role][0]
        with psycopg.connect(login_url(database_url, logins[role])) as connection:
            assert connection.execute("SELECT current_user, session_user").fetchone() == (user, user)
            for statement in statements:
                connection.execute(statement)

    return run


def test_events_are_append_only_for_the_writer_role(database_url: str, as_role: Callable[..., None]) -> None:
    with pytest.raises(REFUSED, match="only while holding the append lock"):
        as_role("turnstile_writer", EVENT)
    as_role("turnstile_writer", LOCK, EVENT)
    for statement in ("UPDATE events SET type = 'x'", "DELETE FROM events", "TRUNCATE events"):
        with pytest.raises(REFUSED):
            as_role("turnstile_writer", statement)
    as_role("turnstile_writer", "INSERT INTO runners (runner_id, host, pid) VALUES ('r', 'h', 1)")
    as_role("turnstile_writer", "UPDATE runners SET heartbeat_at = now() WHERE runner_id = 'r'")
    as_role(
        "turnstile_writer",
        "INSERT INTO trained_batches (trainer, batch_id, policy, policy_version, outcome) "
        "VALUES ('t', 'b', 'p', 1, 'trained')",
    )
    with pytest.raises(REFUSED):  # read models are the materializer's
        as_role("turnstile_writer", "DELETE FROM episodes")
    with psycopg.connect(libpq_url(database_url)) as connection:
        assert connection.execute("SELECT count(*) FROM events").fetchone() == (1,)


def test_the_materializer_role_writes_read_models_and_cannot_touch_the_log(
    as_role: Callable[..., None],
) -> None:
    as_role("turnstile_materializer", "INSERT INTO checkpoints (name, position) VALUES ('m', 0)")
    as_role("turnstile_materializer", "UPDATE checkpoints SET position = 1 WHERE name = 'm'")
    as_role("turnstile_materializer", "SELECT * FROM batch_outbox FOR UPDATE SKIP LOCKED")
    for statement in (EVENT, "UPDATE events SET type = 'x'", "DELETE FROM events", "TRUNCATE events"):
        with pytest.raises(REFUSED):
            as_role("turnstile_materializer", LOCK, statement)


def test_the_sql_role_only_reads(as_role: Callable[..., None]) -> None:
    as_role("turnstile_writer", LOCK, EVENT)
    as_role("turnstile_reader", "SELECT * FROM events")
    for statement in ("DELETE FROM events", "DELETE FROM episodes", EVENT.replace("(1,", "(2,")):
        with pytest.raises(REFUSED):
            as_role("turnstile_reader", statement)


def test_every_role_reads_every_table_and_view(database_url: str) -> None:
    with psycopg.connect(libpq_url(database_url)) as connection:
        unreadable = connection.execute(
            "SELECT r.role, c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace, "
            "unnest(ARRAY['turnstile_writer', 'turnstile_materializer', 'turnstile_reader']) AS r(role) "
            "WHERE n.nspname = 'public' AND c.relkind IN ('r', 'v') AND c.relname <> 'alembic_version' "
            "AND NOT has_table_privilege(r.role, c.oid, 'SELECT')"
        ).fetchall()
    assert unreadable == []


# -- the compose file, run as local processes ---------------------------------------------------------------


class LocalCompose:
    """docker-compose.yml's services as processes on this machine, in the order its depends_on conditions
    allow, with its commands, environments and healthchecks. What Docker would do is emulated only where it
    must be: hosts and published ports become loopback ports, volumes become directories (at the same place
    for every service that mounts them), the image's /app/deploy is this repository's deploy/, and the
    nats and postgres images are a nats-server on deploy/nats.conf and a PostgreSQL initialised as the
    postgres image does (its POSTGRES_USER and POSTGRES_DB, then its init script)."""

    IMAGE_PATHS = {"/app/deploy": DEPLOY}

    def __init__(self, compose: dict[str, Any], directory: Path) -> None:
        self.services: dict[str, dict[str, Any]] = {
            name: service for name, service in compose["services"].items() if not service.get("profiles")
        }
        self.directory = directory
        self.hosts: dict[str, str] = {}
        self.ports: dict[int, int] = {}  # published container port -> its port here
        self.own_ports: dict[str, dict[int, int]] = {}  # each service's container ports -> ports here
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self.healthy: set[str] = set()
        self.servers: list[EmbeddedPostgres] = []
        self.metrics_ports: dict[str, int] = {}  # each service's --metrics-port: a free one here

    # -- mapping container paths, hosts and ports to this machine

    def paths(self, service: dict[str, Any]) -> dict[str, Path]:
        found = dict(self.IMAGE_PATHS)
        for mount in service.get("volumes") or []:
            source, target = str(mount).split(":")[:2]
            found[target] = (ROOT / source) if source.startswith(".") else self.directory / "volumes" / source
            found[target].parent.mkdir(parents=True, exist_ok=True)
            if not source.startswith("."):
                found[target].mkdir(exist_ok=True)
        return found

    def localize(self, text: str, service: dict[str, Any], name: str | None = None) -> str:
        """``text`` with container paths, hosts and ports as they are here (``name``: the service's own
        ports first, for what it says of 127.0.0.1 inside its container)."""
        for target, source in sorted(self.paths(service).items(), key=lambda item: -len(item[0])):
            # a container path where a path begins: an argument, or a word of a shell script
            text = re.sub(rf"(?<!\S){re.escape(target)}(?=/|\s|;|$)", str(source), text)
        for host, address in self.hosts.items():
            text = text.replace(host, address)
        for container_port, port in {**self.ports, **self.own_ports.get(name or "", {})}.items():
            text = text.replace(f"127.0.0.1:{container_port}", f"127.0.0.1:{port}")
        return text

    def environment(self, service: dict[str, Any]) -> dict[str, str]:
        env = {key: value for key, value in os.environ.items() if not key.startswith("TURNSTILE_")}
        env.update(HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")  # the image's ENV
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        for key, value in check_compose.service_environment(service).items():
            env[key] = self.localize(value, service)
        return env

    def listen(self, name: str, container_port: int) -> int:
        """A free port here for ``name``'s ``container_port``: its host name (``<service>:<port>``) maps to
        it, and so does the port it publishes, if it does."""
        port = free_port()
        self.hosts[f"{name}:{container_port}"] = f"127.0.0.1:{port}"
        self.own_ports.setdefault(name, {})[container_port] = port
        if any(
            str(mapping).endswith(f":{container_port}") for mapping in self.services[name].get("ports") or []
        ):
            self.ports[container_port] = port
        return port

    def argv(self, name: str, service: dict[str, Any]) -> list[str]:
        entrypoint = [self.localize(a, service) for a in check_compose.as_list(service.get("entrypoint"))]
        command = [self.localize(a, service) for a in check_compose.as_list(service.get("command"))]
        if "--port" in command:  # a port of its own here
            at = command.index("--port") + 1
            command[at] = str(self.listen(name, int(command[at])))
        return (
            entrypoint + command if entrypoint else [str(Path(sys.executable).parent / "turnstile"), *command]
        )

    # -- the servers

    def start_postgres(self) -> None:
        service = self.services["postgres"]
        env = check_compose.service_environment(service)
        postgres = EmbeddedPostgres(self.directory / "postgres")
        postgres.start()
        self.servers.append(postgres)
        owner, database = env["POSTGRES_USER"], env["POSTGRES_DB"]
        with psycopg.connect(postgres.url, autocommit=True) as admin:
            admin.execute(f'CREATE ROLE "{owner}" SUPERUSER LOGIN')
            admin.execute(f'CREATE DATABASE "{database}" OWNER "{owner}"')
        mounts = {target: source for target, source in self.paths(service).items()}
        [init] = [
            source for target, source in mounts.items() if target.startswith("/docker-entrypoint-initdb.d/")
        ]
        script_env = {**os.environ, **env, "PGHOST": "127.0.0.1", "PGPORT": str(postgres.port)}
        script_env["PATH"] = f"{postgres.bin_dir()}{os.pathsep}{script_env['PATH']}"
        script_env["TURNSTILE_POSTGRES_INIT_SQL"] = str(mounts["/etc/turnstile/postgres-init.sql"])
        done = subprocess.run(["bash", str(init)], env=script_env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, f"{init.name}: {done.stdout}{done.stderr}"
        self.hosts["@postgres:5432/"] = f"@127.0.0.1:{postgres.port}/"
        self.healthy.add("postgres")

    def start_nats(self) -> None:
        environment = check_compose.service_environment(self.services["nats"])
        process, port, monitor_port = start_deploy_nats(self.directory / "nats", environment)
        self.processes["nats"] = process
        self.hosts["@nats:4222"] = f"@127.0.0.1:{port}"
        self.hosts["http://nats:8222"] = f"http://127.0.0.1:{monitor_port}"
        self.healthy.add("nats")

    # -- the services

    def ready(self, name: str) -> bool:
        for dependency, condition in (self.services[name].get("depends_on") or {}).items():
            wanted = (condition or {}).get("condition", "service_started")
            process = self.processes.get(dependency)
            if wanted == "service_completed_successfully" and (process is None or process.poll() != 0):
                return False
            if wanted == "service_healthy" and dependency not in self.healthy:
                return False
            if process is None and dependency not in self.healthy:
                return False
        return True

    def start(self, name: str) -> None:
        service = self.services[name]
        if str(service.get("image", "")).startswith("haproxy:"):
            self.start_haproxy(name)
            return
        argv = self.argv(name, service)
        if "--metrics-port" in argv:  # 9100 in every container: a port of its own for each here
            self.metrics_ports[name] = free_port()
            argv[argv.index("--metrics-port") + 1] = str(self.metrics_ports[name])
        log = (self.directory / "logs" / f"{name}.log").open("ab")
        self.processes[name] = subprocess.Popen(
            argv, env=self.environment(service), stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, cwd=self.directory, start_new_session=True,
        )  # fmt: skip

    def start_haproxy(self, name: str) -> None:
        """The balancer: Debian's haproxy on the mounted deploy/haproxy.cfg, its servers' host names mapped
        to the ports their services listen on here."""
        [config] = [
            source for target, source in self.paths(self.services[name]).items() if "haproxy" in target
        ]
        servers = [self.hosts[found[1]] for found in SERVER.findall(config.read_text())]
        local = self.directory / "haproxy.cfg"
        local.write_text(localized_config(servers, self.listen(name, 8000)))
        log = (self.directory / "logs" / f"{name}.log").open("ab")
        self.processes[name] = subprocess.Popen(
            [haproxy_binary(), "-f", str(local), "-db"], stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, cwd=self.directory, start_new_session=True,
        )  # fmt: skip

    def check_health(self, name: str) -> None:
        service = self.services[name]
        test = check_compose.as_list((service.get("healthcheck") or {}).get("test"))
        if not test:
            self.healthy.add(name)
            return
        assert test[0] == "CMD", f"{name}: healthcheck {test}"
        argv = [sys.executable if a == "python" else self.localize(a, service, name) for a in test[1:]]
        done = subprocess.run(argv, env=self.environment(service), capture_output=True, text=True, timeout=30)
        if done.returncode == 0:
            self.healthy.add(name)

    def log(self, name: str) -> str:
        path = self.directory / "logs" / f"{name}.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""

    def step(self) -> None:
        """Start what may start, check health, and fail on a service that exited when it should not."""
        for name, service in self.services.items():
            if name in ("nats", "postgres"):
                continue
            process = self.processes.get(name)
            if process is None:
                if self.ready(name):
                    self.start(name)
                continue
            code = process.poll()
            one_shot = service.get("restart") == "no"
            assert code is None or (one_shot and code == 0), f"{name} exited with {code}:\n{self.log(name)}"
            if code is None and name not in self.healthy:
                self.check_health(name)

    def stop(self) -> None:
        for name in reversed(list(self.processes)):
            if self.processes[name].poll() is None:
                self.processes[name].terminate()
        for process in self.processes.values():
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for server in self.servers:
            server.stop()


def scrape_metrics(port: int) -> dict[str, float]:
    """A service's /metrics as {sample name with its labels: value} (prometheus-client's parser)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{key}={value}" for key, value in sorted(sample.labels.items()))
            found[f"{sample.name}{{{labels}}}" if labels else sample.name] = float(sample.value)
    return found


def metric_names(port: int) -> set[str]:
    """The names of every sample a service's /metrics declares, with or without samples yet."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        families = list(text_string_to_metric_families(response.read().decode()))
    suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"]}
    return {family.name + suffix for family in families for suffix in ["", *suffixes.get(family.type, [])]}


# What each service's metrics must show once the loop has run: (sample, at least).
METRICS_MOVED = {
    "inference": [("turnstile_inference_requests_total", 1),
                  ("turnstile_inference_policy_version{policy=demo}", 1),
                  ("turnstile_inference_latency_seconds_count{stage=total}", 1),
                  ("turnstile_inference_tokens_total{kind=completion}", 1)],
    "materializer": [("turnstile_materializer_position", 1), ("turnstile_materializer_batches", 1)],
    "relay": [("turnstile_relay_published_total", 1)],
    "trainer": [("turnstile_trainer_batches_trained_total{policy=demo}", 1),
                ("turnstile_trainer_policy_version{policy=demo}", 1),
                ("turnstile_trainer_batch_samples_count{policy=demo}", 1)],
    "runner": [("turnstile_runner_turns_total", 1), ("turnstile_runner_episodes_total{outcome=done}", 1)],
    # round-robin: each replica holds the session (started on one, a call on the other)
    "gateway-1": [("turnstile_gateway_open_sessions", 1)],
    "gateway-2": [("turnstile_gateway_open_sessions", 1)],
}  # fmt: skip


def _scalar(url: str, query: str) -> Any:
    with psycopg.connect(libpq_url(url)) as connection:
        row = connection.execute(query).fetchone()
    return row[0] if row else None


@pytest.mark.slow
def test_the_compose_services_close_the_loop_with_their_own_credentials(server_dir: Path) -> None:
    compose = check_compose.load_compose(env={})
    local = LocalCompose(compose, server_dir)
    (server_dir / "logs").mkdir()
    try:
        local.start_postgres()
        local.start_nats()
        owner_url = local.localize(
            local.services["migrate"]["environment"]["TURNSTILE_DATABASE_URL"], local.services["migrate"]
        )
        deadline = time.monotonic() + 420
        version, served = 0, 0
        while time.monotonic() < deadline:
            local.step()
            if "migrate" in local.processes and local.processes["migrate"].poll() == 0:
                newest = "SELECT coalesce(max((data->>'{}')::int), 0) FROM events WHERE type = '{}'"
                version = _scalar(owner_url, newest.format("version", "PolicyVersionPublished"))
                served = _scalar(owner_url, newest.format("policy_version", "TurnCompleted"))
            if served >= 1 and local.healthy >= set(local.services) - {"migrate", "model", "submit"}:
                break
            time.sleep(0.5)
        logs = {name: local.log(name)[-1500:] for name in local.processes if name not in ("nats",)}
        assert version >= 1, f"no policy version published; logs:\n{json.dumps(logs, indent=1)}"
        assert served >= 1, (
            f"inference never answered with a trained version; logs:\n{json.dumps(logs, indent=1)}"
        )
        assert local.healthy >= set(local.services) - {"migrate", "model", "submit"}, local.healthy

        # The healthchecks are no formality: a subject nobody serves, or a user not connected, is unhealthy.
        inference = local.services["inference"]
        for check in (["nats-subscribed", "llm.nobody.requests", "inference"], ["nats-connected"]):
            env = local.environment(inference)
            if check == ["nats-connected"]:
                env["TURNSTILE_NATS_URL"] = env["TURNSTILE_NATS_URL"].replace("inference:", "admin:")
            done = subprocess.run(
                [sys.executable, str(DEPLOY / "healthcheck.py"), *check],
                env=env,
                capture_output=True,
                text=True,
            )
            assert done.returncode == 1, (check, done.stderr)
            assert "no NATS connection from this container" in done.stderr

        # Every service is connected as its own database user.
        writers = _scalar(
            owner_url, "SELECT string_agg(DISTINCT usename, ',' ORDER BY usename) FROM pg_stat_activity"
        )
        assert {"runner", "gateway", "trainer", "materializer", "relay"} <= set(writers.split(","))

        # The gateway replicas (behind the balancer's published port, admin key) record a session's turn as
        # the gateway user.
        import httpx

        gateway = local.services["gateway-1"]
        base = f"http://127.0.0.1:{local.ports[8000]}"
        key = gateway["environment"]["TURNSTILE_ADMIN_KEY"]
        created = httpx.post(
            f"{base}/admin/sessions",
            headers={"Authorization": f"Bearer {key}"},
            json={"task": {"q": 1}},
            timeout=30,
        )
        assert created.status_code == 201, created.text
        session = created.json()
        reply = httpx.post(
            f"{base}/v1/chat/completions",
            headers={"Authorization": f"Bearer {session['api_key']}"},
            json={
                "model": "demo",
                "messages": [{"role": "user", "content": "Reply with digits only."}],
                "max_tokens": 4,
            },
            timeout=60,
        )
        assert reply.status_code == 200, reply.text

        # Every service serves its metrics; counters moved while the loop ran, and move on with more work.
        # (Lags and counts read from the database are refreshed every 5 s: wait for the first refresh.)
        def short_of(found: dict[str, dict[str, float]]) -> list[tuple[str, str, float | None]]:
            return [
                (name, sample, found[name].get(sample))
                for name, wanted in METRICS_MOVED.items()
                for sample, least in [
                    *wanted,
                    ("turnstile_service_healthy", 1),
                    ("process_resident_memory_bytes", 1),
                ]
                if found[name].get(sample, 0) < least
            ]

        deadline = time.monotonic() + 60
        while True:
            before = {name: scrape_metrics(port) for name, port in local.metrics_ports.items()}
            assert set(before) == set(METRICS_MOVED), before.keys()
            if not short_of(before) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert short_of(before) == []
        requests = before["inference"]["turnstile_inference_requests_total"]
        again = httpx.post(
            f"{base}/v1/chat/completions",
            headers={"Authorization": f"Bearer {session['api_key']}"},
            json={"model": "demo", "messages": [{"role": "user", "content": "Once more."}], "max_tokens": 4},
            timeout=60,
        )
        assert again.status_code == 200, again.text
        after = scrape_metrics(local.metrics_ports["inference"])
        assert after["turnstile_inference_requests_total"] > requests
        # The provisioned dashboard asks only for metrics that the services serve (declare: a labelled counter
        # such as the gateway's errors has no sample before its first error).
        served = {name for port in local.metrics_ports.values() for name in metric_names(port)}
        dashboard = json.loads((DEPLOY / "grafana" / "dashboards" / "turnstile.json").read_text())
        asked = {
            name
            for panel in dashboard["panels"]
            for target in panel["targets"]
            for name in re.findall(r"\b(?:turnstile|process)_\w+", target["expr"])
        }
        assert asked
        assert asked <= served, asked - served

        # turnstile sql as the analyst (read-only role), and the analyst cannot delete.
        analyst = owner_url.replace(
            f"turnstile:{compose['services']['postgres']['environment']['POSTGRES_PASSWORD']}@",
            f"analyst:{compose['services']['postgres']['environment']['TURNSTILE_ANALYST_PASSWORD']}@",
        )
        shown = subprocess.run(
            [sys.executable, "-m", "consumers.cli", "sql", "SELECT count(*) AS n FROM episodes", "--json"],
            env={**os.environ, "TURNSTILE_DATABASE_URL": analyst}, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert shown.returncode == 0, shown.stderr
        assert json.loads(shown.stdout)[0]["n"] > 0
        with pytest.raises(REFUSED), psycopg.connect(libpq_url(analyst)) as connection:
            connection.execute("DELETE FROM events")
    finally:
        local.stop()


def test_prometheus_scrapes_every_service_that_serves_metrics_and_grafana_is_provisioned() -> None:
    import yaml

    compose = check_compose.load_compose(env={})
    serving_metrics = {
        name: args[args.index("--metrics-port") + 1]
        for name, service in compose["services"].items()
        for args in check_compose.turnstile_invocations(service)
        if "--metrics-port" in args
    }
    assert set(serving_metrics) == {
        "inference", "inference-gpu", "materializer", "relay", "trainer", "gateway-1", "gateway-2", "runner"
    }  # fmt: skip
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    scraped = {
        name: str(sd["port"])
        for job in config["scrape_configs"]
        for sd in job["dns_sd_configs"]
        for name in sd["names"]
    }
    assert scraped == serving_metrics
    for name in ("prometheus", "grafana"):
        assert compose["services"][name]["profiles"] == ["observability"]
    mounts = [str(m).split(":")[0] for m in compose["services"]["grafana"]["volumes"]]
    assert "./deploy/grafana/provisioning" in mounts
    assert "./deploy/grafana/dashboards" in mounts
    provider = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/turnstile.yml").read_text())
    assert provider["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"
    source = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text())
    uid = source["datasources"][0]["uid"]
    dashboard = json.loads((DEPLOY / "grafana/dashboards/turnstile.json").read_text())
    assert {t["datasource"]["uid"] for p in dashboard["panels"] for t in p["targets"]} == {uid}
