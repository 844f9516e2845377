"""Per-turn overhead of the NATS path against an in-process call and an OpenAI-style HTTP proxy.

Every path serves the same turn with the same ``InferenceService`` over the instant ``ScriptedBackend``,
so the backend costs nothing and what is left is the price of getting a request there and back:

- ``in-process`` (the baseline): the service called directly in the benchmark process, everything the
  client and the consumer do except the transport: ``request.model_dump_json()``,
  ``await service.handle(data, None)`` and parsing the reply the way ``NatsLLMClient`` does
  (``parse_wire``).
- ``nats``: ``NatsLLMClient`` in the benchmark process, an inference consumer (``create_app`` with the
  scripted backend) in a process of its own, and a nats-server (``TURNSTILE_NATS_URL`` if set, else an
  embedded one in a temporary directory). Episodes have ids, so turns after the first go to the
  consumer's sticky subject, as in real use.
- ``http``: a minimal OpenAI-style proxy, a FastAPI app whose ``POST /v1/chat/completions`` builds an
  ``LLMRequest`` from the body, calls the service in process and answers a chat completion (with the
  token ids and logprobs an RL client needs), served by uvicorn in a process of its own; the client is
  one keep-alive ``httpx.AsyncClient`` with a connection per episode.

At each concurrency level (``--levels``, default 1 and 256) that many asyncio tasks, one per episode,
make sequential turns: ``--warmup`` turns first, then ``--turns`` timed ones spread over the episodes.
A turn's latency runs from the call to the parsed reply; turns/s is timed turns over wall-clock time.

Reading the table: "overhead" is a path's latency minus the baseline's at the same level and
percentile, i.e. what the transport costs on top of the work that has to be done anyway. At
concurrency 1 it is the round trip of one turn. At high concurrency latencies are mostly queueing
(Little's law: latency ~ concurrency / throughput), so the overhead there is really a throughput
comparison, and on a small machine it includes the fight for cores between the client, the server and
the consumer (the baseline runs on one core, alone). The last lines give NATS overhead / HTTP overhead
and the targets. The machine is noisy: run it more than once before drawing conclusions.

"CPU us/turn" is the user + system CPU time each process spent per timed turn (``bench``: this process,
client included; ``consumer``/``proxy``: the server process; ``nats-server`` when embedded; from
/proc, so Linux only, in clock ticks of 10 ms, so only meaningful over a second or more). It is less
sensitive to other load than latency is, and says which process a path's cost sits in.

    python bench/overhead.py                    # defaults: --levels 1,256 --turns 3000
    python bench/overhead.py --turns 10000 --paths nats,http --profile-dir /tmp/prof

``--profile-dir DIR`` writes cProfile stats of the benchmark process during each level's timed turns
(``<path>-client-<level>.prof``) and of the whole life of the server processes (``nats-consumer.prof``,
``http-proxy.prof``); read them with ``python -m pstats``. cProfile slows everything down, so the
latencies of such a run are not the ones to report.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import socket
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from rich.console import Console
from rich.table import Table

from consumers.runtime import run, tune_gc
from pipeline.inference.backends.scripted import ScriptedBackend
from pipeline.inference.client import NatsLLMClient
from pipeline.inference.service import InferenceService
from schemas import ChatMessage, LLMRequest, LLMResponse, parse_wire

from common import (  # bench/common.py
    CpuMeter,
    Processes,
    child,
    consumer,
    cpu_text,
    machine,
    nats_server,
    note,
    percentile,
    profiled,
    summary,
    wait_for_stdin_eof,
)

POLICY = "bench"
PATHS = ("in-process", "nats", "http")
BASELINE = "in-process"
TARGET_P50_MS = 1.0
TARGET_P99_MS = 5.0
TARGET_RATIO = 0.3
"""NATS overhead over the HTTP proxy's at concurrency 1 (issue 21)."""
TARGET_THROUGHPUT = 0.8
"""NATS turns/s over in-process turns/s at the largest level (issue 21)."""
SCRIPT = str(Path(__file__).resolve())

Call = Callable[[LLMRequest], Awaitable[Any]]
console = Console(width=None if sys.stdout.isatty() else 150)


@dataclass(frozen=True, slots=True)
class Result:
    path: str
    concurrency: int
    latencies_ms: list[float]
    seconds: float
    cpu_us: dict[str, float]
    """CPU time per timed turn of each process, in microseconds."""

    @property
    def rate(self) -> float:
        return len(self.latencies_ms) / self.seconds

    def percentile(self, q: float) -> float:
        return percentile(self.latencies_ms, q)


# --- the turn ------------------------------------------------------------------------------------


def make_messages(prompt_chars: int) -> list[ChatMessage]:
    """A system prompt and a user message of ``prompt_chars`` characters together."""
    text = ("the quick brown fox jumps over the lazy dog " * (prompt_chars // 44 + 1))[:prompt_chars]
    cut = prompt_chars // 3
    return [ChatMessage(role="system", content=text[:cut]), ChatMessage(role="user", content=text[cut:])]


def make_service(consumer_id: str) -> InferenceService:
    async def publish(subject: str, body: bytes, headers: dict[str, str]) -> None:
        return None

    return InferenceService(ScriptedBackend(), policy=POLICY, consumer_id=consumer_id, publish=publish)


def in_process_call(service: InferenceService) -> Call:
    async def call(request: LLMRequest) -> LLMResponse:
        reply = parse_wire(await service.handle(request.model_dump_json().encode(), None))
        if not isinstance(reply, LLMResponse):
            raise RuntimeError(f"the service answered {reply!r:.200}")
        return reply

    return call


def http_call(client: Any) -> Call:
    async def call(request: LLMRequest) -> dict[str, Any]:
        body = {
            "model": request.policy,
            "messages": [message.model_dump(exclude_none=True) for message in request.messages],
            "user": request.episode_id,
        }
        response = await client.post("/v1/chat/completions", json=body)
        response.raise_for_status()
        reply: dict[str, Any] = response.json()
        return reply

    return call


# --- measuring -----------------------------------------------------------------------------------


async def episode(
    call: Call, messages: list[ChatMessage], episode_id: str, turns: int, latencies: list[float]
) -> None:
    for _ in range(turns):
        request = LLMRequest(policy=POLICY, episode_id=episode_id, messages=messages)
        started = time.perf_counter()
        await call(request)
        latencies.append((time.perf_counter() - started) * 1000)


async def run_turns(
    call: Call, messages: list[ChatMessage], concurrency: int, turns: int, tag: str
) -> tuple[list[float], float]:
    """``turns`` turns spread over ``concurrency`` episodes; their latencies (ms) and the wall time."""
    latencies: list[float] = []
    started = time.perf_counter()
    async with asyncio.TaskGroup() as group:
        for index in range(concurrency):
            share = turns // concurrency + (1 if index < turns % concurrency else 0)
            group.create_task(episode(call, messages, f"{tag}-{index}", share, latencies))
    return latencies, time.perf_counter() - started


async def measure_level(
    path: str, call: Call, concurrency: int, args: argparse.Namespace, processes: Processes
) -> Result:
    messages = make_messages(args.prompt_chars)
    tag = f"{path}-{concurrency}-{os.urandom(4).hex()}"
    await run_turns(call, messages, concurrency, max(args.warmup, concurrency), tag)
    target = args.profile_dir / f"{path}-client-{concurrency}.prof" if args.profile_dir else None
    meter = CpuMeter(processes)
    meter.start()
    with profiled(target):
        latencies, seconds = await run_turns(call, messages, concurrency, args.turns, tag)
    cpu = meter.per(len(latencies))
    result = Result(path, concurrency, latencies, seconds, cpu)
    note(
        f"{path} x{concurrency}: p50 {result.percentile(50):.3f} ms, p99 {result.percentile(99):.3f} ms, "
        f"{result.rate:,.0f} turns/s; CPU us/turn: {cpu_text(result.cpu_us)}"
    )
    return result


async def measure_path(path: str, call: Call, args: argparse.Namespace, processes: Processes) -> list[Result]:
    return [await measure_level(path, call, level, args, processes) for level in args.levels]


# --- child processes -----------------------------------------------------------------------------


def openai_reply(reply: LLMResponse, model: str) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": reply.text}
    if reply.tool_calls:
        message["tool_calls"] = [call.model_dump() for call in reply.tool_calls]
    return {
        "id": f"chatcmpl-{reply.request_id.hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "finish_reason": reply.finish_reason,
                "logprobs": {"content": [{"logprob": value} for value in reply.completion_logprobs]},
                "token_ids": reply.completion_token_ids,
            }
        ],
        "prompt_token_ids": reply.prompt_token_ids,
        "usage": {
            "prompt_tokens": len(reply.prompt_token_ids),
            "completion_tokens": len(reply.completion_token_ids),
            "total_tokens": len(reply.prompt_token_ids) + len(reply.completion_token_ids),
        },
    }


class ChatCompletionRequest(BaseModel):
    """The part of an OpenAI chat-completions body that the proxy reads (``user`` is the episode id)."""

    model: str
    messages: list[ChatMessage]
    temperature: float = 1.0
    max_tokens: int = 256
    user: str | None = None


def create_proxy() -> Any:
    """FastAPI app: ``POST /v1/chat/completions`` -> LLMRequest -> InferenceService -> chat completion."""
    from fastapi import FastAPI, HTTPException

    service = make_service("bench-http")
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest) -> dict[str, Any]:
        request = LLMRequest(
            policy=body.model,
            episode_id=body.user,
            messages=body.messages,
            sampling={"temperature": body.temperature, "max_tokens": body.max_tokens},
        )
        reply = parse_wire(await service.handle(request.model_dump_json().encode(), None))
        if not isinstance(reply, LLMResponse):
            raise HTTPException(400, reply.model_dump())
        return openai_reply(reply, body.model)

    return app


async def serve_http(profile_dir: Path | None) -> None:
    import uvicorn

    # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on such sockets, and without it every reply
    # waits ~40 ms for a delayed ACK (Nagle).
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(create_proxy(), log_level="warning", access_log=False, backlog=4096)
    server = uvicorn.Server(config)
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        if serving.done():
            serving.result()
        await asyncio.sleep(0.01)
    tune_gc()  # as the NATS consumer does once started
    print(f"ready {sock.getsockname()[1]} {server_stack(config)}", flush=True)
    with profiled(profile_dir / "http-proxy.prof" if profile_dir else None):
        await wait_for_stdin_eof()
    server.should_exit = True
    await serving


def server_stack(config: Any) -> str:
    """Which event loop and HTTP parser uvicorn picked (``auto`` prefers uvloop and httptools)."""
    loop = "uvloop" if type(asyncio.get_running_loop()).__module__.startswith("uvloop") else "asyncio"
    protocol = getattr(config, "http_protocol_class", None)
    return f"uvicorn+{loop}+{getattr(protocol, '__name__', '?')}"


def run_server_role(role: Sequence[str], profile_dir: Path | None) -> int:
    if role[0] == "http":
        run(serve_http(profile_dir))
    else:
        raise SystemExit(f"unknown server role {role[0]!r}")
    return 0


# --- the paths -----------------------------------------------------------------------------------


def profile_option(args: argparse.Namespace) -> list[str]:
    return ["--profile-dir", str(args.profile_dir)] if args.profile_dir else []


def profile_file(args: argparse.Namespace, name: str) -> Path | None:
    return args.profile_dir / name if args.profile_dir else None


async def bench_in_process(args: argparse.Namespace) -> list[Result]:
    call = in_process_call(make_service("bench-in-process"))
    return await measure_path(BASELINE, call, args, {"bench": None})


async def bench_nats(args: argparse.Namespace) -> list[Result]:
    with nats_server() as (url, server_pid):
        note(f"nats-server at {url}")
        profile = profile_file(args, "nats-consumer.prof")
        async with consumer(url, POLICY, profile) as (consumer_pid, _):
            processes: Processes = {"bench": None, "consumer": consumer_pid}
            if server_pid is not None:
                processes["nats-server"] = server_pid
            client = await NatsLLMClient.connect(url)
            try:
                return await measure_path("nats", client, args, processes)
            finally:
                await client.close()


async def bench_http(args: argparse.Namespace) -> list[Result]:
    import httpx

    proxy = child(SCRIPT, "--serve", "http", *profile_option(args), name="HTTP proxy")
    async with proxy as (proxy_pid, ready):
        port, stack = ready.split()
        note(f"HTTP proxy on 127.0.0.1:{port} ({stack}), client httpx {httpx.__version__}")
        limits = httpx.Limits(max_connections=max(args.levels), max_keepalive_connections=max(args.levels))
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{port}", limits=limits, timeout=60.0
        ) as client:
            return await measure_path("http", http_call(client), args, {"bench": None, "proxy": proxy_pid})


BENCHES = {"in-process": bench_in_process, "nats": bench_nats, "http": bench_http}


async def measure(args: argparse.Namespace) -> list[Result]:
    results = []
    for path in args.paths:
        results += await BENCHES[path](args)
    return results


# --- the report ----------------------------------------------------------------------------------


def overhead(result: Result, baseline: Result | None, q: float) -> float | None:
    if baseline is None or result.path == BASELINE:
        return None
    return result.percentile(q) - baseline.percentile(q)


def fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def print_table(results: Sequence[Result], baselines: dict[int, Result]) -> None:
    table = Table(title="per-turn latency and overhead (ms; overhead = path - in-process, same percentile)")
    columns = ["path", "concurrency", "turns", "p50", "p99", "overhead p50", "overhead p99", "turns/s"]
    for column in columns:
        table.add_column(column, justify="right")
    table.add_column("CPU us/turn", justify="left")
    for result in results:
        baseline = baselines.get(result.concurrency)
        table.add_row(
            result.path,
            str(result.concurrency),
            f"{len(result.latencies_ms):,}",
            fmt(result.percentile(50)),
            fmt(result.percentile(99)),
            fmt(overhead(result, baseline, 50)),
            fmt(overhead(result, baseline, 99)),
            f"{result.rate:,.0f}",
            cpu_text(result.cpu_us),
        )
    console.print(table)


def verdict(ok: bool) -> str:
    return "met" if ok else "NOT met"


def print_targets(results: Sequence[Result], baselines: dict[int, Result]) -> None:
    by_key = {(result.path, result.concurrency): result for result in results}
    print(
        f"targets: NATS overhead p50 <= {TARGET_P50_MS:g} ms, p99 <= {TARGET_P99_MS:g} ms, "
        f"<= {TARGET_RATIO:g}x the HTTP proxy's overhead"
    )
    for level, baseline in baselines.items():
        nats = by_key.get(("nats", level))
        if nats is None:
            continue
        p50, p99 = overhead(nats, baseline, 50) or 0.0, overhead(nats, baseline, 99) or 0.0
        line = (
            f"  x{level}: NATS overhead p50 {p50:.3f} ms ({verdict(p50 <= TARGET_P50_MS)}), "
            f"p99 {p99:.3f} ms ({verdict(p99 <= TARGET_P99_MS)})"
        )
        http = by_key.get(("http", level))
        if http is not None:
            line += "; NATS/HTTP overhead " + ", ".join(
                ratio_text(p, overhead(nats, baseline, q), overhead(http, baseline, q))
                for p, q in (("p50", 50), ("p99", 99))
            )
        print(line)


def ratio_text(label: str, nats: float | None, http: float | None) -> str:
    if nats is None or http is None or http <= 0:
        return f"{label} n/a"
    ratio = nats / http
    return f"{label} {ratio:.2f}x ({verdict(ratio <= TARGET_RATIO)})"


def print_summaries(results: Sequence[Result], baselines: dict[int, Result]) -> None:
    """One line per issue-21 target: overhead vs HTTP at the smallest level, throughput at the largest."""
    by_key = {(result.path, result.concurrency): result for result in results}
    low, high = min(baselines), max(baselines)
    nats, http = by_key.get(("nats", low)), by_key.get(("http", low))
    if nats is not None and http is not None:
        ours, theirs = overhead(nats, baselines[low], 50) or 0.0, overhead(http, baselines[low], 50) or 0.0
        ratio = ours / theirs if theirs > 0 else math.inf
        summary(
            "overhead", f"NATS/HTTP overhead p50 at {low}", f"NATS {ours:.3f} ms", f"HTTP {theirs:.3f} ms",
            ratio, f"<= {TARGET_RATIO:g}", ratio <= TARGET_RATIO,
        )  # fmt: skip
    nats = by_key.get(("nats", high))
    if nats is not None:
        ratio = nats.rate / baselines[high].rate
        summary(
            "overhead", f"NATS/in-process turns/s at {high}", f"NATS {nats.rate:,.0f} turns/s",
            f"in-process {baselines[high].rate:,.0f}", ratio, f">= {TARGET_THROUGHPUT:g}",
            ratio >= TARGET_THROUGHPUT,
        )  # fmt: skip


def print_report(results: Sequence[Result]) -> None:
    baselines = {result.concurrency: result for result in results if result.path == BASELINE}
    print_table(results, baselines)
    if baselines:
        print_targets(results, baselines)
        print_summaries(results, baselines)
    else:
        print("no in-process baseline in this run: overheads not computed")


# --- arguments -----------------------------------------------------------------------------------


def parse_list(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def parse_levels(text: str) -> list[int]:
    levels = [int(part) for part in parse_list(text)]
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError("levels are positive integers, e.g. 1,256")
    return levels


def parse_paths(text: str) -> list[str]:
    paths = parse_list(text)
    unknown = sorted(set(paths) - set(PATHS))
    if unknown or not paths:
        raise argparse.ArgumentTypeError(f"paths are some of {','.join(PATHS)}, not {','.join(unknown)}")
    return [path for path in PATHS if path in paths]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    add = parser.add_argument
    add("--turns", type=int, default=3_000, help="timed turns per path and level (default 3000)")
    add("--warmup", type=int, default=300, help="untimed turns first, at least one per episode (default 300)")
    add("--levels", type=parse_levels, default=[1, 256], help="concurrent episodes (default 1,256)")
    add("--paths", type=parse_paths, default=list(PATHS), help=f"default {','.join(PATHS)}")
    add("--prompt-chars", type=int, default=1_500, help="characters of chat per request (default 1500)")
    add("--profile-dir", type=Path, default=None, help="write cProfile stats of the NATS client/consumer")
    add("--serve", nargs="+", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if min(args.turns, args.prompt_chars) < 1 or args.warmup < 0:
        parser.error("--turns and --prompt-chars must be at least 1, --warmup at least 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    tune_gc()  # as every `turnstile serve` process does (consumers.runtime.running): both paths get it
    if args.serve:
        return run_server_role(args.serve, args.profile_dir)
    if args.profile_dir:
        args.profile_dir.mkdir(parents=True, exist_ok=True)
    note(
        f"{machine()}; {args.turns:,} turns per level after {args.warmup:,} warm-up; "
        f"{args.prompt_chars:,} chars per request"
    )
    results = run(measure(args))  # the event loop the services run on (uvloop): every path gets it
    print_report(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
