"""Per-turn cost of the HTTP gateway beside the in-process clients, on the same instant backend.

Every path records every turn the same way (``EpisodeSession.chat``: the request over NATS to a scripted
consumer in a process of its own, the ``TurnCompleted`` appended to PostgreSQL before the reply returns);
what differs is how the agent's call reaches the session:

- ``llm.chat`` (the baseline): ``await session.chat(messages)`` in the benchmark process.
- ``llm.openai()``: the OpenAI SDK served in process (``pipeline/dialects/openai.py``'s httpx transport):
  the SDK and the OpenAI translation on top of the baseline.
- ``gateway``: the OpenAI SDK in the benchmark process, over HTTP (keep-alive connections, one pooled
  client) to the gateway app (``pipeline/gateway/app.py`` on uvicorn) in a process of its own, which holds the
  sessions, their NATS client and the event store; sessions are started with ``POST /admin/sessions``.
- ``gateway-lean``: the same gateway and the same JSON body, posted by a minimal HTTP/1.1 client
  (``LeanHttp``: asyncio streams, one keep-alive connection per worker) instead of the SDK, whose own CPU
  (~3 ms a turn) shares the machine's cores with the gateway and bounds what the ``gateway`` path can reach:
  this path measures the gateway's own throughput.
- ``floor``: the lean client against ``FloorApp`` in a process of its own, on the same uvicorn, event loop
  and servers: per turn it does only the I/O a recording gateway cannot avoid (the HTTP request, one NATS
  request-reply to the same consumer, one fsync'd autocommit INSERT of the request and reply into a table,
  the HTTP response), with no dialect, session, event or log logic. Its CPU per turn is the floor under any
  Python gateway built on these libraries on this machine: what the gateway spends above it is its own
  logic, the rest is the three waits, their wake-ups and the libraries' I/O.

The lean paths and the floor run with their servers up together, in ``--rounds`` rounds (default 5): in
each, every one of them runs its share of the turns at the level in turn, and the CPU is summed over the
rounds, so that a drift of the machine's speed weighs on each alike (the other paths run one after the
other).

At each concurrency level (``--levels``, default 1 and 16) that many workers run episodes back to back,
each episode ``--turns-per-episode`` turns that extend the conversation (reply + a new user message, so
turns continue token-exactly), until ``--turns`` timed turns are done; ``--warmup`` turns go first. A
turn's latency runs from the call to the parsed reply; turns/s is timed turns over wall-clock time
(starting and ending episodes included). "x chat" divides by the baseline at the same level: latency
(p50) and throughput. "CPU us/turn" is the user + system CPU each process spent per timed turn (from
/proc, Linux only, 10 ms ticks: meaningful over a second or more); on a small machine the processes
compete for cores, so read the ratios, measured side by side in one run.

Then a long conversation (``--long-turns``, default 30, growing to ``--long-tokens``, default 30,000): one
episode at a time through the gateway, each turn a new ~1,000-token user message after the whole history
(sent again by the client, as agents do), on a consumer whose prompt is one token per 4 bytes of text, so
the recorded prompt grows as a real one would. For each dialect (``--long-dialects``: chat completions with
the OpenAI SDK, the Responses API with its whole input, Anthropic Messages with the anthropic SDK) it prints
the gateway's CPU per turn at turn 1 and at the last turn (the median over ``--long-episodes`` episodes, from
``/proc/<pid>/task/*/schedstat``: nanoseconds, not ticks) and their ratio: a turn's cost must not grow with
the history it carries.

``--before DIR`` runs a second gateway from another checkout (``git archive main | tar -x -C DIR``) beside
this one, in the same run, on the same servers and consumer: "gateway@before" rows, and the long
conversation for both; ``--before-without httptools`` leaves out what that checkout's install lacks.

``--shared`` adds ``gateway-shared`` rows: the same gateway as a replica that shares its sessions
(``--shared-sessions``, a KV bucket of its own; one replica, so every call finds its session current).

``--unwritten`` (an ablation) adds ``gateway-lean-unwritten`` rows: the same gateway on a store whose appends
cost nothing (``common.UnwrittenStore``: nothing validated, encoded or written), in the interleaved rounds
with the others. Its CPU per turn is what the gateway would cost if recording were free: against the floor,
the least any store could bring the ratio to.

``--in-process`` measures only what the gateway adds: the long conversation through ``llm.chat`` and through
the gateway app called straight through ASGI, in one process with an in-memory log and an instant client
(no servers, no sockets: ``time.process_time`` per turn), for this checkout and ``--before``'s.
``--profile PREFIX`` writes a CPU-time cProfile of each gateway process (``PREFIX.<pid>``) and of the
benchmark process while it runs the ``llm.chat`` path (``PREFIX.llm.chat``: the recording work in process).

Every process runs on the services' event loop (uvloop, ``consumers.runtime.run``) with their garbage
collector setting (``tune_gc``), as ``turnstile serve gateway`` does: every path alike.

Servers: ``TURNSTILE_DATABASE_URL`` and ``TURNSTILE_NATS_URL``, or embedded ones in a temporary directory;
the run gets a migrated scratch database of its own, dropped at the end.

    python bench/gateway.py                       # defaults: --levels 1,16 --turns 600 (a few minutes)
    python bench/gateway.py --levels 1 --turns 300
    python bench/gateway.py --before /tmp/main-tree --before-without httptools
    python bench/gateway.py --in-process --before /tmp/main-tree
    python bench/gateway.py --paths gateway-lean,floor --long-episodes 0 --unwritten   # the ablation
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import httpx
import openai
from rich.console import Console
from rich.table import Table

from consumers.runtime import run, tune_gc
from pipeline.episodes import EpisodeSession
from pipeline.inference.backends import Generation
from pipeline.inference.backends.scripted import ScriptedBackend
from pipeline.inference.client import NatsLLMClient, request_subject
from pipeline.log import EventStore

from common import (
    READY_TIMEOUT_S,
    CpuMeter,
    Processes,
    Servers,
    UnwrittenStore,
    cpu_text,
    machine,
    note,
    percentile,
    profiled,
    scratch_database,
    servers,
    stop_child,
    summary,
    wait_for_stdin_eof,
)

POLICY = "bench"
LONG_POLICY = "benchlong"
LONG_DIALECTS = ("chat", "responses", "messages")
BYTES_PER_TOKEN = 4
PROFILE_ENV = "TURNSTILE_BENCH_PROFILE"
"""A path prefix: each gateway process writes its cProfile statistics to <prefix>.<pid> when it stops
(``--profile``); read them with ``python -m pstats``."""
ADMIN_KEY = "bench-admin-" + uuid.uuid4().hex
PATHS = ("llm.chat", "llm.openai()", "gateway", "gateway-lean", "floor")
BASELINE = "llm.chat"
FLOOR_TARGETS = {1: 2.0, 16: 1.25}
"""The gateway process's CPU per turn over the floor's (issue 35), by concurrency."""
MAX_TOKENS = 6
SCRIPT = str(Path(__file__).resolve())

console = Console(width=None if sys.stdout.isatty() else 150)


@dataclass(frozen=True, slots=True)
class Result:
    path: str
    concurrency: int
    latencies_ms: list[float]
    seconds: float
    cpu_us: dict[str, float]

    @property
    def rate(self) -> float:
        return len(self.latencies_ms) / self.seconds

    def percentile(self, q: float) -> float:
        return percentile(self.latencies_ms, q)

    def cpu_text(self) -> str:
        return cpu_text(self.cpu_us)


# --- an episode on each path ---------------------------------------------------------------------


class Episode:
    """One episode on one path: ``start()``, ``turn(messages) -> assistant message``, ``end()``."""

    async def start(self) -> None: ...

    async def turn(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        raise NotImplementedError

    async def end(self) -> None: ...


class ChatEpisode(Episode):
    def __init__(self, store: EventStore, llm: NatsLLMClient) -> None:
        self.session = EpisodeSession(store, llm, policy=POLICY, agent="bench.gateway")

    async def start(self) -> None:
        await self.session.start()

    async def turn(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        reply = await self.session.chat(messages, sampling={"max_tokens": MAX_TOKENS})
        return reply.message.model_dump(exclude_none=True)

    async def end(self) -> None:
        await self.session.finish("done")


class InProcessOpenAIEpisode(ChatEpisode):
    async def start(self) -> None:
        await super().start()
        self.client = self.session.llm.openai()

    async def turn(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        completion = await self.client.chat.completions.create(
            model=POLICY, messages=messages, max_tokens=MAX_TOKENS
        )
        return completion.choices[0].message.model_dump(exclude_none=True)


class GatewayEpisode(Episode):
    def __init__(self, admin: httpx.AsyncClient, client: openai.AsyncOpenAI) -> None:
        self.admin, self.base_client = admin, client

    async def start(self) -> None:
        response = await self.admin.post("/admin/sessions", json={"policy": POLICY, "agent": "bench.gateway"})
        response.raise_for_status()
        session = response.json()
        self.session_id = session["session_id"]
        self.client = self.base_client.with_options(api_key=session["api_key"])

    async def turn(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        completion = await self.client.chat.completions.create(
            model=POLICY, messages=messages, max_tokens=MAX_TOKENS
        )
        return completion.choices[0].message.model_dump(exclude_none=True)

    async def end(self) -> None:
        (await self.admin.post(f"/admin/sessions/{self.session_id}/end", json={})).raise_for_status()


IDLE_RECONNECT_S: Final = 1.0
"""A ``LeanHttp`` connection idle this long is opened again (uvicorn closes one idle for 5 s): the
interleaved rounds leave each path's connections idle while the others run."""


class LeanHttp:
    """A minimal HTTP/1.1 client on one keep-alive connection: ``post(path, body, key)`` sends the JSON body
    and returns the parsed JSON reply. No pooling, redirects, retries or streaming: the least a client can
    do, so that what the bench process spends is not what bounds the gateway's turns/s."""

    def __init__(self, url: str) -> None:
        self.host, _, port = url.removeprefix("http://").partition(":")
        self.port = int(port)
        self.streams: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        self.used_at = 0.0

    async def post(self, path: str, body: dict[str, Any], key: str) -> Any:
        if time.monotonic() - self.used_at > IDLE_RECONNECT_S:  # the server may have closed it by now
            await self.close()
        if self.streams is None:
            self.streams = await asyncio.open_connection(self.host, self.port)
        reader, writer = self.streams
        raw = json.dumps(body).encode()
        writer.write(
            f"POST {path} HTTP/1.1\r\nhost: {self.host}\r\nauthorization: Bearer {key}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(raw)}\r\n\r\n".encode()
            + raw
        )
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").lower()
        status = int(head.split(" ", 2)[1])
        length = int(head.partition("content-length:")[2].partition("\r\n")[0])
        reply = json.loads(await reader.readexactly(length))
        self.used_at = time.monotonic()
        if not 200 <= status < 300:
            raise RuntimeError(f"POST {path}: {status} {reply}")
        return reply

    async def close(self) -> None:
        """Close the connection (the next ``post`` opens one again)."""
        if self.streams is not None:
            self.streams[1].close()
            await self.streams[1].wait_closed()
            self.streams = None


class LeanGatewayEpisode(Episode):
    """The gateway episode with its session's start, turns and end posted by ``LeanHttp`` (one per worker)
    instead of the SDK and httpx."""

    def __init__(self, client: LeanHttp) -> None:
        self.http = client

    async def start(self) -> None:
        body = {"policy": POLICY, "agent": "bench.gateway"}
        session = await self.http.post("/admin/sessions", body, ADMIN_KEY)
        self.session_id, self.key = session["session_id"], session["api_key"]

    async def turn(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        body = {"model": POLICY, "messages": messages, "max_tokens": MAX_TOKENS}
        completion = await self.http.post("/v1/chat/completions", body, self.key)
        message: dict[str, Any] = completion["choices"][0]["message"]
        return {k: v for k, v in message.items() if v is not None}

    async def end(self) -> None:
        await self.http.post(f"/admin/sessions/{self.session_id}/end", {}, ADMIN_KEY)


MakeEpisode = Callable[[int], Episode]
"""An episode for worker ``index`` (each worker runs its episodes one after the other)."""


# --- the long conversation -----------------------------------------------------------------------


class LengthBackend(ScriptedBackend):
    """The scripted reply, with a prompt as long as a real one: one token per ``BYTES_PER_TOKEN`` bytes of
    each message after the prefix (the prefix's ids as they came), so a 30-turn conversation records a
    30k-token prompt and the consumer's work per turn stays what the turn adds."""

    async def generate(self, request: Any) -> Generation:
        generation = await super().generate(request)
        prefix = request.prefix
        prompt = list(prefix.ids) if prefix is not None else []
        for message in request.messages[prefix.message_count if prefix is not None else 0 :]:
            size = len((message.content or "").encode())
            prompt += [100 + index % 900 for index in range(max(1, size // BYTES_PER_TOKEN))]
        return dataclasses.replace(generation, prompt_token_ids=prompt)


def user_text(turn: int, tokens: int) -> str:
    """A user message of about ``tokens`` tokens (4 bytes each), different on every turn."""
    words = [f"w{(turn * 7919 + index) % 10007}" for index in range(tokens * BYTES_PER_TOKEN // 6 + 1)]
    return f"turn {turn}: " + " ".join(words)[: tokens * BYTES_PER_TOKEN]


def schedstat_seconds(pid: int) -> float:
    """CPU time of every thread of ``pid`` in seconds, from ``/proc/<pid>/task/*/schedstat`` (nanoseconds:
    fine enough to time one turn, unlike the 10 ms ticks of ``/proc/<pid>/stat``)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").glob("*/schedstat"):
        with contextlib.suppress(OSError, ValueError):
            total += int(task.read_text().split()[0])
    return total / 1e9


LongTurn = Callable[[list[dict[str, Any]]], Awaitable[dict[str, Any]]]
"""Sends the whole history (user/assistant text messages) and returns the assistant message to append."""


@contextlib.asynccontextmanager
async def long_client(dialect: str, url: str, api_key: str) -> AsyncIterator[tuple[LongTurn, list[int]]]:
    """A real SDK client of ``dialect`` on the session ``api_key``, as a function of the history; and a
    list that gets each reply's (prompt tokens, body bytes)."""
    seen: list[int] = []
    if dialect == "messages":
        import anthropic

        async with anthropic.AsyncAnthropic(base_url=url, api_key=api_key, max_retries=0) as claude:

            async def message_turn(history: list[dict[str, Any]]) -> dict[str, Any]:
                raw = await claude.messages.with_raw_response.create(
                    model=LONG_POLICY, max_tokens=MAX_TOKENS, messages=history
                )
                reply = await raw.parse()
                seen[:] = [reply.usage.input_tokens, len(await raw.read())]
                return {
                    "role": "assistant",
                    "content": "".join(b.text for b in reply.content if b.type == "text"),
                }

            yield message_turn, seen
        return
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0) as client:

        async def chat_turn(history: list[dict[str, Any]]) -> dict[str, Any]:
            raw = await client.chat.completions.with_raw_response.create(
                model=LONG_POLICY, messages=history, max_tokens=MAX_TOKENS
            )
            completion = raw.parse()
            assert completion.usage is not None
            seen[:] = [completion.usage.prompt_tokens, len(raw.content)]
            return completion.choices[0].message.model_dump(exclude_none=True)

        async def responses_turn(history: list[dict[str, Any]]) -> dict[str, Any]:
            raw = await client.responses.with_raw_response.create(
                model=LONG_POLICY,
                input=history,
                max_output_tokens=MAX_TOKENS,  # type: ignore[arg-type]
            )
            response = raw.parse()
            assert response.usage is not None
            seen[:] = [response.usage.input_tokens, len(raw.content)]
            return {"role": "assistant", "content": response.output_text}

        yield (chat_turn if dialect == "chat" else responses_turn), seen


@dataclass(frozen=True, slots=True)
class LongResult:
    label: str
    dialect: str
    cpu_ms: list[float]
    """Per turn index: the gateway's median CPU (ms) over the episodes."""
    latency_ms: list[float]
    prompt_tokens: int
    response_bytes: int
    """The last turn's reply body (JSON or event stream)."""

    @property
    def ratio(self) -> float:
        return self.cpu_ms[-1] / self.cpu_ms[0]


async def run_turns(
    make: MakeEpisode, concurrency: int, turns: int, per_episode: int
) -> tuple[list[float], float]:
    """``turns`` turns by ``concurrency`` workers, each running episodes back to back; latencies (ms) and
    wall time."""
    latencies: list[float] = []
    remaining = [turns]

    async def worker(index: int) -> None:
        while remaining[0] > 0:
            episode = make(index)
            await episode.start()
            messages: list[dict[str, Any]] = [{"role": "user", "content": f"worker {index}: count to ten"}]
            for n in range(per_episode):
                if remaining[0] <= 0:
                    break
                remaining[0] -= 1
                started = time.perf_counter()
                reply = await episode.turn(messages)
                latencies.append((time.perf_counter() - started) * 1000)
                messages += [reply, {"role": "user", "content": f"now say {n + 2}"}]
            await episode.end()

    started = time.perf_counter()
    async with asyncio.TaskGroup() as group:
        for index in range(concurrency):
            group.create_task(worker(index))
    return latencies, time.perf_counter() - started


async def measure_path(
    path: str, make: MakeEpisode, args: argparse.Namespace, processes: Processes, *, profile: bool = False
) -> list[Result]:
    """The path at each level; ``profile``: a cProfile of this process over the timed turns at the first
    level (``--profile``'s ``PREFIX.<path>``)."""
    results = []
    for level in args.levels:
        await run_turns(make, level, max(args.warmup, level), args.turns_per_episode)
        meter = CpuMeter(processes)
        meter.start()
        first = level == args.levels[0]
        with profiled(Path(f"{args.profile}.{path}") if profile and args.profile and first else None):
            latencies, seconds = await run_turns(make, level, args.turns, args.turns_per_episode)
        result = Result(path, level, latencies, seconds, meter.per(len(latencies)))
        note(
            f"{path} x{level}: p50 {result.percentile(50):.2f} ms, p99 {result.percentile(99):.2f} ms, "
            f"{result.rate:,.0f} turns/s; CPU us/turn: {result.cpu_text()}"
        )
        results.append(result)
    return results


async def measure_long(
    label: str, dialect: str, url: str, admin: httpx.AsyncClient, gateway_pid: int, args: argparse.Namespace
) -> LongResult:
    """``--long-episodes`` conversations of ``--long-turns`` turns, one at a time; the gateway's CPU per
    turn index (the median over the episodes: a turn's work happens inside its call, the reply is sent
    after the turn is recorded)."""
    per_turn = max(1, args.long_tokens // args.long_turns)
    cpu: list[list[float]] = [[] for _ in range(args.long_turns)]
    latency: list[list[float]] = [[] for _ in range(args.long_turns)]
    seen: list[int] = []  # the last reply's (prompt tokens, body bytes)
    for episode in range(args.long_episodes + 1):  # the first one warms up
        response = await admin.post("/admin/sessions", json={"policy": LONG_POLICY, "agent": "bench.long"})
        response.raise_for_status()
        session = response.json()
        async with long_client(dialect, url, session["api_key"]) as (turn, last):
            history: list[dict[str, Any]] = []
            for index in range(args.long_turns):
                history.append({"role": "user", "content": user_text(index, per_turn)})
                before, started = schedstat_seconds(gateway_pid), time.perf_counter()
                history.append(await turn(history))
                seen = last
                if episode:
                    latency[index].append((time.perf_counter() - started) * 1000)
                    cpu[index].append((schedstat_seconds(gateway_pid) - before) * 1000)
        ended = await admin.post(f"/admin/sessions/{session['session_id']}/end", json={})
        ended.raise_for_status()
    result = LongResult(
        label,
        dialect,
        [statistics.median(values) for values in cpu],
        [statistics.median(values) for values in latency],
        seen[0],
        seen[1],
    )
    note(
        f"{label} {dialect}, {args.long_turns} turns to {result.prompt_tokens:,} prompt tokens: gateway CPU "
        f"turn 1 {result.cpu_ms[0]:.2f} ms, turn {args.long_turns} {result.cpu_ms[-1]:.2f} ms "
        f"({result.ratio:.2f}x); last reply {result.response_bytes:,} bytes"
    )
    return result


# --- the gateway's own cost, in process ---------------------------------------------------------


class InstantLLM:
    """An LLM client answered in process, like a consumer that holds each turn's tokens (``tokens_key``):
    a request that names the turn it continues carries only its new messages; the prompt is one token per
    ``BYTES_PER_TOKEN`` bytes of each new message. No NATS, no consumer: what is left is the session's and,
    through the gateway, the gateway's own work."""

    def __init__(self) -> None:
        self.held: dict[str, int] = {}

    async def __call__(self, request: Any) -> Any:
        from pipeline.inference.client import PrefixUnknown
        from schemas import LLMResponse

        prefix, known = request.prefix, 0
        if prefix is not None and prefix.key is not None:
            if prefix.key not in self.held:
                raise PrefixUnknown(f"prefix {prefix.key} not held")
            known = self.held.pop(prefix.key)
        elif prefix is not None:
            known = len(prefix.ids)
        new = request.messages[prefix.message_count if prefix is not None else 0 :]
        added = [100 + i % 900 for m in new for i in range(max(1, len((m.content or "").encode()) // 4))]
        key = uuid.uuid4().hex
        self.held[key] = known + len(added) + 3
        return LLMResponse(
            request_id=request.request_id, text="ok", finish_reason="stop", prompt_token_ids=added,
            prompt_prefix_tokens=known, completion_token_ids=[11, 12, 2], completion_logprobs=[-0.5] * 3,
            policy_version=0, consumer_id="in-process", tokens_key=key,
        )  # fmt: skip


async def asgi_call(app: Any, path: str, body: dict[str, Any] | bytes, headers: dict[str, str]) -> Any:
    """One request straight into the ASGI app (no socket, no HTTP client): its JSON reply (bytes: the body
    encoded already, so that a caller can time the app alone)."""
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    sent: list[dict[str, Any]] = []
    pending = [{"type": "http.request", "body": raw, "more_body": False}]

    async def receive() -> dict[str, Any]:
        if pending:
            return pending.pop()
        await asyncio.Event().wait()  # the client stays connected
        raise AssertionError

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    fields = {**headers, "content-type": "application/json", "content-length": str(len(raw))}
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
        "headers": [(k.encode(), v.encode()) for k, v in fields.items()], "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }  # fmt: skip
    await app(scope, receive, send)
    return json.loads(b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body"))


async def measure_in_process(args: argparse.Namespace) -> dict[str, list[float]]:
    """Per turn index, the median CPU (ms, ``time.process_time``: one process) of the long conversation
    through ``llm.chat`` and through the gateway app, both on an in-memory log and ``InstantLLM``."""
    from pipeline.gateway import create_gateway
    from pipeline.log import InMemoryStore

    per_turn = max(1, args.long_tokens // args.long_turns)
    cpu: dict[str, list[list[float]]] = {
        p: [[] for _ in range(args.long_turns)] for p in ("llm.chat", "gateway")
    }
    store, llm = InMemoryStore(), InstantLLM()
    app = create_gateway(store, llm, admin_key="k", policy_default=LONG_POLICY)
    admin = {"authorization": "Bearer k"}
    for episode in range(args.long_episodes + 1):  # the first one warms up
        session = EpisodeSession(store, llm, policy=LONG_POLICY)
        await session.start()
        opened = await asgi_call(app, "/admin/sessions", {}, admin)
        key = {"authorization": f"Bearer {opened['api_key']}"}
        chat_history: list[dict[str, Any]] = []
        gateway_history: list[dict[str, Any]] = []
        for index in range(args.long_turns):
            text = user_text(index, per_turn)
            chat_history.append({"role": "user", "content": text})
            started = time.process_time()
            reply = await session.chat(chat_history, sampling={"max_tokens": MAX_TOKENS})
            spent = time.process_time() - started
            chat_history.append(reply.message.model_dump(exclude_none=True))
            if episode:
                cpu["llm.chat"][index].append(spent * 1000)
            gateway_history.append({"role": "user", "content": text})
            body = {"model": LONG_POLICY, "messages": gateway_history, "max_tokens": MAX_TOKENS}
            encoded = json.dumps(body).encode()  # the client's work: not timed
            started = time.process_time()
            completion = await asgi_call(app, "/v1/chat/completions", encoded, key)
            spent = time.process_time() - started
            gateway_history.append(completion["choices"][0]["message"])
            if episode:
                cpu["gateway"][index].append(spent * 1000)
        await session.finish("done")
        await asgi_call(app, f"/admin/sessions/{opened['session_id']}/end", {}, admin)
    return {path: [statistics.median(values) for values in rows] for path, rows in cpu.items()}


async def in_process_report(args: argparse.Namespace) -> None:
    trees = [("now", None)] + ([("before", args.before)] if args.before else [])
    found: dict[str, dict[str, list[float]]] = {}
    for label, tree in trees:
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [tree, os.environ.get("PYTHONPATH")])),
        }
        sizes = [str(args.long_turns), str(args.long_tokens), str(args.long_episodes)]
        command = [sys.executable, SCRIPT, "--serve", "in-process", *sizes]
        done = await asyncio.create_subprocess_exec(*command, stdout=subprocess.PIPE, env=env)
        out, _ = await done.communicate()
        found[label] = json.loads(out.decode().strip().splitlines()[-1])
    table = Table(
        title=f"in process: the {args.long_turns}-turn conversation on an in-memory log and an instant "
        f"client (median of {args.long_episodes} episodes; CPU ms per turn, time.process_time)",
        caption="gateway - llm.chat: what the gateway adds (HTTP app, dialect, retry keys, the reply)",
    )
    for column in ["code", "path", "turn 1", f"turn {args.long_turns}", "growth", "mean"]:
        table.add_column(column, justify="right")
    for label, paths in found.items():
        gateway, chat = paths["gateway"], paths["llm.chat"]
        own = [g - c for g, c in zip(gateway, chat, strict=True)]
        for path, values in (("llm.chat", chat), ("gateway", gateway), ("gateway - llm.chat", own)):
            growth = f"{values[-1] / values[0]:.2f}x"
            table.add_row(
                label,
                path,
                f"{values[0]:.3f}",
                f"{values[-1]:.3f}",
                growth,
                f"{statistics.fmean(values):.3f}",
            )
    console.print(table)


async def serve_in_process(turns: str, tokens: str, episodes: str) -> None:
    args = argparse.Namespace(long_turns=int(turns), long_tokens=int(tokens), long_episodes=int(episodes))
    print(json.dumps(await measure_in_process(args)), flush=True)


# --- CPU time ------------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def child(*role: str, tree: str | None = None) -> AsyncIterator[tuple[int, str]]:
    """This script in a server role in a process of its own (``common.child``, with an environment):
    ``tree`` is another checkout whose ``pipeline`` it imports (first on ``PYTHONPATH``), for before/after
    runs."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [tree, os.environ.get("PYTHONPATH")]))}
    process = await asyncio.create_subprocess_exec(
        sys.executable, SCRIPT, "--serve", *role, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env
    )
    assert process.stdout is not None
    try:
        line = await asyncio.wait_for(process.stdout.readline(), READY_TIMEOUT_S)
        if not line.startswith(b"ready"):
            raise RuntimeError(f"the {role[0]} process did not start (exit status {await process.wait()})")
        yield process.pid, line.decode().removeprefix("ready").strip()
    finally:
        await stop_child(process, role[0])


async def serve_consumer(nats_url: str, policy: str = POLICY) -> None:
    from consumers.inference import InferenceConfig, create_app

    backend = LengthBackend() if policy == LONG_POLICY else ScriptedBackend()
    app, _ = create_app(InferenceConfig(nats_url, policy, backend="scripted", consumer_id=policy), backend)
    await app.start()
    tune_gc()
    print("ready", flush=True)
    await wait_for_stdin_eof()
    await app.stop()


async def serve_gateway(database_url: str, nats_url: str, admin_key: str, mode: str = "single") -> None:
    """The gateway; ``mode`` ``shared``: as a replica sharing its sessions (``--shared-sessions``);
    ``unwritten``: on a store whose appends cost nothing (``--unwritten``)."""
    from pipeline.gateway import HttpServer, create_gateway

    store = await (UnwrittenStore if mode == "unwritten" else EventStore).connect(database_url)
    llm = await NatsLLMClient.connect(nats_url)
    options: dict[str, Any] = {}  # none for a --before checkout, which may not know them
    if mode == "shared":
        import nats

        from pipeline.gateway import SharedSessions

        connection = await nats.connect(nats_url)
        options["shared"] = await SharedSessions.open(connection.jetstream(), f"BENCH_{uuid.uuid4().hex[:8]}")
    server = HttpServer(create_gateway(store, llm, admin_key=admin_key, policy_default=POLICY, **options))
    await server.start()
    tune_gc()  # as `turnstile serve gateway` does once started (consumers.runtime.running)
    profile = os.environ.get(PROFILE_ENV)
    profiler = cProfile.Profile(time.process_time) if profile else None  # CPU time: a loaded machine preempts
    if profiler is not None:
        profiler.enable()
    print(f"ready {server.url}", flush=True)
    await wait_for_stdin_eof()
    if profiler is not None and profile:
        profiler.disable()
        profiler.dump_stats(f"{profile}.{os.getpid()}")
    await server.stop()
    await llm.close()
    await store.close()


class FloorApp:
    """The least a recording gateway does per turn (the ``floor`` path): read the request, one NATS
    request-reply (a fresh request id each, so the consumer does its usual work), one autocommit INSERT of
    request and reply (a transaction with its fsync, as an append is), a small JSON reply. The admin routes
    answer at once, so ``LeanGatewayEpisode`` drives it as it drives the gateway."""

    def __init__(self, nats_connection: Any, database: Any) -> None:
        from schemas import ChatMessage, LLMRequest, SamplingParams

        self.nats, self.database = nats_connection, database
        template = LLMRequest(
            policy=POLICY,
            messages=[ChatMessage(role="user", content="floor: count to ten")],
            sampling=SamplingParams(max_tokens=MAX_TOKENS),
        )
        self.request_id = str(template.request_id)
        self.template = template.model_dump_json(exclude_none=True)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        body, more = b"", True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        answer: dict[str, Any] = {"session_id": "floor", "api_key": "floor"}
        if scope["path"] == "/v1/chat/completions":
            payload = self.template.replace(self.request_id, str(uuid.uuid4())).encode()
            reply = await self.nats.request(request_subject(POLICY), payload, timeout=60)
            await self.database.execute("INSERT INTO bench_floor (data) VALUES (%b)", (body + reply.data,))
            text = json.loads(reply.data)["text"]
            answer = {"choices": [{"message": {"role": "assistant", "content": text}}]}
        raw = json.dumps(answer).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": raw})


async def serve_floor(database_url: str, nats_url: str) -> None:
    import nats
    import psycopg

    from pipeline.gateway import HttpServer

    nats_connection = await nats.connect(nats_url)
    database = await psycopg.AsyncConnection.connect(database_url, autocommit=True)
    await database.execute("CREATE TABLE IF NOT EXISTS bench_floor (id bigserial PRIMARY KEY, data bytea)")
    server = HttpServer(FloorApp(nats_connection, database), lifespan="off")
    await server.start()
    tune_gc()
    print(f"ready {server.url}", flush=True)
    await wait_for_stdin_eof()
    await server.stop()
    await database.close()
    await nats_connection.close()


# --- the run -------------------------------------------------------------------------------------


async def measure(
    args: argparse.Namespace, found: Servers, database_url: str
) -> tuple[list[Result], list[LongResult]]:
    results: list[Result] = []
    long_results: list[LongResult] = []
    async with (
        child("consumer", found.nats_url) as (consumer_pid, _),
        child("consumer", found.nats_url, LONG_POLICY) as (long_consumer_pid, _),
    ):
        processes: Processes = {"bench": None, "consumer": consumer_pid, **found.pids}
        store = await EventStore.connect(database_url)
        llm = await NatsLLMClient.connect(found.nats_url)
        try:
            if "llm.chat" in args.paths:
                make: MakeEpisode = lambda _: ChatEpisode(store, llm)  # noqa: E731
                results += await measure_path("llm.chat", make, args, processes, profile=True)
            if "llm.openai()" in args.paths:
                make = lambda _: InProcessOpenAIEpisode(store, llm)  # noqa: E731
                results += await measure_path("llm.openai()", make, args, processes)
            gateways = [("gateway", None, "single")] if {"gateway", "gateway-lean"} & set(args.paths) else []
            if args.shared and gateways:
                gateways.append(("gateway-shared", None, "shared"))
            if args.before:
                gateways.append(("gateway@before", without(args.before, args.before_without), "single"))
            if args.unwritten and "gateway-lean" in args.paths:
                gateways.append(("gateway-unwritten", None, "unwritten"))
            async with contextlib.AsyncExitStack() as servers:
                lean: list[tuple[str, str, Processes]] = []  # measured in interleaved rounds
                for label, tree, mode in gateways:
                    gateway_pid, url = await servers.enter_async_context(
                        child("gateway", database_url, found.nats_url, ADMIN_KEY, mode, tree=tree)
                    )
                    where = f" from {tree}" if tree else ""
                    note(
                        f"{label} on {url}{where} (uvicorn, its own process), "
                        f"client openai {openai.__version__}"
                    )
                    gateway_processes = {**processes, "gateway": gateway_pid}
                    if mode == "unwritten":  # the ablation: in the lean rounds only
                        lean.append((lean_label(label), url, gateway_processes))
                        continue
                    results += await measure_gateway(label, url, args, gateway_processes)
                    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
                    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=60) as admin:
                        for dialect in args.long_dialects if args.long_episodes else []:
                            long_results.append(
                                await measure_long(label, dialect, url, admin, gateway_pid, args)
                            )
                    if "gateway-lean" in args.paths:
                        lean.append((lean_label(label), url, gateway_processes))
                if "floor" in args.paths:
                    floor_pid, url = await servers.enter_async_context(
                        child("floor", database_url, found.nats_url)
                    )
                    note(f"floor on {url} (uvicorn, its own process)")
                    lean.append(("floor", url, {**processes, "gateway": floor_pid}))
                results += await measure_interleaved(lean, args)
        finally:
            await llm.close()
            await store.close()
    del long_consumer_pid
    return results, long_results


async def measure_gateway(
    label: str, url: str, args: argparse.Namespace, processes: Processes
) -> list[Result]:
    """The gateway through the OpenAI SDK (``label``), then through ``LeanHttp`` (``gateway-lean...``)."""
    http_client = openai.DefaultAsyncHttpxClient(limits=sdk_limits(max(args.levels)))
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    results = []
    async with (
        httpx.AsyncClient(base_url=url, headers=headers, timeout=60) as admin,
        openai.AsyncOpenAI(
            base_url=f"{url}/v1", api_key="-", max_retries=0, http_client=http_client
        ) as client,
    ):
        if "gateway" in args.paths:
            results += await measure_path(label, lambda _: GatewayEpisode(admin, client), args, processes)
    return results


def lean_episodes(clients: Sequence[LeanHttp]) -> MakeEpisode:
    """Episodes posted by ``LeanHttp``: worker ``index`` on ``clients[index]``."""
    return lambda index: LeanGatewayEpisode(clients[index])


async def measure_interleaved(
    paths: Sequence[tuple[str, str, Processes]], args: argparse.Namespace
) -> list[Result]:
    """The lean paths (``gateway-lean``, ``gateway-lean@before``, ``floor``: each ``(label, url, processes)``,
    their servers all up) driven by ``LeanHttp``, one keep-alive connection per worker, in ``--rounds``
    rounds: in each, every path runs its share of ``--turns`` at each level in turn. A machine whose speed
    drifts (other tenants, a build next door) then weighs on every path alike, and the ratios between them
    hold where back-to-back runs of a few seconds each swung by tens of per cent."""
    clients = {label: [LeanHttp(url) for _ in range(max(args.levels))] for label, url, _ in paths}
    results = []
    try:
        makes = {label: lean_episodes(lean) for label, lean in clients.items()}
        for level in args.levels:
            for label, _, _ in paths:
                await run_turns(makes[label], level, max(args.warmup, level), args.turns_per_episode)
            latencies: dict[str, list[float]] = {label: [] for label, _, _ in paths}
            seconds = dict.fromkeys(latencies, 0.0)
            cpu: dict[str, dict[str, float]] = {label: {} for label in latencies}
            share = max(1, args.turns // args.rounds)
            for _ in range(args.rounds):
                for label, _, processes in paths:
                    meter = CpuMeter(processes)
                    meter.start()
                    done, took = await run_turns(makes[label], level, share, args.turns_per_episode)
                    for name, value in meter.per(1).items():  # CPU microseconds over the round
                        cpu[label][name] = cpu[label].get(name, 0.0) + value
                    latencies[label] += done
                    seconds[label] += took
            for label in latencies:
                count = len(latencies[label])
                per_turn = {name: value / count for name, value in cpu[label].items()}
                result = Result(label, level, latencies[label], seconds[label], per_turn)
                note(
                    f"{label} x{level} ({args.rounds} rounds): p50 {result.percentile(50):.2f} ms, "
                    f"p99 {result.percentile(99):.2f} ms, {result.rate:,.0f} turns/s; "
                    f"CPU us/turn: {result.cpu_text()}"
                )
                results.append(result)
    finally:
        for lean in clients.values():
            for http in lean:
                await http.close()
    return results


def lean_label(label: str) -> str:
    """``gateway-lean`` for ``gateway``, ``gateway-lean@before`` for ``gateway@before``."""
    return label.replace("gateway", "gateway-lean", 1)


def without(tree: str, packages: Sequence[str]) -> str:
    """``tree`` on a path where ``packages`` cannot be imported (a stub of each raises ImportError): the
    before-gateway runs as its own install would, without what this checkout added (httptools)."""
    if not packages:
        return tree
    stubs = Path(tree) / ".bench-without"
    for package in packages:
        (stubs / package).mkdir(parents=True, exist_ok=True)
        (stubs / package / "__init__.py").write_text(
            f"raise ImportError('{package} left out for --before')\n"
        )
    return os.pathsep.join([str(stubs), tree])


def sdk_limits(connections: int) -> Any:
    """Connection limits for the SDK's own HTTP client (openai >= 3 ships httpx2; older ones httpx)."""
    try:
        import httpx2

        return httpx2.Limits(max_connections=connections, max_keepalive_connections=connections)
    except ImportError:
        return httpx.Limits(max_connections=connections, max_keepalive_connections=connections)


def print_report(results: Sequence[Result], args: argparse.Namespace) -> None:
    baselines = {r.concurrency: r for r in results if r.path == BASELINE}
    table = Table(
        title=f"recorded turns ({args.turns_per_episode} per episode), instant scripted backend",
        caption="x chat: p50 latency and turns/s ÷ llm.chat's at the same concurrency, same run",
    )
    for column in [
        "path",
        "concurrency",
        "turns",
        "p50 ms",
        "p99 ms",
        "turns/s",
        "p50 x chat",
        "turns/s x chat",
        "+p50 ms",
    ]:
        table.add_column(column, justify="right")
    table.add_column("CPU us/turn", justify="left")
    for result in results:
        base = baselines.get(result.concurrency)
        table.add_row(
            result.path,
            str(result.concurrency),
            f"{len(result.latencies_ms):,}",
            f"{result.percentile(50):.2f}",
            f"{result.percentile(99):.2f}",
            f"{result.rate:,.0f}",
            f"{result.percentile(50) / base.percentile(50):.2f}" if base else "-",
            f"{result.rate / base.rate:.2f}" if base else "-",
            f"{result.percentile(50) - base.percentile(50):+.2f}" if base else "-",
            result.cpu_text(),
        )
    console.print(table)
    by_key = {(r.path, r.concurrency): r for r in results}
    for level, base in baselines.items():
        for path in ("gateway", "gateway-lean"):
            gateway, in_process = by_key.get((path, level)), by_key.get(("llm.openai()", level))
            if gateway is None:
                continue
            line = f"x{level}: {path} vs llm.chat {versus(gateway, base)}"
            if "gateway" in gateway.cpu_us and "bench" in base.cpu_us:
                # the gateway process holds the sessions, so it does llm.chat's work (NATS, the log) too
                own = gateway.cpu_us["gateway"] - base.cpu_us["bench"]
                line += f"; gateway CPU {gateway.cpu_us['gateway']:,.0f} us/turn, {own:,.0f} over llm.chat's"
            if in_process is not None and path == "gateway":
                line += f"; vs llm.openai() {versus(gateway, in_process)}"
            print(line)
    for result in results:
        before = by_key.get((f"{result.path}@before", result.concurrency))
        if result.path in ("gateway", "gateway-lean") and before is not None:
            now, then = result.cpu_us.get("gateway", 0.0), before.cpu_us.get("gateway", 0.0)
            cpu = f", gateway CPU {now:,.0f} vs {then:,.0f} us/turn ({now / then:.2f}x)" if then else ""
            print(f"x{result.concurrency}: {result.path} vs {before.path} {versus(result, before)}{cpu}")


def print_long_report(results: Sequence[LongResult], args: argparse.Namespace) -> None:
    if not results:
        return
    table = Table(
        title=f"a {args.long_turns}-turn conversation through the gateway, one episode at a time "
        f"(median of {args.long_episodes} episodes)",
        caption="gateway CPU per turn from /proc/<pid>/task/*/schedstat; growth: last turn ÷ turn 1",
    )
    for column in ["gateway", "dialect", "prompt tokens", "turn 1 ms", "last turn ms", "growth",
                   "mean ms", "p50 latency ms", "last reply bytes"]:  # fmt: skip
        table.add_column(column, justify="right")
    for result in results:
        table.add_row(
            result.label,
            result.dialect,
            f"{result.prompt_tokens:,}",
            f"{result.cpu_ms[0]:.2f}",
            f"{result.cpu_ms[-1]:.2f}",
            f"{result.ratio:.2f}x",
            f"{statistics.fmean(result.cpu_ms):.2f}",
            f"{statistics.median(result.latency_ms):.2f}",
            f"{result.response_bytes:,}",
        )
    console.print(table)
    by_key = {(r.label, r.dialect): r for r in results}
    for result in results:
        before = by_key.get(("gateway@before", result.dialect))
        if result.label == "gateway" and before is not None:
            now, then = statistics.fmean(result.cpu_ms), statistics.fmean(before.cpu_ms)
            print(
                f"{result.dialect}: gateway CPU per turn {now:.2f} ms vs {then:.2f} ms before "
                f"({now / then:.2f}x)"
            )


def print_summary(results: Sequence[Result], long_results: Sequence[LongResult]) -> None:
    """The ``SUMMARY`` lines (``common.summary``): issue 21's gateway row and issue 16's part 7."""
    by_key = {(r.path, r.concurrency): r for r in results}
    for level in (1, 16):
        chat = by_key.get(("llm.chat", level))
        if chat is None:
            continue
        for path in ("gateway", "gateway-lean"):
            gateway = by_key.get((path, level))
            if gateway is None:
                continue
            client = "OpenAI SDK" if path == "gateway" else "lean client"
            ratio = gateway.rate / chat.rate
            figure, baseline = f"{gateway.rate:,.0f} turns/s", f"llm.chat {chat.rate:,.0f}"
            target = ">= 0.6x" if level == 16 else None
            summary("gateway", f"turns/s x{level} ({client}) / llm.chat", figure, baseline, ratio, target,
                    ratio >= 0.6)  # fmt: skip
            if "gateway" in gateway.cpu_us and "bench" in chat.cpu_us:
                cpu, base = gateway.cpu_us["gateway"], chat.cpu_us["bench"]
                figure, baseline = f"gateway {cpu:,.0f}", f"llm.chat {base:,.0f}"
                summary("gateway", f"CPU us/turn x{level} ({client}) / llm.chat's", figure, baseline,
                        cpu / base, None)  # fmt: skip
    for level in (1, 16):
        floor = by_key.get(("floor", level))
        for path in ("gateway", "gateway-lean", "gateway-lean-unwritten") if floor is not None else ():
            gateway = by_key.get((path, level))
            if gateway is None or "gateway" not in gateway.cpu_us or "gateway" not in floor.cpu_us:
                continue
            client = {
                "gateway": "OpenAI SDK",
                "gateway-lean": "lean client",
                "gateway-lean-unwritten": "lean client, appends that cost nothing",
            }[path]
            cpu, base = gateway.cpu_us["gateway"], floor.cpu_us["gateway"]
            limit = FLOOR_TARGETS[level]
            target = f"<= {limit:g}x"
            if path == "gateway-lean-unwritten":  # an ablation: the least any store could bring the ratio to
                client, target = f"{client}; the gateway's target: <= {limit:g}x", None
            summary("gateway", f"CPU us/turn x{level} ({client}) / the floor's", f"gateway {cpu:,.0f}",
                    f"floor {base:,.0f}", cpu / base, target, cpu / base <= limit)  # fmt: skip
    for result in long_results:
        if result.label == "gateway":
            figure = f"turn {len(result.cpu_ms)} {result.cpu_ms[-1]:.2f} ms"
            summary("gateway", f"{result.dialect} CPU growth", figure, f"turn 1 {result.cpu_ms[0]:.2f} ms",
                    result.ratio, "<= 1.5x", result.ratio <= 1.5)  # fmt: skip


def versus(result: Result, other: Result) -> str:
    p50, other_p50 = result.percentile(50), other.percentile(50)
    return f"p50 {p50 - other_p50:+.2f} ms ({p50 / other_p50:.2f}x), turns/s {result.rate / other.rate:.2f}x"


def parse_list(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    add = parser.add_argument
    add("--levels", type=lambda t: [int(p) for p in parse_list(t)], default=[1, 16], help="default 1,16")
    add("--turns", type=int, default=600, help="timed turns per path and level (default 600)")
    add("--warmup", type=int, default=100, help="untimed turns first (default 100)")
    add("--turns-per-episode", type=int, default=5, help="turns of each episode (default 5)")
    add(
        "--rounds",
        type=int,
        default=5,
        help="the lean paths and the floor take turns this many times, each its share of --turns (default 5)",
    )
    add("--paths", type=parse_list, default=list(PATHS), help=f"default {','.join(PATHS)}")
    add("--long-turns", type=int, default=30, help="turns of the long conversation (default 30)")
    add("--long-tokens", type=int, default=30_000, help="its prompt at the last turn (default 30,000)")
    add("--long-episodes", type=int, default=5, help="long conversations per dialect (default 5; 0: none)")
    add(
        "--long-dialects",
        type=parse_list,
        default=list(LONG_DIALECTS),
        help=f"default {','.join(LONG_DIALECTS)}",
    )
    add("--in-process", action="store_true", help="only the gateway's own cost: in process, no servers")
    add(
        "--shared",
        action="store_true",
        help="also a gateway that shares its sessions with replicas (gateway-shared: --shared-sessions)",
    )
    add("--before", default=None, help="another checkout whose gateway runs beside this one (gateway@before)")
    add(
        "--before-without",
        type=parse_list,
        default=[],
        help="packages the --before checkout's install lacks (e.g. httptools): made unimportable for it",
    )
    add("--profile", default=None, help="cProfile each gateway process to PREFIX.<pid> (python -m pstats)")
    add(
        "--unwritten",
        action="store_true",
        help="also a gateway on a store whose appends cost nothing (gateway-lean-unwritten: an ablation)",
    )
    add("--serve", nargs="+", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if (
        not args.levels
        or min(args.levels) < 1
        or min(args.turns, args.turns_per_episode, args.rounds) < 1
        or args.warmup < 0
    ):
        parser.error(
            "--levels, --turns, --turns-per-episode and --rounds must be at least 1, --warmup 0 or more"
        )
    if unknown := set(args.long_dialects) - set(LONG_DIALECTS):
        parser.error(
            f"--long-dialects are some of {','.join(LONG_DIALECTS)}, not {','.join(sorted(unknown))}"
        )
    if args.long_turns < 1 or args.long_episodes < 0:
        parser.error("--long-turns must be at least 1, --long-episodes 0 or more")
    if unknown := set(args.paths) - set(PATHS):
        parser.error(f"--paths are some of {','.join(PATHS)}, not {','.join(sorted(unknown))}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.serve:
        role: dict[str, Callable[..., Awaitable[None]]] = {
            "consumer": serve_consumer,
            "gateway": serve_gateway,
            "floor": serve_floor,
            "in-process": serve_in_process,
        }
        run(role[args.serve[0]](*args.serve[1:]))  # the event loop of `turnstile serve ...`
        return 0
    if args.profile:
        os.environ[PROFILE_ENV] = str(Path(args.profile).resolve())
    if args.in_process:
        note(f"{machine()}; in process")
        run(in_process_report(args))
        return 0
    tune_gc()  # as every `turnstile serve` process does (consumers.runtime.running): every path gets it
    note(f"{machine()}; {args.turns:,} turns per path and level after {args.warmup:,} warm-up")
    with servers() as found, scratch_database(found.database_url) as database_url:
        results, long_results = run(measure(args, found, database_url))
    print_report(results, args)
    print_long_report(long_results, args)
    print_summary(results, long_results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
