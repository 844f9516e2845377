"""The service runtime: bounded first connects that name what to fix, reconnects after a restart, signals,
health checks."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from consumers.runtime import Runtime, connect_nats, connect_store, running, stop_on_signals
from pipeline.dev.embedded import EmbeddedNats, free_port
from pipeline.errors import ConfigError
from pipeline.settings import jetstream_api_prefix, nats_inbox_prefix


async def test_an_unreachable_nats_is_a_clear_error_after_the_bound() -> None:
    url = f"nats://127.0.0.1:{free_port()}"
    with pytest.raises(ConfigError) as refused:
        await connect_nats(url, connect_for=1.0)
    message = str(refused.value)
    assert f"cannot reach NATS at {url} after 1 s" in message
    assert "TURNSTILE_NATS_URL" in message


async def test_an_unreachable_postgresql_is_a_clear_error_after_the_bound() -> None:
    with pytest.raises(ConfigError) as refused:
        await connect_store(f"postgresql://postgres@127.0.0.1:{free_port()}/turnstile", connect_for=1.0)
    assert "cannot reach PostgreSQL after 1 s" in str(refused.value)
    assert "TURNSTILE_DATABASE_URL" in str(refused.value)


async def test_a_stop_ends_the_wait_for_a_server_that_never_comes() -> None:
    stop = asyncio.Event()
    waiting = asyncio.create_task(connect_nats(f"nats://127.0.0.1:{free_port()}", stop=stop))
    await asyncio.sleep(0.3)
    assert not waiting.done()
    stop.set()
    assert await asyncio.wait_for(waiting, 10) is None


async def test_a_server_that_starts_late_is_waited_for_and_a_restart_is_survived(server_dir: Path) -> None:
    server = EmbeddedNats(server_dir / "nats")
    await asyncio.to_thread(server.start)
    url = server.url
    await asyncio.to_thread(server.stop)
    connecting = asyncio.create_task(connect_nats(url, connect_for=60.0))
    await asyncio.sleep(0.5)
    assert not connecting.done()  # nothing listens yet
    await asyncio.to_thread(server.start)
    connection = await asyncio.wait_for(connecting, 60)
    assert connection is not None
    try:
        await asyncio.to_thread(server.stop)
        await asyncio.to_thread(server.start)  # same port: the connection reconnects on its own
        inbox = await connection.subscribe("runtime.test")
        await connection.publish("runtime.test", b"after the restart")
        message = await inbox.next_msg(timeout=30)
        assert message.data == b"after the restart"
    finally:
        await connection.close()
        await asyncio.to_thread(server.stop)


async def test_sigterm_sets_the_stop_event_while_the_service_runs() -> None:
    async with running("test") as runtime:
        os.kill(os.getpid(), signal.SIGTERM)
        await asyncio.wait_for(runtime.stop.wait(), 10)
    called = asyncio.Event()
    with stop_on_signals(called.set):
        os.kill(os.getpid(), signal.SIGINT)
        await asyncio.wait_for(called.wait(), 10)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handed back


def test_health_is_every_check_and_a_failing_check_is_unhealthy() -> None:
    runtime = Runtime("relay", asyncio.Event())
    runtime.check("nats", lambda: True)
    assert runtime.health() == {"service": "relay", "healthy": True, "checks": {"nats": True}}

    def broken() -> bool:
        raise RuntimeError("no connection object yet")

    runtime.check("postgres", broken)
    assert runtime.health() == {
        "service": "relay",
        "healthy": False,
        "checks": {"nats": True, "postgres": False},
    }


@pytest.mark.parametrize(
    ("url", "prefix"),
    [
        ("nats://runner:secret@nats:4222", "_INBOX_runner"),
        ("nats://gateway:pw@a:4222,nats://gateway:pw@b:4222", "_INBOX_gateway"),
        ("nats://s3cr3t-token@nats:4222", "_INBOX"),  # a token: never put into a subject
        ("nats://127.0.0.1:4222", "_INBOX"),
    ],
)
def test_the_inbox_prefix_is_the_role_that_logs_in(url: str, prefix: str) -> None:
    assert nats_inbox_prefix(url) == prefix


@pytest.mark.parametrize(
    ("url", "prefix"),
    [
        ("nats://runner:secret@nats:4222", "JS.runner.API"),  # deploy/nats.conf: the runner account's import
        ("nats://trainer:pw@a:4222,nats://trainer:pw@b:4222", "JS.trainer.API"),
        ("nats://s3cr3t-token@nats:4222", "$JS.API"),
        ("nats://127.0.0.1:4222", "$JS.API"),  # turnstile up: no logins, no accounts
    ],
)
def test_the_jetstream_api_prefix_is_the_role_that_logs_in(url: str, prefix: str) -> None:
    assert jetstream_api_prefix(nats_inbox_prefix(url)) == prefix


def test_a_user_name_that_cannot_be_a_subject_token_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="cannot name an inbox prefix"):
        nats_inbox_prefix("nats://has.dot:pw@nats:4222")


def scrape(address: tuple[str, int], path: str = "/metrics") -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{address[1]}{path}", timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def sample(text: str, name: str, labels: dict[str, str] | None = None) -> float | None:
    """A sample's value in Prometheus' text format (parsed by prometheus-client's own parser)."""
    for family in text_string_to_metric_families(text):
        for found in family.samples:
            if found.name == name and (labels is None or found.labels == labels):
                return float(found.value)
    return None


async def test_metrics_and_health_are_served_while_the_service_runs() -> None:
    counts = {"done": 0}
    healthy = {"nats": True}
    async with running("svc", metrics_port=0, metrics_host="127.0.0.1") as runtime:
        assert runtime.metrics_address is not None
        runtime.check("nats", lambda: healthy["nats"])
        runtime.counter("turnstile_things_total", "things done", lambda: counts["done"])
        runtime.gauge("turnstile_depth", "by queue", lambda: {("a",): 2.0, ("b",): 5.0}, ["queue"])
        latency = runtime.histogram("turnstile_latency_seconds", "latency", (0.1, 1.0))
        polled = asyncio.Event()

        async def fetch() -> float:
            polled.set()
            return 42.0

        runtime.poll("turnstile_polled", "fetched", 0.05, fetch)
        await asyncio.wait_for(polled.wait(), 10)

        status, first = await asyncio.to_thread(scrape, runtime.metrics_address)
        assert status == 200
        assert sample(first, "turnstile_things_total") == 0
        counts["done"] = 3
        latency.observe(0.5)
        _, second = await asyncio.to_thread(scrape, runtime.metrics_address)
        assert sample(second, "turnstile_things_total") == 3  # the counter moved between scrapes
        assert sample(second, "turnstile_depth", {"queue": "b"}) == 5
        assert sample(second, "turnstile_latency_seconds_bucket", {"le": "1.0"}) == 1
        assert sample(second, "turnstile_latency_seconds_bucket", {"le": "0.1"}) == 0
        assert sample(second, "turnstile_polled") == 42
        assert sample(second, "turnstile_service_healthy") == 1
        assert sample(second, "turnstile_service_info", {"service": "svc"}) == 1

        status, body = await asyncio.to_thread(scrape, runtime.metrics_address, "/health")
        assert (status, json.loads(body)["healthy"]) == (200, True)
        healthy["nats"] = False
        status, body = await asyncio.to_thread(scrape, runtime.metrics_address, "/health")
        assert status == 503
        assert json.loads(body)["checks"] == {"nats": False}
        _, third = await asyncio.to_thread(scrape, runtime.metrics_address)
        assert sample(third, "turnstile_service_healthy") == 0
        address = runtime.metrics_address
    with pytest.raises(urllib.error.URLError, match="refused"):  # stopped with the service
        await asyncio.to_thread(scrape, address)


async def test_a_metrics_port_in_use_is_a_clear_error() -> None:
    async with running("first", metrics_port=0, metrics_host="127.0.0.1") as runtime:
        assert runtime.metrics_address is not None
        with pytest.raises(ConfigError, match=r"cannot serve metrics on 127\.0\.0\.1"):
            async with running("second", metrics_port=runtime.metrics_address[1], metrics_host="127.0.0.1"):
                pass


async def test_metrics_listen_on_this_machine_only_unless_told_and_include_process_cpu_and_memory() -> None:
    async with running("svc", metrics_port=0) as runtime:
        assert runtime.metrics_address is not None
        assert runtime.metrics_address[0] == "127.0.0.1"  # a container passes --metrics-host 0.0.0.0
        _, text = await asyncio.to_thread(scrape, runtime.metrics_address)
        assert (sample(text, "process_cpu_seconds_total") or 0) > 0
        assert (sample(text, "process_resident_memory_bytes") or 0) > 10 * 2**20  # this Python process


def test_the_cli_and_the_runtime_default_to_the_same_metrics_host() -> None:
    from consumers.cli.common import METRICS_HOST as CLI_DEFAULT
    from consumers.runtime import METRICS_HOST

    assert CLI_DEFAULT == METRICS_HOST == "127.0.0.1"


def test_a_service_collects_young_objects_less_often_and_still_collects_its_cycles() -> None:
    # In a process of its own: tune_gc freezes what exists and changes this process's collector for good.
    script = """
import gc, json, weakref
from consumers.runtime import GC_GEN0_THRESHOLD, tune_gc
tune_gc()
class Node:
    pass
cycle = Node(); cycle.self = cycle
freed = []
weakref.finalize(cycle, freed.append, True)
del cycle
kept = [[] for _ in range(GC_GEN0_THRESHOLD // 2)]
before = bool(freed)
kept += [[] for _ in range(GC_GEN0_THRESHOLD)]
print(json.dumps({"threshold": gc.get_threshold()[0], "wanted": GC_GEN0_THRESHOLD,
                  "frozen": gc.get_freeze_count(), "before": before, "after": bool(freed)}))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    seen = json.loads(done.stdout)
    assert seen["threshold"] == seen["wanted"]
    assert seen["frozen"] > 1000  # the modules imported by then: never walked again
    assert not seen["before"]  # fewer allocations than the threshold: no young collection yet
    assert seen["after"]  # past it: the cycle made after tuning is collected without asking


def test_a_service_imports_neither_the_openai_sdk_nor_alembic_until_it_uses_them() -> None:
    # Each costs every process start a large share of its import time; only llm.openai() and a migration
    # need them.
    script = """
import json, sys
import consumers.runtime, pipeline.episodes, pipeline.gateway, pipeline.log, pipeline.runners
before = sorted(name for name in ("openai", "alembic") if name in sys.modules)
from pipeline.log.db import alembic_config
alembic_config("postgresql://nobody@127.0.0.1/none")
from pipeline.dialects import openai_client
between = sorted(name for name in ("openai", "alembic") if name in sys.modules)
client = openai_client(None, model="m")  # the handler is only called when the client is
print(json.dumps({"before": before, "between": between, "client": type(client).__name__,
                  "after": sorted(name for name in ("openai", "alembic") if name in sys.modules)}))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    seen = json.loads(done.stdout)
    assert seen["before"] == []
    assert seen["between"] == ["alembic"]  # a migration's config imports it; importing openai_client does not
    assert (seen["client"], seen["after"]) == ("AsyncOpenAI", ["alembic", "openai"])  # making a client does
