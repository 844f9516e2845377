"""Real servers for the tests.

By default a real PostgreSQL and a real nats-server (JetStream) are started from the PyPI packages on free
ports for the session. ``TURNSTILE_DATABASE_URL`` / ``TURNSTILE_NATS_URL`` point the tests at existing
servers instead, and ``TURNSTILE_TEST_SERVICES=docker`` starts them with testcontainers.

Every test that touches the log gets its own database, cloned from a migrated template, so global
order assertions never see another test's events.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest
from sqlalchemy.engine import make_url

from pipeline.dev.embedded import EmbeddedServers, scratch_dir
from pipeline.log import EventStore
from pipeline.log.db import migrate, with_user
from pipeline.settings import libpq_url
from tests.support.models import built_model
from tests.support.roles import connect, role_nats  # noqa: F401 (fixtures for every test module)


@dataclass(frozen=True)
class Servers:
    database_url: str
    nats_url: str


def with_database(url: str, database: str) -> str:
    return libpq_url(make_url(libpq_url(url)).set(database=database).render_as_string(hide_password=False))


@pytest.fixture(scope="session")
def servers() -> Iterator[Servers]:
    database_url = os.environ.get("TURNSTILE_DATABASE_URL")
    nats_url = os.environ.get("TURNSTILE_NATS_URL")
    if os.environ.get("TURNSTILE_TEST_SERVICES") == "docker":
        yield from _docker_servers()
        return
    if database_url and nats_url:
        yield Servers(database_url, nats_url)
        return
    # Not under pytest's basetemp: a second pytest session on the machine prunes old basetemps, which
    # would delete the data directory of a server this session still runs.
    with scratch_dir("turnstile-test-servers-") as directory, EmbeddedServers(directory) as embedded:
        yield Servers(database_url or embedded.postgres.url, nats_url or embedded.nats.url)


def _docker_servers() -> Iterator[Servers]:
    from testcontainers.core.container import DockerContainer
    from testcontainers.core.waiting_utils import wait_for_logs
    from testcontainers.postgres import PostgresContainer

    with (
        PostgresContainer("postgres:16", driver=None) as postgres,
        DockerContainer("nats:2.10").with_command("-js").with_exposed_ports(4222) as nats,
    ):
        wait_for_logs(nats, "Server is ready")
        nats_url = f"nats://{nats.get_container_host_ip()}:{nats.get_exposed_port(4222)}"
        yield Servers(postgres.get_connection_url(), nats_url)


@pytest.fixture(scope="session")
def template_database(servers: Servers) -> Iterator[str]:
    name = f"turnstile_template_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(libpq_url(servers.database_url), autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    migrate(with_database(servers.database_url, name))
    yield name
    with psycopg.connect(libpq_url(servers.database_url), autocommit=True) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def database_url(servers: Servers, template_database: str) -> Iterator[str]:
    """A freshly migrated database of this test's own."""
    name = f"turnstile_test_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(libpq_url(servers.database_url), autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}" TEMPLATE "{template_database}"')
    yield with_database(servers.database_url, name)
    with psycopg.connect(libpq_url(servers.database_url), autocommit=True) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def server_dir() -> Iterator[Path]:
    """A data directory for a server a test starts itself, outside pytest's basetemp (another pytest
    session on the machine, such as a mutation run, prunes old basetemps while this one still runs)."""
    with scratch_dir("turnstile-test-server-") as directory:
        yield directory


@pytest.fixture(scope="session")
def logins(servers: Servers) -> Iterator[dict[str, tuple[str, str]]]:
    """A login user per group role, made as deploy/postgres-init.sql makes the compose users (``LOGIN``, a
    password, member of the group role, not a superuser), under names of this session's own:
    (user, password) by group role. Tests that act as a role log in as its user (no ``SET ROLE``)."""
    suffix = uuid.uuid4().hex[:8]
    roles = (
        "turnstile_writer", "turnstile_materializer", "turnstile_reader",
        "turnstile_trainer", "turnstile_inference",
    )  # fmt: skip
    made = {role: (f"{role.removeprefix('turnstile_')}_{suffix}", uuid.uuid4().hex) for role in roles}
    with psycopg.connect(libpq_url(servers.database_url), autocommit=True) as admin:
        for role in roles:  # the template's migration made them; a fresh server may not have them yet
            admin.execute(
                f"DO $$ BEGIN CREATE ROLE {role} NOLOGIN; EXCEPTION WHEN duplicate_object THEN NULL; END $$"
            )
        for role, (user, password) in made.items():
            admin.execute(f"CREATE ROLE \"{user}\" LOGIN PASSWORD '{password}' IN ROLE {role}")
        # the trainer's login is a writer too, as deploy/postgres-init.sql makes it
        admin.execute(f'GRANT turnstile_writer TO "{made["turnstile_trainer"][0]}"')
    yield made
    with psycopg.connect(libpq_url(servers.database_url), autocommit=True) as admin:
        for user, _ in made.values():
            admin.execute(f'DROP ROLE IF EXISTS "{user}"')


def login_url(url: str, login: tuple[str, str]) -> str:
    """``url`` logging in as ``login`` (user, password)."""
    return with_user(url, *login)


@pytest.fixture
async def store(database_url: str) -> AsyncIterator[EventStore]:
    event_store = await EventStore.connect(database_url)
    yield event_store
    await event_store.close()


@pytest.fixture
def repo_root() -> Path:
    return Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def tiny_model_dir() -> Iterator[Path]:
    """The tiny local model (random weights, locally trained tokenizer), built once per session (outside
    pytest's basetemp, for the reason given in ``servers``)."""
    from pipeline.inference.tinymodel import build_tiny_model

    with built_model(build_tiny_model, "tiny", "turnstile-test-model-") as directory:
        yield directory


@pytest.fixture(scope="session")
def long_model_dir() -> Iterator[Path]:
    """The tiny model for agent prompts (``turnstile model init-long``: 131,072-token context, sliding-window
    attention on every layer), built once per session like ``tiny_model_dir``."""
    from pipeline.inference.tinymodel import build_long_model

    with built_model(build_long_model, "long", "turnstile-test-long-model-") as directory:
        yield directory
