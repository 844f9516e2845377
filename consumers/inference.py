"""Inference consumer: answers ``llm.<policy>.requests`` (queue group ``inference``) and its own
sticky subject ``llm.<policy>.requests.<consumer_id>``; loads a new version when ``policy.<policy>.versions``
names one that the log holds (checked through the inference login: ``pipeline.versions.VersionLog``), and at
start (and after a reconnect) the newest version in the log.

Run it with ``turnstile serve inference --policy NAME --backend torch --model DIR``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

from faststream import FastStream
from faststream.nats import NatsBroker, NatsMessage
from nats.aio.client import Client as NatsConnection
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from consumers.runtime import (
    LATENCY_BUCKETS,
    METRICS_HOST,
    Runtime,
    nats_outages,
    serve_metrics,
    tune_gc,
    watch_database,
)
from pipeline.errors import ConfigError
from pipeline.inference import (
    DEFAULT_BUDGET_BYTES,
    DEFAULT_RETRY_REPLIES,
    DEFAULT_RETRY_REPLY_BYTES,
    IN_FLIGHT_DEFAULT,
    QUEUE_GROUP,
    Backend,
    InferenceService,
    InFlight,
    RetryReplies,
    request_subject,
)
from pipeline.settings import nats_inbox_prefix
from pipeline.versions import VersionLog, versions_subject
from schemas import LLMResponse

BackendName = Literal["torch", "vllm", "scripted"]


@dataclass(frozen=True)
class InferenceConfig:
    nats_url: str
    policy: str
    backend: BackendName = "torch"
    model: Path | None = None
    consumer_id: str = ""
    max_in_flight: int = 1024
    max_batch: int = 16
    """torch backend: requests running at once (continuous batching)."""
    max_batch_tokens: int = 2048
    """torch backend: tokens fed in one step (a token per running request plus prefill; a longer prompt
    is prefilled in chunks)."""
    in_flight: InFlight = IN_FLIGHT_DEFAULT
    """vLLM: the requests in flight when a new version is loaded are restarted on it or drained (torch
    always drains: its running requests finish on the old version while admission pauses)."""
    heartbeat_interval: float = 5.0
    held_bytes: int = DEFAULT_BUDGET_BYTES
    retry_replies: int = DEFAULT_RETRY_REPLIES
    """Replies kept for answering a request sent again, newest first, at most this many ..."""
    retry_reply_bytes: int = DEFAULT_RETRY_REPLY_BYTES
    """... and at most these bytes together (``pipeline.inference.RetryReplies``)."""
    metrics_port: int | None = None  # /metrics and /health over HTTP (0: a free port)
    metrics_host: str = METRICS_HOST
    script: Path | None = (
        None  # torch backend: answer with this script's replies (pipeline/inference/script.py)
    )
    database_url: str | None = None
    """The log, where versions are checked before loading (the inference login reads only the view
    ``policy_versions``); None: the consumer serves its first weights and refuses every version."""


def default_consumer_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}".replace(".", "_")


def create_backend(config: InferenceConfig) -> Backend:
    if config.script is not None and config.backend != "torch":
        raise ConfigError(
            f"--script needs the torch backend (it scores the scripted replies), not {config.backend}"
        )
    if config.backend == "scripted":
        from pipeline.inference.backends.scripted import ScriptedBackend

        return ScriptedBackend()
    if config.model is None:
        raise ConfigError(
            f"the {config.backend} backend needs --model DIR (build one with `turnstile model init-tiny`)"
        )
    if config.backend == "vllm":
        from pipeline.inference.backends.vllm_backend import VllmBackend

        return VllmBackend(config.model, in_flight=config.in_flight)
    from pipeline.inference import Script
    from pipeline.inference.backends.torch_backend import TorchBackend

    script = Script.load(config.script) if config.script is not None else None
    return TorchBackend(
        config.model, max_batch=config.max_batch, max_batch_tokens=config.max_batch_tokens, script=script
    )


class RequestSubscriptions:
    """The request subjects, subscribed on the broker's nats-py connection directly.

    A FastStream subscriber costs about as much per request as a whole turn's overhead budget (measured
    in docs/benchmarks.md, "NATS overhead"); so the hot path is a plain
    nats-py callback that starts one task per request (many in flight), while FastStream still owns the
    connection, the lifecycle and the cold subscriptions.
    """

    def __init__(self, service: InferenceService, policy: str, consumer_id: str) -> None:
        self.service = service
        self.subjects = [(request_subject(policy), QUEUE_GROUP), (request_subject(policy, consumer_id), "")]
        self._connection: NatsConnection | None = None
        self._subscriptions: list[Subscription] = []
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self, connection: NatsConnection) -> None:
        self._connection = connection
        for subject, queue in self.subjects:
            self._subscriptions.append(await connection.subscribe(subject, queue=queue, cb=self._on_message))
        # A round trip to the server: once it returns, the server has the subscriptions, so a request sent
        # from any connection after start() finds this consumer (no "no responders" race).
        await connection.flush()

    async def stop(self) -> None:
        for subscription in self._subscriptions:
            await subscription.unsubscribe()
        self._subscriptions.clear()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=30)

    async def _on_message(self, message: Msg) -> None:
        task = asyncio.create_task(self._answer(message))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _answer(self, message: Msg) -> None:
        body = await self.service.handle(message.data, message.reply or None)
        if message.reply and self._connection is not None:
            await self._connection.publish(message.reply, body)


def create_app(
    config: InferenceConfig, backend: Backend | None = None
) -> tuple[FastStream, InferenceService]:
    backend = backend or create_backend(config)
    consumer_id = config.consumer_id or default_consumer_id()
    service: InferenceService | None = None
    catching_up: set[asyncio.Task[None]] = set()

    async def catch_up() -> None:
        # Called once the versions subscription is confirmed (a flush): a version published before it is in
        # the log, one published after it arrives on the subscription; the service keeps the newer.
        if service is not None:
            await service.catch_up()

    runtime = Runtime(f"inference {consumer_id}", asyncio.Event())
    lost, back = nats_outages(runtime.nats, lambda: broker._connection)

    async def reconnected() -> None:
        await back()
        # Versions published while disconnected were not heard. A task, not awaited: this runs on nats-py's
        # reconnect path, where an error would count as a failed reconnect.
        task = asyncio.create_task(catch_up())
        catching_up.add(task)
        task.add_done_callback(catching_up.discard)

    # Per-message logs at DEBUG: at thousands of turns per second INFO lines would cost more than the work.
    broker = NatsBroker(
        config.nats_url,
        max_reconnect_attempts=-1,
        reconnect_time_wait=1,
        log_level=logging.DEBUG,
        inbox_prefix=nats_inbox_prefix(config.nats_url),
        disconnected_cb=lost,
        reconnected_cb=reconnected,
    )

    async def publish(subject: str, body: bytes, headers: dict[str, str]) -> None:
        await broker.publish(body, subject, headers=headers)

    service = InferenceService(
        backend,
        policy=config.policy,
        consumer_id=consumer_id,
        publish=publish,
        heartbeat_interval=config.heartbeat_interval,
        held_bytes=config.held_bytes,
        retry_replies=RetryReplies(config.retry_replies, config.retry_reply_bytes),
        versions=VersionLog(config.database_url) if config.database_url else None,
    )
    if config.database_url is None:
        logging.getLogger(__name__).warning(
            "no database URL: serving the first weights only (every published version is refused until "
            "TURNSTILE_DATABASE_URL names the inference login, which checks versions against the log)"
        )
    instrument(runtime, service)
    runtime.check("nats", lambda: broker._connection is not None and broker._connection.is_connected)
    metrics = contextlib.ExitStack()

    requests = RequestSubscriptions(service, config.policy, consumer_id)

    @broker.subscriber(versions_subject(config.policy))
    async def on_version(message: NatsMessage) -> None:
        await service.on_version(message.body)

    app = FastStream(broker)

    @app.after_startup
    async def subscribe_requests() -> None:
        tune_gc()  # the backend is loaded: frozen with the rest
        service.max_payload = broker.connection.max_payload
        await requests.start(broker.connection)  # flushes: every subscription, versions too, is in place
        await catch_up()
        if config.database_url is not None:
            watch_database(runtime, config.database_url)  # the log its versions are checked against
        if config.metrics_port is not None:
            metrics.enter_context(serve_metrics(runtime, config.metrics_host, config.metrics_port))

    @app.on_shutdown
    async def stop_requests() -> None:
        runtime.stop.set()
        await runtime.cancel_beside()
        await requests.stop()
        await backend.close()
        metrics.close()

    return app, service


def instrument(runtime: Runtime, service: InferenceService) -> None:
    """The consumer's metrics: requests, tokens and errors counted, latencies observed per reply."""
    latency = runtime.histogram(
        "turnstile_inference_latency_seconds",
        "seconds from a request's arrival: queued (until generation started), first_token, total",
        LATENCY_BUCKETS,
        ["stage"],
    )
    completion = runtime.histogram(
        "turnstile_inference_completion_tokens",
        "completion tokens per reply",
        (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192),
    )
    tokens = {"prompt": 0, "completion": 0}
    # every code at 0 from the start: a rate over a series that appears only with its first error misses it
    errors: Counter[str] = Counter(dict.fromkeys(("invalid_request", "engine_error", "payload_too_large"), 0))
    restarted = [0]

    # The labelled series looked up once: labels() takes a lock and builds a key on every call.
    queued, first_token, total = (latency.labels(stage) for stage in ("queued", "first_token", "total"))

    def on_reply(response: LLMResponse) -> None:
        queued.observe(response.timings.queued_ms / 1000)
        first_token.observe(response.timings.first_token_ms / 1000)
        total.observe(response.timings.total_ms / 1000)
        completion.observe(len(response.completion_token_ids))
        # the whole prompt: the reply leaves out the prefix the requester sent or named
        tokens["prompt"] += response.prompt_prefix_tokens + len(response.prompt_token_ids)
        tokens["completion"] += len(response.completion_token_ids)
        if response.timings.restarted_ms:
            restarted[0] += 1

    def on_error(code: str) -> None:
        errors[code] += 1

    service.on_reply, service.on_error = on_reply, on_error
    runtime.counter("turnstile_inference_requests_total", "replies sent", lambda: service.requests_served)
    runtime.counter(
        "turnstile_inference_tokens_total",
        "token ids in replies: prompt (as the engine saw it) and completion",
        lambda: {(kind,): float(n) for kind, n in tokens.items()},
        ["kind"],
    )
    runtime.counter(
        "turnstile_inference_errors_total",
        "requests answered with an error, by code (invalid_request, engine_error, payload_too_large ...)",
        lambda: {(code,): float(n) for code, n in errors.items()},
        ["code"],
    )
    runtime.counter(
        "turnstile_inference_versions_refused_total",
        "policy version messages not loaded, by reason (not_in_log, checkpoint_mismatch, log_unreachable, "
        "no_log, other_policy, unreadable)",
        lambda: {(reason,): float(n) for reason, n in service.versions_refused.items()},
        ["reason"],
    )
    runtime.counter(
        "turnstile_inference_restarted_total",
        "replies whose request a new policy version cut short and that were run again on it "
        "(--swap-in-flight restart): their tokens of the old version dropped",
        lambda: restarted[0],
    )
    runtime.gauge("turnstile_inference_in_flight", "requests being generated now", lambda: service.in_flight)
    kept(runtime, "held", "turns", service.held, "recent turns kept for continuing requests", "--held-mib")
    kept(
        runtime,
        "retry",
        "replies",
        service.retry_replies,
        "replies kept for answering a request sent again",
        "--retry-replies and --retry-replies-mib",
    )
    runtime.gauge(
        "turnstile_inference_policy_version",
        "the policy version whose weights answer requests, by policy",
        lambda: {(service.policy,): service.backend.policy_version},
        ["policy"],
    )


class Kept(Protocol):
    """Memory a consumer keeps within bounds (``HeldPrefixes``, ``RetryReplies``)."""

    bytes: int
    evicted: int

    def __len__(self) -> int: ...


def kept(runtime: Runtime, name: str, unit: str, memory: Kept, what: str, bounds: str) -> None:
    """``turnstile_inference_<name>_bytes`` and ``_<name>_<unit>`` (gauges: what ``memory`` holds) and
    ``_<name>_evicted_total`` (dropped to stay within ``bounds``, the options that set them)."""
    prefix = f"turnstile_inference_{name}"
    runtime.gauge(f"{prefix}_bytes", f"bytes of the {what} (at most {bounds})", lambda: memory.bytes)
    runtime.gauge(f"{prefix}_{unit}", f"the {what}", memory.__len__)
    runtime.counter(
        f"{prefix}_evicted_total",
        f"{what}: dropped to stay within {bounds} (least recently used first)",
        lambda: memory.evicted,
    )
