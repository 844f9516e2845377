"""What the gateway's HTTP metrics (``pipeline.gateway.RequestMetrics``: a request counted by route, method
and status, timed into a histogram, an error counted by kind) cost a turn, beside the same gateway without
them, in one run.

Both are the real gateway app (``create_gateway``) in this process, on an in-memory log and an instant LLM
client (``InstantLLM`` of bench/gateway.py: no servers, no sockets), called straight through ASGI; the one
is wrapped in ``RequestMetrics`` on a registry of its own, as ``turnstile serve gateway --metrics-port``
does. Turns alternate between the two in blocks so that drift on a loaded machine falls on both alike; each
figure is the median CPU (``time.process_time``) of a chat-completion turn (a session of ``--turns`` short
turns, each a user message after the history), and of a refused call (a wrong key: 401, whose error body the
middleware reads for its kind). Last, the middleware alone: around an ASGI app that answers at once (no
gateway), beside that app bare, so that its own cost stands out of the turn's noise.

    python bench/gateway_metrics.py                 # --episodes 200 --turns 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections.abc import Sequence
from typing import Any

from gateway import InstantLLM, asgi_call
from prometheus_client import CollectorRegistry

from consumers.runtime import LATENCY_BUCKETS
from pipeline.gateway import RequestMetrics, create_gateway
from pipeline.log import InMemoryStore

from common import machine

POLICY = "bench-metrics"
ADMIN = {"authorization": "Bearer k"}


async def episode(app: Any, turns: int, cpu: dict[str, list[float]]) -> None:
    """One session of ``turns`` turns and one refused call, their CPU appended to ``cpu``."""
    opened = await asgi_call(app, "/admin/sessions", {}, ADMIN)
    key = {"authorization": f"Bearer {opened['api_key']}"}
    history: list[dict[str, Any]] = []
    for index in range(turns):
        history.append({"role": "user", "content": f"turn {index}: say something short"})
        body = json.dumps({"model": POLICY, "messages": history, "max_tokens": 8}).encode()
        started = time.process_time()
        reply = await asgi_call(app, "/v1/chat/completions", body, key)
        cpu["turn"].append(time.process_time() - started)
        history.append(reply["choices"][0]["message"])
    body = json.dumps({"model": POLICY, "messages": history}).encode()
    started = time.process_time()
    await asgi_call(app, "/v1/chat/completions", body, {"authorization": "Bearer wrong"})
    cpu["refused"].append(time.process_time() - started)
    await asgi_call(app, f"/admin/sessions/{opened['session_id']}/end", {}, ADMIN)


class Route:
    path = "/v1/chat/completions"


async def instant(scope: Any, receive: Any, send: Any) -> None:
    """An ASGI app that answers 200 at once, as a matched route (what the middleware reads) would."""
    scope["route"] = Route
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"{}"})


async def alone(rounds: int) -> dict[str, float]:
    """CPU us per request of ``instant``, bare and in ``RequestMetrics`` (alternating blocks, medians)."""
    apps = {"bare": instant, "metered": RequestMetrics(instant, CollectorRegistry(), buckets=LATENCY_BUCKETS)}
    per_block: dict[str, list[float]] = {name: [] for name in apps}

    async def nothing(*_: Any) -> Any:
        return {}

    for _ in range(rounds):
        for name, app in apps.items():
            started = time.process_time()
            for _ in range(1000):
                await app({"type": "http", "method": "POST", "path": "/"}, nothing, nothing)
            per_block[name].append((time.process_time() - started) * 1000)  # us per request
    return {name: statistics.median(blocks) for name, blocks in per_block.items()}


async def run(args: argparse.Namespace) -> None:
    bare = create_gateway(InMemoryStore(), InstantLLM(), admin_key="k", policy_default=POLICY)
    metered = RequestMetrics(
        create_gateway(InMemoryStore(), InstantLLM(), admin_key="k", policy_default=POLICY),
        CollectorRegistry(),
        buckets=LATENCY_BUCKETS,
    )
    apps = {"without metrics": bare, "with metrics": metered}
    cpu: dict[str, dict[str, list[float]]] = {name: {"turn": [], "refused": []} for name in apps}
    for app in apps.values():  # warm-up, not counted
        await episode(app, args.turns, {"turn": [], "refused": []})
    for block in range(args.episodes // 10):
        order = list(apps.items()) if block % 2 == 0 else list(apps.items())[::-1]
        for name, app in order:
            for _ in range(10):
                await episode(app, args.turns, cpu[name])
    print(f"{machine()}; {args.episodes} episodes of {args.turns} turns each way")
    print(f"{'':18}{'CPU us/turn (p50)':>20}{'CPU us/refused call (p50)':>28}")
    medians = {name: {k: statistics.median(v) * 1e6 for k, v in kinds.items()} for name, kinds in cpu.items()}
    for name, figures in medians.items():
        print(f"{name:18}{figures['turn']:>20.0f}{figures['refused']:>28.0f}")
    base, metered_cpu = medians["without metrics"], medians["with metrics"]
    for kind in ("turn", "refused"):
        added = metered_cpu[kind] - base[kind]
        print(
            f"{kind}: metrics add {added:.0f} us ({metered_cpu[kind] / base[kind]:.3f}x the gateway without)"
        )
    bare_us, metered_us = (await alone(50)).values()
    print(
        f"the middleware alone: {metered_us - bare_us:.1f} us a request "
        f"({bare_us:.1f} us bare app, {metered_us:.1f} us in RequestMetrics)"
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--episodes", type=int, default=200, help="sessions each way (a multiple of 10)")
    parser.add_argument("--turns", type=int, default=4, help="turns per session")
    asyncio.run(run(parser.parse_args(argv)))


if __name__ == "__main__":
    main()
