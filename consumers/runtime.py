"""The runtime every ``turnstile serve ...`` service runs on, so that services are wiring only.

- ``setup_logging()``: one line format with times for long-running services.
- ``run(main)``: a service's event loop: uvloop where installed (``asyncio.run`` otherwise).
- ``running(name)``: a service's life: a stop event that SIGINT and SIGTERM set (``stop_on_signals`` for
  other callbacks), and its health checks; the garbage collector tuned for a long-lived process
  (``tune_gc``).
- ``connect_nats`` / ``connect_store``: the first connect is retried with exponential backoff and jitter
  (``stamina``) for at most ``connect_for`` seconds, so a service started before its servers waits for
  them but one pointed at a wrong address says so instead of hanging; once connected, nats-py reconnects
  on its own forever and the event store retries its appends (``retry_for``).
- Health and metrics: a service registers named checks and Prometheus metrics on its ``Runtime``
  (``counter``/``gauge``: values read from the service's own counters when scraped; ``histogram``: observed
  as things happen; ``poll``: a value fetched every few seconds, such as a lag read from the database).
  With a metrics port (``--metrics-port``), ``running`` serves them over HTTP on ``--metrics-host``
  (127.0.0.1 unless a container's own address must be reached): ``/metrics`` in Prometheus' text format,
  ``/health`` as JSON (200 healthy, 503 not). Every service gets ``turnstile_service_healthy``,
  ``turnstile_service_info`` and prometheus_client's ``process_*`` metrics (CPU seconds, resident memory,
  open files); the endpoint is here, not in each service.

stamina rather than tenacity directly: it is tenacity with production defaults (jittered exponential
backoff, a bound on time and attempts) and typed async retry contexts, which is all a connect needs.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import random
import signal
import threading
import time
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Coroutine,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
)
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Final, Protocol, TypeVar

import nats
import stamina
from nats.aio.client import Client as NatsConnection
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pipeline.episodes import RunnerLease, close_abandoned_episodes, recover_abandoned_episodes
from pipeline.errors import ConfigError
from pipeline.inference import NatsLLMClient
from pipeline.log import DatabaseProbe, EventStore, is_connection_error
from pipeline.settings import nats_inbox_prefix, nats_servers

log = logging.getLogger(__name__)
# stamina logs a bare "stamina.retry_scheduled" per retry; _retrying's own line names the server instead.
stamina.instrumentation.set_on_retry_hooks([])

LATENCY_BUCKETS: Final = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
"""Seconds: from a millisecond (an instant backend) to the minutes of a long generation."""
METRICS_HOST: Final = "127.0.0.1"
"""Where ``/metrics`` listens unless told: this machine only. A container's Prometheus reaches a service
at the container's address, so docker-compose.yml passes ``--metrics-host 0.0.0.0``."""
CONNECT_FOR: Final = 60.0
"""Seconds a service keeps trying to reach NATS or PostgreSQL at start before it gives up."""


def setup_logging(level: int = logging.INFO) -> None:
    """Log lines with times, for long-running services."""
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


@contextlib.contextmanager
def stop_on_signals(callback: Callable[[], object]) -> Iterator[None]:
    """SIGINT and SIGTERM call ``callback`` in the running loop while the block runs (then the handlers
    are removed: a second Ctrl-C after the block behaves as Python's default)."""
    loop = asyncio.get_running_loop()
    handled = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):  # not the main thread, or no signals
            loop.add_signal_handler(sig, callback)
            handled.append(sig)
    try:
        yield
    finally:
        for sig in handled:
            loop.remove_signal_handler(sig)


HealthCheck = Callable[[], bool]
Reading = Callable[[], float | dict[tuple[str, ...], float]]
"""A metric's value when scraped: one number, or a number per tuple of label values."""


class _ReadAtScrape(Collector):
    """Counters and gauges whose values the service already keeps: read when Prometheus scrapes."""

    def __init__(self) -> None:
        self.metrics: list[tuple[str, str, str, Sequence[str], Reading]] = []

    def collect(self) -> Iterable[Metric]:
        for kind, name, documentation, labels, read in self.metrics:
            family: CounterMetricFamily | GaugeMetricFamily
            if kind == "counter":
                family = CounterMetricFamily(name, documentation, labels=labels)
            else:
                family = GaugeMetricFamily(name, documentation, labels=labels)
            try:
                value = read()
            except Exception:
                log.exception("metric %s could not be read", name)
                continue
            values = value if isinstance(value, dict) else {(): value}
            for label_values, number in values.items():
                if number is not None:
                    family.add_metric(list(label_values), float(number))
            yield family


class Outages:
    """One server's outages as one service sees them (PostgreSQL's, NATS's): each logged once as it begins
    and once as it ends, and counted, however many of the service's connections and tasks notice it."""

    def __init__(self, service: str, server: str) -> None:
        self.service, self.server = service, server
        self.count = 0
        self._since: float | None = None

    @property
    def ongoing(self) -> bool:
        return self._since is not None

    def down(self, reason: str, then: str) -> None:
        """The server went away (``reason``: one line); ``then``: what the service does meanwhile."""
        if self._since is None:
            self._since = time.monotonic()
            self.count += 1
            log.warning("%s: %s; %s", self.service, reason, then)

    def up(self, then: str) -> None:
        """The server answers again (nothing if no outage was seen)."""
        if self._since is not None:
            away, self._since = time.monotonic() - self._since, None
            log.warning("%s: %s is back after %.1f s; %s", self.service, self.server, away, then)


@dataclass
class Runtime:
    """One running service: its name, the event that stops it, its health checks and its metrics, and the
    outages of its servers (``database``, ``nats``; ``turnstile_database_outages_total`` and
    ``turnstile_nats_outages_total``)."""

    name: str
    stop: asyncio.Event
    checks: dict[str, HealthCheck] = field(default_factory=dict)
    registry: CollectorRegistry = field(default_factory=lambda: CollectorRegistry(auto_describe=True))
    metrics_address: tuple[str, int] | None = None  # where /metrics and /health are served, once started
    _read: _ReadAtScrape = field(default_factory=_ReadAtScrape)
    _polls: list[asyncio.Task[None]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.database = Outages(self.name, "PostgreSQL")
        self.nats = Outages(self.name, "NATS")
        self.registry.register(self._read)
        # CPU seconds, resident and virtual memory, open files and start time, read from /proc at each scrape
        # (Linux; elsewhere the collector serves nothing)
        ProcessCollector(registry=self.registry)
        self.gauge(
            "turnstile_service_healthy", "1 when every health check of the service passes", self._healthy
        )
        self.gauge("turnstile_service_info", "the service's name", lambda: {(self.name,): 1.0}, ["service"])
        self._count(self.database, "database", "restarted, killed, unreachable, its disk full")
        self._count(self.nats, "nats", "restarted, killed, unreachable")

    def _count(self, outages: Outages, what: str, how: str) -> None:
        self.counter(
            f"turnstile_{what}_outages_total",
            f"times {outages.server} went away under this service ({how}), which waited for it and went on",
            lambda: outages.count,
        )

    def check(self, name: str, healthy: HealthCheck) -> None:
        """Register a health check (e.g. "nats": the connection is up)."""
        self.checks[name] = healthy

    def health(self) -> dict[str, Any]:
        """``{"service": name, "healthy": bool, "checks": {name: bool}}``: what a health endpoint serves."""
        results = {}
        for name, healthy in self.checks.items():
            try:
                results[name] = bool(healthy())
            except Exception:
                log.exception("health check %s failed", name)
                results[name] = False
        return {"service": self.name, "healthy": all(results.values()), "checks": results}

    def _healthy(self) -> float:
        return 1.0 if self.health()["healthy"] else 0.0

    def counter(self, name: str, documentation: str, read: Reading, labels: Sequence[str] = ()) -> None:
        """A counter the service keeps itself (``read`` returns its total so far), read when scraped."""
        self._read.metrics.append(("counter", name.removesuffix("_total"), documentation, labels, read))

    def gauge(self, name: str, documentation: str, read: Reading, labels: Sequence[str] = ()) -> None:
        """A value read when scraped (a policy version, a queue's depth)."""
        self._read.metrics.append(("gauge", name, documentation, labels, read))

    def histogram(
        self, name: str, documentation: str, buckets: Sequence[float], labels: Sequence[str] = ()
    ) -> Histogram:
        """A histogram the service observes into as things happen (latencies, sizes)."""
        return Histogram(name, documentation, labels, registry=self.registry, buckets=buckets)

    def poll(
        self, name: str, documentation: str, every: float, fetch: Callable[[], Awaitable[float]]
    ) -> None:
        """A gauge fetched every ``every`` seconds while the service runs (a database query: lag, depth);
        absent until the first fetch succeeds, and kept at its last value when a fetch fails."""
        gauge = Gauge(name, documentation, registry=self.registry)

        async def refresh() -> None:
            while not self.stop.is_set():
                try:
                    gauge.set(await fetch())
                except Exception as error:
                    log.warning("metric %s: %s", name, str(error).splitlines()[0] if str(error) else error)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.stop.wait(), every)

        self.beside(refresh())

    def beside(self, work: Coroutine[Any, Any, None]) -> None:
        """Run ``work`` as a task while the service runs (cancelled at its end, as the polls are)."""
        self._polls.append(asyncio.create_task(work))

    async def cancel_beside(self) -> None:
        """Cancel what runs beside the service (``beside``, ``poll``) and wait for it to end."""
        for task in self._polls:
            task.cancel()
        await asyncio.gather(*self._polls, return_exceptions=True)
        self._polls.clear()

    def scrape(self) -> bytes:
        return generate_latest(self.registry)


class _Endpoint(BaseHTTPRequestHandler):
    runtime: Runtime  # set on the subclass made per server

    def do_GET(self) -> None:
        path = self.path.split("?")[0]
        if path == "/metrics":
            self._send(200, CONTENT_TYPE_LATEST, self.runtime.scrape())
        elif path in ("/health", "/healthz"):
            health = self.runtime.health()
            self._send(200 if health["healthy"] else 503, "application/json", json.dumps(health).encode())
        else:
            self._send(404, "text/plain; charset=utf-8", b"/metrics or /health\n")

    def _send(self, status: int, content_type: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes every few seconds are not news."""


@contextlib.contextmanager
def serve_metrics(runtime: Runtime, host: str, port: int) -> Iterator[None]:
    """``/metrics`` and ``/health`` on a thread of their own: a scrape never waits for the event loop."""
    handler = type("Endpoint", (_Endpoint,), {"runtime": runtime})
    try:
        server = ThreadingHTTPServer((host, port), handler)
    except OSError as error:
        raise ConfigError(f"cannot serve metrics on {host}:{port}: {error.strerror or error}") from None
    server.daemon_threads = True
    runtime.metrics_address = (host, server.server_address[1])
    thread = threading.Thread(target=server.serve_forever, name=f"metrics {runtime.name}", daemon=True)
    thread.start()
    log.info("metrics on http://%s:%d/metrics, health on /health", host, server.server_address[1])
    try:
        yield
    finally:
        server.shutdown()
        server.server_close()


class Served(Protocol):
    """An HTTP server that runs in the background (``pipeline.gateway.HttpServer``)."""

    async def wait(self) -> None: ...

    async def stop(self) -> None: ...


async def serve_until_stopped(server: Served, stop: asyncio.Event) -> None:
    """Wait until ``stop`` is set or ``server`` ends by itself, then stop it (which raises if it crashed)."""
    stopping = asyncio.create_task(stop.wait())
    serving = asyncio.create_task(server.wait())
    try:
        await asyncio.wait({stopping, serving}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiting in (stopping, serving):
            waiting.cancel()
        await asyncio.gather(stopping, serving, return_exceptions=True)
        await server.stop()


@contextlib.asynccontextmanager
async def running(
    name: str,
    *,
    stop: asyncio.Event | None = None,
    metrics_port: int | None = None,
    metrics_host: str = METRICS_HOST,
) -> AsyncIterator[Runtime]:
    """The service's runtime for the block: ``runtime.stop`` is set by SIGINT, SIGTERM or the caller. With
    ``metrics_port`` (0: a free one) its metrics and health are served over HTTP while the block runs."""
    runtime = Runtime(name, stop or asyncio.Event())
    tune_gc()
    with stop_on_signals(runtime.stop.set), contextlib.ExitStack() as stack:
        if metrics_port is not None:
            stack.enter_context(serve_metrics(runtime, metrics_host, metrics_port))
        try:
            yield runtime
        finally:
            await runtime.cancel_beside()


_Result = TypeVar("_Result")


def run(main: Coroutine[Any, Any, _Result]) -> _Result:
    """``asyncio.run(main)`` on uvloop where it is installed (a dependency except on Windows), else on
    asyncio's own loop.

    Why uvloop: a turn is a handful of socket reads and writes and task switches in each process, and
    uvloop does those in C (docs/benchmarks.md, "NATS overhead", has the measured difference)."""
    try:
        import uvloop
    except ImportError:  # Windows
        return asyncio.run(main)
    return uvloop.run(main)


GC_GEN0_THRESHOLD: Final = 50_000
"""Allocations between young-generation collections (CPython's default is 700). A young collection walks
every young object still alive, and in a runner nearly all are: its open episodes' coroutines, models and
their field sets. Rarer collections each walk more, but far fewer objects in all; the price is a longer
pause each (the figures: docs/benchmarks.md, "The collector")."""
_gc_tuned = False


def tune_gc() -> None:
    """Once per process, when a service has started: ``gc.freeze()`` what exists by then (modules, classes,
    the backend) and collect the young generation less often.

    Why: a runner with a thousand open episodes spent a third of its CPU in the collector, most of it in
    full collections that walked the objects made at import time, which are never freed, and then much of
    the rest in young collections walking its open episodes (docs/benchmarks.md, "The collector"). Frozen
    objects are never collected, so only what is there at start is frozen; a cycle that becomes garbage
    later is collected as ever, a little later with the higher threshold."""
    global _gc_tuned
    if _gc_tuned:
        return
    _gc_tuned = True
    gc.freeze()
    young, middle, old = gc.get_threshold()
    gc.set_threshold(max(young, GC_GEN0_THRESHOLD), middle, old)


async def connect_nats(
    url: str,
    *,
    stop: asyncio.Event | None = None,
    connect_for: float = CONNECT_FOR,
    runtime: Runtime | None = None,
) -> NatsConnection | None:
    """A NATS connection that reconnects forever once made. The first connect is retried with jittered
    backoff for ``connect_for`` seconds (0: one attempt; then ``ConfigError``, one line); None if ``stop``
    is set first. With ``runtime``, each time the connection is lost is an outage of its ``nats``."""

    made: list[NatsConnection] = []
    last_error: list[Exception] = []

    async def log_error(error: Exception) -> None:
        # before the first connect, a failed attempt is told once by _retrying, not by nats-py per server
        if made:
            await _log_nats_error(error)
        else:
            last_error[:] = [error]

    lost, back = nats_outages(
        runtime.nats if runtime is not None else None, lambda: made[0] if made else None
    )

    async def attempt() -> NatsConnection:
        # nats-py's own first connect never gives up when reconnects are unlimited (and has no jitter), so
        # each attempt allows one reconnect only; once connected, reconnecting is unlimited.
        try:
            connection = await nats.connect(
                nats_servers(url),
                max_reconnect_attempts=1,
                reconnect_time_wait=0.1,
                error_cb=log_error,
                disconnected_cb=lost,
                reconnected_cb=back,
                inbox_prefix=nats_inbox_prefix(url),
            )
        except nats.errors.NoServersError as error:
            if last_error:  # "no servers available" says less than why the last one failed
                raise ConnectionError(str(last_error[-1])) from error
            raise
        connection.options["max_reconnect_attempts"] = -1
        connection.options["reconnect_time_wait"] = 0.5
        made.append(connection)
        return connection

    return await _first_connect(attempt, f"NATS at {url}", "TURNSTILE_NATS_URL", stop, connect_for)


NatsCallback = Callable[[], Awaitable[None]]


def nats_outages(
    outages: Outages | None, connection: Callable[[], NatsConnection | None]
) -> tuple[NatsCallback, NatsCallback]:
    """nats-py's ``disconnected_cb`` and ``reconnected_cb`` for ``connection()``: a lost connection that
    nats-py is reconnecting begins an outage of ``outages``, the reconnect ends it (a close is no outage)."""

    async def lost() -> None:
        current = connection()
        if outages is not None and current is not None and current.is_reconnecting:
            outages.down("NATS unreachable (the connection was lost)", "reconnecting; its work waits")

    async def back() -> None:
        if outages is not None:
            outages.up("reconnected, its subscriptions in place again")

    return lost, back


async def _log_nats_error(error: Exception) -> None:
    log.warning("nats: %s", error or type(error).__name__)


async def connect_store(
    url: str, *, stop: asyncio.Event | None = None, connect_for: float = CONNECT_FOR, **options: Any
) -> EventStore | None:
    """The event store, once PostgreSQL answers (retried like ``connect_nats``); None if stopped first."""

    async def attempt() -> EventStore:
        store = await EventStore.connect(url, **options)
        try:
            await store.head()  # a round trip: the server is up and the database exists
        except BaseException:
            await store.close()
            raise
        return store

    return await _first_connect(attempt, "PostgreSQL", "TURNSTILE_DATABASE_URL", stop, connect_for)


_Connection = TypeVar("_Connection")


async def _first_connect(
    attempt: Callable[[], Awaitable[_Connection]],
    what: str,
    setting: str,
    stop: asyncio.Event | None,
    connect_for: float,
) -> _Connection | None:
    connecting = asyncio.ensure_future(_retrying(attempt, what, setting, connect_for))
    if stop is None:
        return await connecting
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait({connecting, stopping}, return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    if not connecting.done():
        connecting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await connecting
        return None
    return connecting.result()


def _unreachable(error: Exception) -> bool:
    return is_connection_error(error) or isinstance(error, (nats.errors.Error, TimeoutError))


async def _retrying(
    attempt: Callable[[], Awaitable[_Connection]], what: str, setting: str, connect_for: float
) -> _Connection:
    """``attempt()`` until it connects, for ``connect_for`` seconds (0 or less: once): a command run by hand
    fails at once on "connection refused"; a service started before its servers waits for them."""
    try:
        if connect_for <= 0:
            return await attempt()
        async for retry in stamina.retry_context(
            on=_unreachable, attempts=None, timeout=connect_for, wait_initial=0.2, wait_max=5.0
        ):
            with retry:
                if retry.num > 1:
                    log.warning("cannot reach %s yet; retrying (attempt %d)", what, retry.num)
                return await attempt()
    except Exception as error:
        if not _unreachable(error):
            raise
        reason = (str(error) or type(error).__name__).splitlines()[0]
        tried = f"after {connect_for:g} s" if connect_for > 0 else "(tried once: --connect-timeout waits)"
        raise ConfigError(
            f"cannot reach {what} {tried} ({reason}); check that it runs and that {setting} points at it"
        ) from error
    raise AssertionError("unreachable: the retry loop returns or raises")


DISK_FULL: Final = "53100"
"""PostgreSQL's SQLSTATE for "could not extend file: No space left on device"."""
OUTAGE_WAIT_MAX: Final = 30.0
"""Seconds, at most, between a service's attempts to start again while PostgreSQL is away."""


def database_outage(error: BaseException) -> str | None:
    """One line saying why PostgreSQL cannot serve now (gone away, restarting, its disk full), or None when
    ``error`` is something else (a refused statement, a bug: those still end the service)."""
    original = getattr(error, "orig", None) or error
    first_line = (str(original) or type(original).__name__).splitlines()[0]
    if getattr(original, "sqlstate", None) == DISK_FULL:
        return f"PostgreSQL's disk is full ({first_line}): free space on the disk of its data directory"
    if is_connection_error(error):
        return f"PostgreSQL unreachable ({first_line})"
    return None


async def serve_through_outages(
    runtime: Runtime,
    serve: Callable[[Callable[[], None]], Awaitable[None]],
    *,
    wait_max: float = OUTAGE_WAIT_MAX,
) -> None:
    """Run ``serve`` until the service stops, starting it again whenever it ends with a database outage
    (a PostgreSQL restart, fast or kill -9, a lost connection, a full disk), so the service stays up and
    resumes from its checkpoint. ``serve(connected)`` calls ``connected()`` once it has reached the
    database: an outage is the time from a failure after that call to the next such call, logged once as it
    begins and once as it ends and counted (``runtime.database``); the attempts between wait with jittered
    exponential backoff up to ``wait_max`` seconds (or until the service is stopped)."""
    attempts = 0
    runtime.check("database", lambda: not runtime.database.ongoing)

    def connected() -> None:
        nonlocal attempts
        runtime.database.up("going on from the checkpoint")
        attempts = 0

    while not runtime.stop.is_set():
        try:
            await serve(connected)
            return
        except Exception as error:
            reason = database_outage(error)
            if reason is None:
                raise
        if runtime.database.ongoing:
            log.info("%s: still waiting for PostgreSQL: %s", runtime.name, reason)
        runtime.database.down(reason, "starting again once it answers")
        delay = min(wait_max, 0.2 * 2**attempts) * random.uniform(0.5, 1.0)
        attempts += 1
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(runtime.stop.wait(), delay)


DATABASE_WATCH_EVERY: Final = 1.0
"""Seconds between the round trips on which a service notices a PostgreSQL outage (``watch_database``)."""


def watch_database(runtime: Runtime, url: str, *, every: float = DATABASE_WATCH_EVERY) -> None:
    """Notice PostgreSQL's outages for a service whose work retries through them on its own (appends,
    leases, reads): a round trip every ``every`` seconds on a connection held open (``DatabaseProbe``), so
    that even a restart faster than that is seen. Each outage is logged as it begins and as it ends and
    counted (``runtime.database``); the "database" health check fails while it lasts."""
    runtime.check("database", lambda: not runtime.database.ongoing)
    probe = DatabaseProbe(url)

    async def watch() -> None:
        try:
            while not runtime.stop.is_set():
                try:
                    await probe.ping()
                    runtime.database.up("its work goes on")
                except TimeoutError:
                    runtime.database.down(
                        "PostgreSQL unreachable (no answer)", "its work waits for it and retries"
                    )
                except Exception as error:
                    reason = database_outage(error) or f"PostgreSQL refused the probe ({error})"
                    runtime.database.down(reason, "its work waits for it and retries")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(runtime.stop.wait(), every)
        finally:
            await probe.close()

    runtime.beside(watch())


# ---- what a service that records episodes needs (the runner and the gateway) ---------------------------


@dataclass(frozen=True)
class Connections:
    """Where the servers are, and how long a consumer's silence or a runner's lease may last."""

    database_url: str
    nats_url: str
    heartbeat_timeout: float = 15.0
    lease_timeout: float = 30.0
    connect_for: float = CONNECT_FOR
    """Seconds to keep trying to reach each server at start (0: once, as a command run by hand does)."""


@dataclass(frozen=True)
class EpisodeServices:
    store: EventStore
    connection: NatsConnection
    llm: NatsLLMClient
    lease: RunnerLease
    recovered: list[str]
    """Episodes that dead runners had left open, closed ``aborted`` at start."""


@contextlib.asynccontextmanager
async def episode_services(
    connections: Connections, *, recover: bool = False, runtime: Runtime | None = None
) -> AsyncIterator[EpisodeServices]:
    """The store, a NATS connection, an LLM client and a runner lease. Episodes left open by dead runners
    are closed first (``aborted``); with ``recover``, again every ``lease_timeout`` while the block runs.
    With a service's ``runtime``, the outages of both servers are watched and counted there."""
    store = await connect_store(connections.database_url, connect_for=connections.connect_for)
    assert store is not None  # None only when stopped, and no stop event was given
    if runtime is not None:
        watch_database(runtime, connections.database_url)
    try:
        connection = await connect_nats(
            connections.nats_url, connect_for=connections.connect_for, runtime=runtime
        )
        assert connection is not None
        llm = NatsLLMClient(connection, heartbeat_timeout=connections.heartbeat_timeout)
        try:
            recovered = await close_abandoned_episodes(store, lease_timeout=connections.lease_timeout)
            async with RunnerLease(store, interval=connections.lease_timeout / 6) as lease:
                every = connections.lease_timeout
                recovery = (
                    asyncio.create_task(
                        recover_abandoned_episodes(store, every=every, lease_timeout=every, lease=lease)
                    )
                    if recover
                    else None
                )
                try:
                    yield EpisodeServices(store, connection, llm, lease, recovered)
                finally:
                    if recovery is not None:
                        recovery.cancel()
                        with contextlib.suppress(asyncio.CancelledError):
                            await recovery
        finally:
            await llm.close()
            with contextlib.suppress(Exception):
                await connection.drain()
    finally:
        await store.close()


@contextlib.asynccontextmanager
async def policy_logs(
    urls: Mapping[str, str], services: EpisodeServices, connections: Connections
) -> AsyncIterator[dict[str, EventStore]]:
    """A store for each policy with a log of its own (TURNSTILE_DATABASE_URLS, docs/scale.md), by policy.

    Each of those databases gets what ``episode_services`` gives the default one: the episodes a stopped
    runner or gateway left open there closed ``aborted``, and a lease under ``services``' runner id (the id
    its sessions record wherever they are written), so that if this process dies its sessions in every log
    are closed by whoever starts next on that log. Policies that share a database share one store; one in
    the default database uses ``services.store``."""
    default = connections.database_url
    async with contextlib.AsyncExitStack() as stack:
        by_url: dict[str, EventStore] = {default: services.store}
        for url in dict.fromkeys(urls.values()):
            if url in by_url:
                continue
            store = await connect_store(url, connect_for=connections.connect_for)
            assert store is not None  # None only when stopped, and no stop event was given
            stack.push_async_callback(store.close)
            await close_abandoned_episodes(store, lease_timeout=connections.lease_timeout)
            lease = RunnerLease(store, runner_id=services.lease.runner_id, interval=services.lease.interval)
            await stack.enter_async_context(lease)
            by_url[url] = store
        yield {policy: by_url[url] for policy, url in urls.items()}
