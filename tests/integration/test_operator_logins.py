"""Every command an operator runs, as a process, with the login docs/operations.md tells them to use (the
logins ``turnstile up`` makes: services, reader, owner): each works, and with the wrong login each fails in
one line that names the login to use. The services themselves run on these logins in tests/e2e/test_demo.py.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import psycopg
import pytest
from psycopg import sql

from consumers.inference import InferenceConfig
from pipeline.log import EventStore, make_logins
from pipeline.materialize import Materializer, MaterializerConfig
from pipeline.settings import libpq_url
from tests.conftest import Servers
from tests.integration.test_cli import TURNSTILE, clean_env
from tests.support.backends import RuleBackend, echo_rule
from tests.support.factories import finished, opened, reward, turn
from tests.support.processes import running
from tests.support.serving import serving
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow
TASKS = Path(__file__).resolve().parents[2] / "pipeline" / "examples" / "arithmetic.jsonl"


@dataclass(frozen=True)
class Logins:
    services: str
    reader: str
    owner: str
    nats: str
    reader_name: str

    def env(self, *names: str) -> dict[str, str]:
        """A clean environment with the URLs ``names`` (services, reader, owner, nats) set as the operator's
        shell would from `turnstile up`'s export lines."""
        variables = {
            "services": ("TURNSTILE_DATABASE_URL", self.services),
            "reader": ("TURNSTILE_READER_URL", self.reader),
            "owner": ("TURNSTILE_ADMIN_DATABASE_URL", self.owner),
            "nats": ("TURNSTILE_NATS_URL", self.nats),
        }
        return clean_env(**dict(variables[name] for name in names))


@pytest.fixture
def up_logins(database_url: str, servers: Servers) -> Iterator[Logins]:
    """The two logins `turnstile up` makes (``make_logins``), under names of this test's own."""
    suffix = uuid.uuid4().hex[:8]
    services, reader = f"turnstile_{suffix}", f"turnstile_analyst_{suffix}"
    made = make_logins(database_url, services=services, reader=reader)
    yield Logins(made.services, made.reader, database_url, servers.nats_url, reader)
    with psycopg.connect(libpq_url(database_url), autocommit=True) as admin:
        for user in (services, reader):
            admin.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(user)))
            admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(user)))


def turnstile(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*TURNSTILE, *args], env=env, capture_output=True, text=True, timeout=300)


def assert_works(result: subprocess.CompletedProcess[str]) -> None:
    assert result.returncode == 0, result.stderr


def assert_one_line_naming(result: subprocess.CompletedProcess[str], *names: str) -> None:
    """Exit 2 and one error line naming ``names`` (after any start-up line a service prints), no traceback."""
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert "╭" not in result.stderr, result.stderr  # nor a rich one
    error = result.stderr.strip().splitlines()[-1]
    assert error.startswith("error: "), result.stderr
    for name in names:
        assert name in error


async def recorded_episode(store: EventStore) -> str:
    stream, events = opened(turn(), reward(1.0), finished())
    await store.append(stream, events, 0)
    return stream.removeprefix("episode-")


async def materialized(store: EventStore) -> None:
    """The read models caught up with the log, as a running materializer keeps them."""
    materializer = Materializer(store.libpq_url, MaterializerConfig())
    await materializer.open()
    try:
        await materializer.catch_up()
    finally:
        await materializer.close()


async def test_every_reading_and_rebuilding_command_works_with_the_login_the_docs_name(
    up_logins: Logins, store: EventStore, tmp_path: Path
) -> None:
    episode_id = await recorded_episode(store)
    reader, services = up_logins.env("reader"), up_logins.env("services")

    def run(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
        return turnstile(env, *args)

    listed = await asyncio.to_thread(run, reader, "episodes", "--json")
    assert_works(listed)
    assert [row["episode_id"] for row in json.loads(listed.stdout)] == [episode_id]
    assert_works(await asyncio.to_thread(run, services, "replay", episode_id))
    assert_works(await asyncio.to_thread(run, reader, "plot", "--out", str(tmp_path / "plots")))
    counted = await asyncio.to_thread(run, reader, "sql", "SELECT count(*) AS n FROM events", "--json")
    assert_works(counted)
    assert json.loads(counted.stdout) == [{"n": 4}]
    assert_works(await asyncio.to_thread(run, services, "rematerialize", "--name", "audit"))
    # what rematerialize tells the operator to run next, as the reader (refused before: the rebuild's
    # schema was its maker's alone)
    rebuilt = await asyncio.to_thread(
        run, reader, "sql", "--schema", "audit", "SELECT count(*) AS n FROM episodes", "--json"
    )
    assert_works(rebuilt)
    assert json.loads(rebuilt.stdout) == [{"n": 1}]
    assert_works(await asyncio.to_thread(run, reader, "plot", "--schema", "audit", "--out", str(tmp_path)))
    assert_works(await asyncio.to_thread(run, services, "rematerialize", "--name", "audit", "--replace"))
    assert_works(await asyncio.to_thread(run, up_logins.env("owner"), "migrate"))
    assert_works(await asyncio.to_thread(run, clean_env(), "export-schemas", str(tmp_path / "schemas")))


async def test_the_episode_browser_works_with_the_reader_login_and_writes_nothing(
    up_logins: Logins, store: EventStore, database_url: str, tmp_path: Path
) -> None:
    """``turnstile ui`` as the operator starts it after `turnstile up` (TURNSTILE_READER_URL, the reader
    login): its pages show the recorded episode, every connection it opens is that login's, and browsing and
    writing requests leave the log and the read models as they were."""
    episode_id = await recorded_episode(store)
    await materialized(store)
    log = tmp_path / "ui.log"

    def contents() -> list[tuple[object, ...]]:
        with psycopg.connect(libpq_url(database_url)) as owner:
            return owner.execute(
                "SELECT (SELECT count(*) FROM events), (SELECT max(position) FROM events), "
                "(SELECT count(*) FROM episodes)"
            ).fetchall()

    def logins_of_the_ui() -> set[str]:
        with psycopg.connect(libpq_url(database_url)) as owner:
            rows = owner.execute(
                "SELECT usename FROM pg_stat_activity WHERE application_name = 'turnstile ui'"
            ).fetchall()
        return {name for (name,) in rows}

    before = contents()
    with log.open("w") as output:
        async with running(
            *TURNSTILE,
            "ui",
            "--port",
            "0",
            env=up_logins.env("reader"),
            stdout=output,
            stderr=subprocess.STDOUT,
        ) as ui:
            await wait_until(
                lambda: "episode browser on " in log.read_text() or ui.returncode is not None, 120, "the ui"
            )
            found = re.search(r"episode browser on (http://\S+)/episodes", log.read_text())
            assert found is not None, log.read_text()
            async with httpx.AsyncClient(base_url=found[1], timeout=60) as client:
                listed = await client.get("/episodes")
                assert listed.status_code == 200, listed.text
                assert episode_id in listed.text
                page = await client.get(f"/episodes/{episode_id}")
                assert page.status_code == 200, page.text
                for method in ("POST", "PUT", "DELETE", "PATCH"):
                    refused = await client.request(method, f"/episodes/{episode_id}", json={"reward": 5})
                    assert refused.status_code == 405, (method, refused.text)
            assert logins_of_the_ui() == {up_logins.reader_name}
    assert contents() == before


async def test_run_and_submit_work_with_the_services_login_and_nats(up_logins: Logins) -> None:
    policy = f"p{uuid.uuid4().hex[:8]}"
    config = InferenceConfig(up_logins.nats, policy, backend="scripted", heartbeat_interval=0.5)
    agent = "pipeline.examples.single_turn:SingleTurnAgent"
    async with serving(config, RuleBackend(echo_rule)):
        ran = await asyncio.to_thread(
            turnstile, up_logins.env("services", "nats"), "run", "--agent", agent, "--tasks", str(TASKS),
            "--policy", policy,
        )  # fmt: skip
    assert_works(ran)
    submitted = await asyncio.to_thread(
        turnstile, up_logins.env("nats"), "submit", str(TASKS), "--policy", policy
    )
    assert_works(submitted)
    assert "submitted 16 tasks" in submitted.stderr


@pytest.mark.parametrize(
    "args",
    [
        ["rematerialize", "--name", "wrong"],
        ["serve", "materializer"],
        [
            "run",
            "--agent",
            "pipeline.examples.single_turn:SingleTurnAgent",
            "--tasks",
            str(TASKS),
            "--policy",
            "nobody",
        ],
    ],
    ids=lambda args: " ".join(args[:2]),
)
def test_a_writing_command_run_as_the_reader_says_in_one_line_which_login_it_needs(
    up_logins: Logins, args: list[str]
) -> None:
    env = {**up_logins.env("nats"), "TURNSTILE_DATABASE_URL": up_logins.reader}  # the wrong login
    refused = turnstile(env, *args)
    assert_one_line_naming(
        refused, f"login {up_logins.reader_name!r}", "TURNSTILE_DATABASE_URL", "permission denied"
    )


def test_sql_as_the_owner_says_in_one_line_to_use_the_reader_login(up_logins: Logins) -> None:
    refused = turnstile(clean_env(TURNSTILE_DATABASE_URL=up_logins.owner), "sql", "SELECT 1")
    assert_one_line_naming(refused, "is a superuser", "TURNSTILE_READER_URL")
