"""What operators see is true: the services' /metrics, and the shipped Grafana dashboard's queries run by a
real Prometheus (Debian's ``prometheus`` and ``promtool``, marker ``prometheus``: ``apt-get install
prometheus``, then ``pytest -m prometheus tests/integration/test_metrics.py``) against real services'
endpoints."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import re
import shutil
import subprocess
import urllib.parse
import urllib.request
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from consumers.gateway import GatewayConfig, serve_gateway
from consumers.inference import InferenceConfig
from consumers.runner import reward_metrics
from consumers.runtime import Runtime, running
from consumers.trainer import instrument as trainer_metrics
from pipeline.dev.embedded import free_port
from pipeline.episodes import EpisodeOutcome
from pipeline.runners import RunStats
from pipeline.training import StepRecord, TrainerStats
from tests.conftest import Servers, login_url
from tests.support.backends import RuleBackend, calculator_rule
from tests.support.serving import serving
from tests.support.waiting import wait_until

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "dashboards" / "turnstile.json"
ADMIN = "admin-metrics-test"


def samples(port: int) -> dict[str, float]:
    """A service's /metrics as {name{label=value,...}: value} (prometheus-client's own parser)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{key}={value}" for key, value in sorted(sample.labels.items()))
            found[f"{sample.name}{{{labels}}}"] = float(sample.value)
    return found


@contextlib.asynccontextmanager
async def gateway_service(
    servers: Servers, database_url: str, ui_reader_url: str | None = None
) -> AsyncIterator[tuple[str, int]]:
    """``serve_gateway`` (the service ``turnstile serve gateway`` runs) with its metrics on a free port, in
    front of a scripted inference consumer of a policy of its own (``ui_reader_url``: with the episode
    browser at /ui): (its URL, its metrics port)."""
    policy = f"metrics-{uuid.uuid4().hex[:8]}"
    metrics_port = free_port()
    config = GatewayConfig(
        database_url, servers.nats_url, admin_key=ADMIN, policy_default=policy, port=0,
        metrics_port=metrics_port, max_body_bytes=1024 * 1024, ui_reader_url=ui_reader_url,
    )  # fmt: skip
    stop = asyncio.Event()
    ready: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    inference = InferenceConfig(servers.nats_url, policy, backend="scripted", heartbeat_interval=0.5)
    async with serving(inference, RuleBackend(calculator_rule)):
        service = asyncio.create_task(serve_gateway(config, stop=stop, ready=ready.set_result))
        try:
            yield await asyncio.wait_for(ready, 60), metrics_port
        finally:
            stop.set()
            await asyncio.wait_for(service, 60)


CHAT = {"model": "m", "messages": [{"role": "user", "content": "What is 3 + 4?"}]}


async def open_session(client: httpx.AsyncClient) -> tuple[dict[str, Any], dict[str, str]]:
    """``POST /admin/sessions``: the session, and the headers that carry its key."""
    session: dict[str, Any] = (
        await client.post("/admin/sessions", json={}, headers={"Authorization": f"Bearer {ADMIN}"})
    ).json()
    return session, {"Authorization": f"Bearer {session['api_key']}"}


async def test_the_gateway_counts_requests_by_route_and_status_times_them_and_counts_errors_by_kind(
    servers: Servers, database_url: str, logins: dict[str, tuple[str, str]]
) -> None:
    reader = login_url(database_url, logins["turnstile_reader"])
    async with (
        gateway_service(servers, database_url, reader) as (url, metrics_port),
        httpx.AsyncClient(base_url=url, timeout=60) as client,
    ):
        session, key = await open_session(client)
        admin = {"Authorization": f"Bearer {ADMIN}"}
        answers = [
            await client.post("/v1/chat/completions", json=CHAT, headers=key),
            await client.post("/v1/chat/completions", json={"model": "m"}, headers=key),
            await client.post("/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer x"}),
            await client.get(f"/admin/sessions/{session['session_id']}", headers=admin),
            await client.get("/no/such/path"),
            await client.post("/v1/chat/completions", content=b"x" * (2 * 1024 * 1024), headers=key),
            await client.request("PROPFIND", "/v1/models"),  # WebDAV: the HTTP parser takes it
            await client.get("/ui/episodes"),  # the episode browser, without the admin key
            await client.get("/ui/episodes", auth=("admin", ADMIN)),
        ]
        assert [a.status_code for a in answers] == [200, 400, 401, 200, 404, 413, 405, 401, 200]
        found = await asyncio.to_thread(samples, metrics_port)

    def requests(route: str, method: str, status: int) -> float | None:
        return found.get(f"turnstile_gateway_requests_total{{method={method},route={route},status={status}}}")

    assert requests("/admin/sessions", "POST", 201) == 1
    assert requests("/v1/chat/completions", "POST", 200) == 1
    assert requests("/v1/chat/completions", "POST", 400) == 1
    assert requests("/v1/chat/completions", "POST", 401) == 1
    # by the route's template, never the raw path (a series per session would grow without bound)
    assert requests("/admin/sessions/{session_id}", "GET", 200) == 1
    assert not [name for name in found if session["session_id"] in name]
    assert requests("none", "GET", 404) == 1  # no route: one series for every unknown path
    assert requests("none", "POST", 413) == 1  # refused before routing, by the body bound
    assert requests("/v1/models", "other", 405) == 1  # any method a client makes up: one series
    assert requests("/ui", "GET", 401) == 1  # refused by the browser's guard, before its routes
    assert requests("/ui/episodes", "GET", 200) == 1
    assert found["turnstile_gateway_request_seconds_count{method=POST,route=/v1/chat/completions}"] == 3
    assert found["turnstile_gateway_request_seconds_sum{method=POST,route=/v1/chat/completions}"] > 0
    errors = {name: n for name, n in found.items() if name.startswith("turnstile_gateway_errors_total")}
    assert errors == {
        "turnstile_gateway_errors_total{kind=invalid_request_error,route=/v1/chat/completions}": 1,
        "turnstile_gateway_errors_total{kind=invalid_api_key,route=/v1/chat/completions}": 1,
        "turnstile_gateway_errors_total{kind=not_found,route=none}": 1,
        "turnstile_gateway_errors_total{kind=request_too_large,route=none}": 1,
        "turnstile_gateway_errors_total{kind=invalid_request_error,route=/v1/models}": 1,  # the 405
        "turnstile_gateway_errors_total{kind=http_401,route=/ui}": 1,  # a page, not a JSON error
    }
    served = [n for name, n in found.items() if name.startswith("turnstile_gateway_policy_version_served")]
    assert served == [0]  # the consumer's version, under its policy's label
    assert found["process_cpu_seconds_total{}"] > 0
    assert found["process_resident_memory_bytes{}"] > 0


# ---- the dashboard, in a real Prometheus -------------------------------------------------------------


def dashboard_queries() -> dict[str, list[str]]:
    """Each panel's title: its PromQL expressions."""
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return {panel["title"]: [target["expr"] for target in panel["targets"]] for panel in panels}


def debian_tool(name: str) -> str:
    """The path of Debian's ``prometheus`` or ``promtool``; missing: a skip, or under CI (which installs
    them) a failure, so that the step cannot pass empty."""
    found = shutil.which(name)
    if found is None:
        missing = f"{name} is missing: apt-get install prometheus (Debian's package ships both tools)"
        if os.environ.get("CI"):
            pytest.fail(missing)
        pytest.skip(missing)
    return found


@pytest.mark.prometheus
def test_promtool_accepts_every_query_of_the_dashboard(tmp_path: Path) -> None:
    queries = [expr for exprs in dashboard_queries().values() for expr in exprs]
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:query{n}", "expr": expr} for n, expr in enumerate(queries)
    ]}]}  # fmt: skip
    path = tmp_path / "rules.json"  # YAML is a superset of JSON
    path.write_text(json.dumps(rules))
    checked = subprocess.run(
        [debian_tool("promtool"), "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {len(queries)} rules found" in checked.stdout


@contextlib.contextmanager
def prometheus(tmp_path: Path, targets: list[str]) -> Iterator[str]:
    """Debian's Prometheus scraping ``targets`` every second (job ``turnstile``); yields its URL."""
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [{"job_name": "turnstile", "static_configs": [{"targets": targets}]}],
    }
    (tmp_path / "prometheus.yml").write_text(json.dumps(config))
    port = free_port()
    command = [
        debian_tool("prometheus"), f"--config.file={tmp_path / 'prometheus.yml'}",
        f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}",
    ]  # fmt: skip
    with (tmp_path / "prometheus.log").open("w") as log, subprocess.Popen(command, stderr=log) as server:
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            server.terminate()
            server.wait(30)


def query(base: str, expr: str) -> dict[tuple[tuple[str, str], ...], float]:
    """An instant query: {labels: value}; a query Prometheus refuses raises."""
    url = f"{base}/api/v1/query?{urllib.parse.urlencode({'query': expr})}"
    with urllib.request.urlopen(url, timeout=10) as response:
        body: dict[str, Any] = json.loads(response.read())
    assert body["status"] == "success", body
    return {tuple(sorted(row["metric"].items())): float(row["value"][1]) for row in body["data"]["result"]}


async def outcomes_and_steps(runner: RunStats, observe: dict[str, Any], stop: asyncio.Event) -> None:
    """Work arriving while Prometheus scrapes: an episode with reward -1 and a learner step of 64 samples
    per policy every 0.2 s (a rate needs counters that move between scrapes)."""
    n = 0
    while not stop.is_set():
        n += 1
        runner.count(EpisodeOutcome(f"e{n}", "done", -1.0, turns=1))
        for hook in observe.values():
            hook(step_record(n, samples=64))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.2)


def step_record(step: int, *, samples: int) -> StepRecord:
    return StepRecord(
        step=step, batch_id=f"b{step}", policy_version=step, loss=0.0, samples=samples, tokens=samples * 10,
        staleness=0, mean_reward=-1.0, mean_advantage=0.0, kl=0.0, clip_fraction=0.0,
    )  # fmt: skip


@contextlib.asynccontextmanager
async def services() -> AsyncIterator[tuple[list[Runtime], RunStats, dict[str, Any]]]:
    """A runner's reward metrics (policy a) and two trainers (policies a and b, at versions 3 and 7), each a
    runtime serving /metrics on a port of its own."""
    runner = RunStats()
    async with (
        running("runner", metrics_port=0) as runner_runtime,
        running("trainer a", metrics_port=0) as trainer_a,
        running("trainer b", metrics_port=0) as trainer_b,
    ):
        reward_metrics(runner_runtime, runner, "a")
        observe = {
            "a": trainer_metrics(trainer_a, lambda: TrainerStats(version=3), "a"),
            "b": trainer_metrics(trainer_b, lambda: TrainerStats(version=7), "b"),
        }
        yield [runner_runtime, trainer_a, trainer_b], runner, observe


async def gateway_calls(client: httpx.AsyncClient, stop: asyncio.Event) -> None:
    """A turn and a call with a wrong key every 0.2 s, while Prometheus scrapes the gateway."""
    _, key = await open_session(client)
    while not stop.is_set():
        assert (await client.post("/v1/chat/completions", json=CHAT, headers=key)).status_code == 200
        wrong = await client.post("/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer x"})
        assert wrong.status_code == 401
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.2)


@pytest.mark.prometheus
async def test_the_dashboard_reads_true_means_sizes_and_versions_per_policy_from_a_real_prometheus(
    tmp_path: Path, servers: Servers, database_url: str
) -> None:
    panels = dashboard_queries()
    (reward,) = panels["Reward of finished episodes (mean, by policy)"]
    (batch_size,) = panels["Batch size (samples per learner step, mean)"]
    trained, _ = panels["Policy version by policy: trained vs served"]
    (gateway_requests,) = panels["Gateway requests per second by route and status"]
    (gateway_errors,) = panels["Gateway errors by kind (/s)"]
    gateway_p50, _ = panels["Gateway latency p50 / p95 by route (s)"]
    async with (
        services() as (runtimes, runner, observe),
        gateway_service(servers, database_url) as (url, gateway_port),
        httpx.AsyncClient(base_url=url, timeout=60) as client,
    ):
        targets = [f"127.0.0.1:{r.metrics_address[1]}" for r in runtimes if r.metrics_address is not None]
        targets.append(f"127.0.0.1:{gateway_port}")
        stop = asyncio.Event()
        work = [
            asyncio.create_task(outcomes_and_steps(runner, observe, stop)),
            asyncio.create_task(gateway_calls(client, stop)),
        ]
        try:
            with prometheus(tmp_path, targets) as base:

                async def ready() -> bool:
                    try:
                        means = await asyncio.to_thread(query, base, reward)
                        sizes = await asyncio.to_thread(query, base, batch_size)
                    except OSError:  # not listening yet
                        return False
                    errors = await asyncio.to_thread(query, base, gateway_errors)
                    finite = all(map(math.isfinite, [*means.values(), *errors.values()]))
                    return len(means) == 1 and len(sizes) == 2 and bool(errors) and finite

                await wait_until(ready, 120, "Prometheus to hold two scrapes of each service")
                # (approximate: a scrape may read the sum and the count either side of one more episode)
                # every reward was -1: the mean is -1 (the signed counter, which fell, gave -2)
                means = await asyncio.to_thread(query, base, reward)
                assert means == {(("policy", "a"),): pytest.approx(-1.0, abs=0.1)}
                # every step had 64 samples: 64 (the old panel's p50 interpolated inside a bucket: 48 then)
                sizes = await asyncio.to_thread(query, base, batch_size)
                assert sizes == {
                    key: pytest.approx(64.0, rel=0.05) for key in [(("policy", "a"),), (("policy", "b"),)]
                }
                old = (
                    "histogram_quantile(0.5, sum by (le) (rate(turnstile_trainer_batch_samples_bucket[5m])))"
                )
                (interpolated,) = (await asyncio.to_thread(query, base, old)).values()
                assert interpolated < 60
                # each policy's version on its own line, the second policy's too
                versions = await asyncio.to_thread(query, base, trained)
                assert versions == {(("policy", "a"),): 3.0, (("policy", "b"),): 7.0}
                # every query of the dashboard runs (the services absent here give no rows, not an error)
                for title, exprs in panels.items():
                    for expr in exprs:
                        assert isinstance(await asyncio.to_thread(query, base, expr), dict), title
                # the gateway's calls by route and status, its refusals by kind, its latency by route
                requests = await asyncio.to_thread(query, base, gateway_requests)
                chat = ("route", "/v1/chat/completions")
                assert {key for key in requests if chat in key} == {
                    (chat, ("status", "200")), (chat, ("status", "401"))
                }  # fmt: skip
                assert set(await asyncio.to_thread(query, base, gateway_errors)) == {
                    (("kind", "invalid_api_key"),)
                }
                latency = await asyncio.to_thread(query, base, gateway_p50)
                assert 0 < latency[(chat,)] < 60
                # every service's CPU and memory, on lines of their own
                for title in ("CPU by service (cores)", "Resident memory by service"):
                    (expr,) = panels[title]
                    assert len(await asyncio.to_thread(query, base, expr)) == len(targets), title
        finally:
            stop.set()
            await asyncio.gather(*work)


def test_every_metric_the_dashboard_names_is_documented() -> None:
    """docs/operations.md lists each metric a panel asks for (its type, labels and meaning)."""
    docs = (Path(__file__).resolve().parents[2] / "docs" / "operations.md").read_text()
    asked = {
        re.sub(r"_(bucket|sum|count)$", "", name)
        for exprs in dashboard_queries().values()
        for expr in exprs
        for name in re.findall(r"\b(?:turnstile|process)_\w+", expr)
    }
    assert asked
    assert sorted(name for name in asked if f"`{name}" not in docs) == []
