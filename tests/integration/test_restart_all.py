"""Every service and both servers restarted in the middle of a run: the run finishes, and nothing is lost,
recorded twice or forked.

The services run as the processes a deployment runs (``turnstile serve ...``): inference (scripted), runner,
materializer, relay, trainer (the tiny model) and gateway, on their own embedded PostgreSQL and nats-server.
Once a third of the episodes have finished, every service is killed (SIGKILL: no goodbye), NATS and
PostgreSQL are stopped and started again on the same data, and the services start again. Then the log must
hold one finished episode per slot of every task (an episode its runner left open is closed ``aborted`` and
retried), no event twice, every batch published once and trained once, and policy versions 1, 2, 3 ...

The second test keeps the services running and restarts only the servers, under a steady stream of episodes:
PostgreSQL with a fast shutdown, PostgreSQL killed, then NATS. Every service stays up (its pid unchanged),
logs and counts each outage it saw (``turnstile_database_outages_total``, ``turnstile_nats_outages_total``),
and the log ends as in the first test, with no episode aborted.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import nats
import psycopg
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pipeline.dev.embedded import EmbeddedNats, EmbeddedPostgres, free_port
from pipeline.dev.supervisor import ServiceProcesses
from pipeline.log import make_logins
from pipeline.log.db import migrate
from pipeline.settings import libpq_url

pytestmark = [pytest.mark.slow, pytest.mark.restarts]  # its own CI step: about 3 minutes
TASKS, GROUP = 8, 4
EPISODES = TASKS * GROUP
WAVE_TASKS = 6  # the stay-up test's tasks submitted before each restart: 24 episodes, 3 rounds of 8
SERVICES = ("inference", "runner", "materializer", "relay", "trainer", "gateway")
ADMIN = "restart-admin-key"


def query(url: str, statement: str, *params: Any) -> list[tuple[Any, ...]]:
    with psycopg.connect(libpq_url(url), connect_timeout=5) as connection:
        return connection.execute(statement, params or None).fetchall()  # type: ignore[arg-type]


def not_done(url: str, logs: Path) -> str:
    """For a failed check of the episodes' endings: each episode that did not end ``done``, with its events
    (type, metadata) and its ending's error, then the tail of each service's log."""
    streams = query(
        url,
        "SELECT stream, data->>'termination', data->>'error' FROM events "
        "WHERE type = 'EpisodeFinished' AND data->>'termination' <> 'done'",
    )
    lines = []
    for stream, termination, error in streams:
        events = query(
            url,
            f"SELECT position, type, metadata::text, recorded_at::text FROM events WHERE stream = '{stream}' "
            "ORDER BY version",
        )
        lines.append(f"{stream} ended {termination}: {error}; its events: {events}")
    for log in sorted(logs.glob("*.log")):
        lines.append(f"--- {log.name} (last 30 lines)\n" + "\n".join(log.read_text().splitlines()[-30:]))
    return "\n".join(lines)


def wait_for(what: str, condition: Callable[[], bool], within: float) -> None:
    deadline = time.monotonic() + within
    while True:
        try:
            if condition():
                return
        except (psycopg.OperationalError, httpx.HTTPError):
            pass  # a server still starting
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.25)


def once_up(what: str, call: Callable[[], str], within: float) -> str:
    """``call()``'s result once the server it needs answers (retried until then)."""
    results: list[str] = []
    wait_for(what, lambda: bool(results.append(call()) or results), within)
    return results[-1]


def finished_episodes(url: str, termination: str | None = None) -> int:
    """The runner's episodes (they have a group; the gateway's sessions here have none) that ended."""
    ended = query(
        url,
        "SELECT f.data->>'termination' FROM events s JOIN events f ON f.stream = s.stream "
        "WHERE s.type = 'EpisodeStarted' AND s.data->>'group_id' IS NOT NULL AND f.type = 'EpisodeFinished'",
    )
    return sum(1 for (ending,) in ended if termination in (None, ending))


def open_episodes(url: str) -> int:
    """The runner's episodes started and not finished (running now)."""
    return int(
        query(
            url,
            "SELECT count(*) FROM events s WHERE s.type = 'EpisodeStarted' "
            "AND s.data->>'group_id' IS NOT NULL AND NOT EXISTS "
            "(SELECT FROM events f WHERE f.stream = s.stream AND f.type = 'EpisodeFinished')",
        )[0][0]
    )


class Deployment:
    """The services as processes, on the servers' URLs, with what each is started with."""

    def __init__(self, env: dict[str, str], logs: Path, model: Path, checkpoints: Path, policy: str) -> None:
        self.env, self.logs, self.model, self.checkpoints, self.policy = env, logs, model, checkpoints, policy
        self.gateway_port = free_port()
        self.services = ServiceProcesses(env, logs)
        self.metrics_ports = {name: free_port() for name in SERVICES}
        self.ack_wait = 5.0
        """Seconds without progress before the runner's task is delivered again: short, so that a killed
        runner's tasks come back soon."""

    def start(self) -> None:
        policy = self.policy

        def start(name: str, *args: str) -> None:
            self.services.start(name, *args, "--metrics-port", str(self.metrics_ports[name]))

        start("inference", "serve", "inference", "--policy", policy, "--backend", "scripted")
        start(
            "runner",
            "serve",
            "runner",
            "--agent",
            "tests.support.agents:SlowAgent",
            "--policy",
            policy,
            "--concurrency",
            "8",
            "--ack-wait",
            str(self.ack_wait),
            "--lease-timeout",
            "5",
            "--heartbeat-timeout",
            "2",
        )
        start("materializer", "serve", "materializer", "--batch-samples", "12", "--group-timeout", "30")
        start("relay", "serve", "relay")
        start(
            "trainer",
            "serve",
            "trainer",
            "--policy",
            policy,
            "--model",
            str(self.model),
            "--checkpoints",
            str(self.checkpoints),
            "--micro-batch-tokens",
            "1024",
        )
        start("gateway", "serve", "gateway", "--port", str(self.gateway_port), "--policy-default", policy)

    def kill(self) -> None:
        for process in self.services.processes.values():
            process.kill()
            process.wait()
        self.services.processes.clear()

    def gateway_turn(self) -> str:
        """A gateway session with one chat turn; its episode id."""
        url = f"http://127.0.0.1:{self.gateway_port}"
        headers = {"Authorization": f"Bearer {ADMIN}"}
        with httpx.Client(base_url=url, timeout=30) as client:
            session = client.post("/admin/sessions", json={}, headers=headers)
            session.raise_for_status()
            key = session.json()["api_key"]
            chat = client.post(
                "/v1/chat/completions",
                json={"model": self.policy, "messages": [{"role": "user", "content": "hi"}]},
                headers={"Authorization": f"Bearer {key}"},
            )
            chat.raise_for_status()
            client.post(f"/admin/sessions/{session.json()['session_id']}/end", json={}, headers=headers)
        return str(session.json()["session_id"])


@pytest.fixture
def servers_of_its_own(server_dir: Path) -> Iterator[tuple[EmbeddedPostgres, EmbeddedNats]]:
    postgres, nats_server = EmbeddedPostgres(server_dir / "pg"), EmbeddedNats(server_dir / "nats")
    postgres.start()
    nats_server.start()
    try:
        yield postgres, nats_server
    finally:
        nats_server.stop()
        postgres.stop()


async def batch_ids_in_the_stream(nats_url: str) -> Counter[str]:
    """How often each batch id is in JetStream BATCHES (its Nats-Msg-Id)."""
    client = await nats.connect(nats_url)
    try:
        stream = client.jetstream()
        info = await stream.stream_info("BATCHES")
        seen: Counter[str] = Counter()
        for sequence in range(info.state.first_seq, info.state.last_seq + 1):
            message = await stream.get_msg("BATCHES", sequence)
            seen[(message.headers or {}).get("Nats-Msg-Id", "")] += 1
        return seen
    finally:
        await client.close()


def test_every_service_and_both_servers_restarted_mid_run(
    servers_of_its_own: tuple[EmbeddedPostgres, EmbeddedNats], tiny_model_dir: Path, server_dir: Path
) -> None:
    postgres, nats_server = servers_of_its_own
    migrate(postgres.url)
    services_url = make_logins(postgres.url).services
    env = {k: v for k, v in os.environ.items() if not k.startswith("TURNSTILE_")}
    env.update(TURNSTILE_DATABASE_URL=services_url, TURNSTILE_NATS_URL=nats_server.url, HF_HUB_OFFLINE="1",
               TURNSTILE_ADMIN_KEY=ADMIN, TURNSTILE_TEST_AGENT_SLEEP="1.0")  # fmt: skip
    policy = f"p{uuid.uuid4().hex[:8]}"
    deployment = Deployment(env, server_dir / "logs", tiny_model_dir, server_dir / "checkpoints", policy)
    tasks = server_dir / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"id": n}) + "\n" for n in range(TASKS)))
    url = postgres.url
    try:
        deployment.start()
        submitted = ServiceProcesses(env, server_dir / "logs")
        submitted.start("submit", "submit", str(tasks), "--policy", policy, "--group-size", str(GROUP),
                        "--connect-timeout", "60")  # fmt: skip
        assert submitted.processes["submit"].wait(120) == 0
        before = once_up("the gateway", deployment.gateway_turn, 120)
        wait_for("a third of the episodes", lambda: finished_episodes(url) >= EPISODES // 3, 120)
        assert finished_episodes(url) < EPISODES  # mid-run

        deployment.kill()
        nats_server.stop()
        postgres.stop()
        postgres.start()
        nats_server.start()
        deployment.start()

        after = once_up("the gateway again", deployment.gateway_turn, 120)
        wait_for("every slot done", lambda: finished_episodes(url, "done") >= EPISODES, 180)
        wait_for("every batch trained", lambda: all_trained(url, EPISODES), 180)
        deployment.services.check()  # every service is still up
    finally:
        deployment.services.stop()
    assert_nothing_lost_or_doubled(url, nats_server.url, policy, [before, after], TASKS)


def all_trained(url: str, episodes: int) -> bool:
    """Every episode materialized, and every batch made so far trained."""
    made, trained, materialized = query(
        url,
        "SELECT (SELECT count(*) FROM batches), (SELECT count(*) FROM trained_batches), "
        "(SELECT count(*) FROM episodes WHERE status = 'finished')",
    )[0]
    return bool(made) and made == trained and materialized >= episodes


def assert_nothing_lost_or_doubled(
    url: str, nats_url: str, policy: str, gateway_episodes: list[str], tasks: int
) -> None:
    """One finished episode per stream, one ``done`` per slot of each of ``tasks`` tasks, no event twice, the
    gateway's episodes finished, every trained batch published once and trained once, versions 1, 2, 3 ..."""
    # one finished episode per stream, one `done` per slot of a task, no event twice
    ends = query(url, "SELECT stream, data->>'termination' FROM events WHERE type = 'EpisodeFinished'")
    assert max(Counter(stream for stream, _ in ends).values()) == 1
    slots = query(
        url,
        "SELECT s.data->>'group_id', count(*) FROM events s JOIN events f ON f.stream = s.stream "
        "WHERE s.type = 'EpisodeStarted' AND f.type = 'EpisodeFinished' AND f.data->>'termination' = 'done' "
        "AND s.data->>'group_id' IS NOT NULL GROUP BY 1",  # the runner's (the gateway's sessions have none)
    )
    episodes = query(
        url,
        "SELECT s.data->>'group_id', s.data->>'task_id', s.stream, s.data->>'retry_of', "
        "f.data->>'termination' FROM events s LEFT JOIN events f ON f.stream = s.stream "
        "AND f.type = 'EpisodeFinished' WHERE s.type = 'EpisodeStarted' ORDER BY s.position",
    )
    assert sorted(count for _, count in slots) == [GROUP] * tasks, (slots, episodes)
    assert {termination for _, termination in ends} <= {"done", "aborted"}
    assert query(url, "SELECT count(*) = count(DISTINCT event_id) FROM events") == [(True,)]
    assert {stream for stream, _ in ends} >= {f"episode-{episode}" for episode in gateway_episodes}
    # every trained batch published once and trained once, into versions 1, 2, 3 ... (no fork)
    published = asyncio.run(batch_ids_in_the_stream(nats_url))
    trained_ids = [row[0] for row in query(url, "SELECT batch_id FROM trained_batches")]
    assert trained_ids
    assert len(set(trained_ids)) == len(trained_ids)
    assert set(trained_ids) <= set(published)
    assert set(published.values()) == {1}
    versions = [
        row[0]
        for row in query(
            url, f"SELECT version FROM policy_versions WHERE policy = '{policy}' ORDER BY position"
        )
    ]
    assert versions == list(range(1, len(versions) + 1))


def metric(port: int, name: str) -> float:
    """A service's metric (``name``, no labels) as its ``/metrics`` serves it now."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and not sample.labels:
                return float(sample.value)
    raise AssertionError(f"no {name} on port {port}:\n{text}")


def submit_wave(env: dict[str, str], server_dir: Path, policy: str, wave: int) -> None:
    """``turnstile submit`` of WAVE_TASKS more tasks (ids of their own), GROUP episodes each."""
    tasks = server_dir / f"tasks-{wave}.jsonl"
    ids = range(wave * WAVE_TASKS, (wave + 1) * WAVE_TASKS)
    tasks.write_text("".join(json.dumps({"id": n}) + "\n" for n in ids))
    submitting = ServiceProcesses(env, server_dir / "logs")
    submitting.start(f"submit-{wave}", "submit", str(tasks), "--policy", policy, "--group-size", str(GROUP),
                     "--connect-timeout", "60")  # fmt: skip
    try:
        assert submitting.processes[f"submit-{wave}"].wait(120) == 0
    finally:
        submitting.stop()


def unhealthy(metrics_ports: dict[str, int]) -> dict[str, str]:
    """The services whose /health says they are not (a server unreachable, as the service itself sees it) or
    that do not answer it, with what they say."""
    found = {}
    for name, port in metrics_ports.items():
        try:
            answer = httpx.get(f"http://127.0.0.1:{port}/health", timeout=10)
        except httpx.HTTPError as error:
            found[name] = f"no answer: {error!r}"
            continue
        if answer.status_code != 200:
            found[name] = answer.text
    return found


USES_NATS = ("inference", "runner", "relay", "trainer", "gateway")


def test_every_service_stays_up_through_postgresql_and_nats_restarts(
    servers_of_its_own: tuple[EmbeddedPostgres, EmbeddedNats], tiny_model_dir: Path, server_dir: Path
) -> None:
    """The same deployment under a steady stream of episodes, but only the servers restart: PostgreSQL with a
    fast shutdown, PostgreSQL killed (-9), then NATS. Every service process rides them out (the same pid
    throughout), logs each outage it saw and counts it in its /metrics, and the run ends as if nothing had
    happened: one finished episode per slot, no event twice, every batch published once and trained once."""
    postgres, nats_server = servers_of_its_own
    migrate(postgres.url)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TURNSTILE_")}
    env.update(TURNSTILE_DATABASE_URL=make_logins(postgres.url).services, TURNSTILE_NATS_URL=nats_server.url,
               HF_HUB_OFFLINE="1", TURNSTILE_ADMIN_KEY=ADMIN, TURNSTILE_TEST_AGENT_SLEEP="1.0")  # fmt: skip
    policy = f"p{uuid.uuid4().hex[:8]}"
    deployment = Deployment(env, server_dir / "logs", tiny_model_dir, server_dir / "checkpoints", policy)
    # The runner's short ack wait stays: an outage makes no progress for seconds, so its tasks are delivered
    # again to it while it still runs them, and each redelivery joins the attempt it runs (RunningTasks).
    url, ports = postgres.url, deployment.metrics_ports

    def restart_postgresql(down: Callable[[], None]) -> Callable[[], None]:
        return lambda: (down(), postgres.start())

    restarts = {
        "PostgreSQL, fast shutdown": restart_postgresql(postgres.stop),
        "PostgreSQL, kill -9": restart_postgresql(postgres.kill),
        "NATS": lambda: (nats_server.stop(), nats_server.start()),
    }
    episodes = WAVE_TASKS * GROUP * len(restarts)
    try:
        deployment.start()
        pids = {name: process.pid for name, process in deployment.services.processes.items()}
        turns = [once_up("the gateway", deployment.gateway_turn, 120)]
        for wave, (what, restart) in enumerate(restarts.items()):
            # a wave of episodes for each restart, so that a fast machine has not run out of work by then
            done = finished_episodes(url)
            submit_wave(env, server_dir, policy, wave)
            wait_for(
                f"episodes finished and others running before the {what} restart",
                lambda n=done: finished_episodes(url) > n and open_episodes(url) > 0,
                300,
            )
            restart()
            deployment.services.check()
            turns.append(once_up(f"a gateway turn after the {what} restart", deployment.gateway_turn, 120))
            # each service has seen this outage end before the next one begins (else it sees them as one)
            try:
                wait_for(f"every service healthy after the {what} restart", lambda: not unhealthy(ports), 120)
            except AssertionError as timed_out:
                deployment.services.check()  # a service that exited says so first
                raise AssertionError(f"{timed_out}: {unhealthy(ports)}") from None
        wait_for("every slot done", lambda: finished_episodes(url, "done") >= episodes, 300)
        wait_for("every batch trained", lambda: all_trained(url, episodes), 300)
        deployment.services.check()
        assert {name: p.pid for name, p in deployment.services.processes.items()} == pids
        database_outages = {
            name: metric(ports[name], "turnstile_database_outages_total") for name in SERVICES
        }
        nats_outages = {name: metric(ports[name], "turnstile_nats_outages_total") for name in USES_NATS}
    finally:
        deployment.services.stop()

    # two PostgreSQL outages and one of NATS, each seen once by every service that uses that server
    assert database_outages == dict.fromkeys(SERVICES, 2.0)
    assert nats_outages == dict.fromkeys(USES_NATS, 1.0)
    for name in SERVICES:
        log = (server_dir / "logs" / f"{name}.log").read_text()
        assert "PostgreSQL unreachable" in log, (name, log[-3000:])
        assert log.count("PostgreSQL is back after") == 2, (name, log[-3000:])
        if name in USES_NATS:
            assert "NATS unreachable" in log, (name, log[-3000:])
            assert log.count("NATS is back after") == 1, (name, log[-3000:])
    assert_nothing_lost_or_doubled(url, nats_server.url, policy, turns, WAVE_TASKS * len(restarts))
    # No runner died, so no episode was left open to be closed `aborted` and run again. Counted: the runner's
    # episodes and the gateway sessions whose turn answered (`turns`). A gateway session whose chat failed in
    # an outage is left open (`once_up` tries again in a new one), and lease recovery closes it `aborted` once
    # the gateway's lease ends, which is what it is for.
    endings = query(
        url,
        "SELECT f.data->>'termination', count(*) FROM events s JOIN events f ON f.stream = s.stream "
        "WHERE s.type = 'EpisodeStarted' AND f.type = 'EpisodeFinished' "
        "AND (s.data->>'group_id' IS NOT NULL OR s.stream = ANY(%s)) GROUP BY 1",
        [f"episode-{episode}" for episode in turns],
    )
    assert dict(endings) == {"done": episodes + len(turns)}, not_done(url, server_dir / "logs")
