"""New policy versions under a steady request load: loaded in place against the restart path, same run.

For each backend (torch, and vLLM where it is installed: run with ``.venv-vllm/bin/python``) on the tiny
model, ``--senders`` requesters each keep one request in flight through the consumer's ``InferenceService``
(the code a NATS message reaches, in process: the NATS hop is the same for both paths and left out). Then
``--swaps`` versions are published (``PolicyVersionPublished`` handed to ``service.on_version``) and loaded
in place, then as many again with in-place loading off (vLLM: the engine restarts on the checkpoint; torch:
a whole new model is loaded, as the backend did before). Per swap: the time from the publication to the
first reply tagged with the new version, the replies that failed (an ``LLMError``), and those that finished
on the old version after the publication (a request in flight across a swap is finished on the old one,
never re-run)::

    .venv-vllm/bin/python bench/version_swap.py               # torch and vLLM
    .venv/bin/python bench/version_swap.py --backends torch
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

for name, value in {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "HF_HUB_OFFLINE": "1",
}.items():
    os.environ.setdefault(name, value)

import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from pipeline.inference import InferenceService  # noqa: E402
from pipeline.inference.tinymodel import build_tiny_model  # noqa: E402
from schemas import ChatMessage, LLMRequest, PolicyVersionPublished, SamplingParams  # noqa: E402

from common import note, summary  # noqa: E402

POLICY = "bench"
TARGET_RATIO = 10.0


@dataclass
class Load:
    """The replies of the steady load: (monotonic time, version) each, and the failures."""

    replies: list[tuple[float, int]] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    """Set by every reply or failure; cleared by whoever waits for the next."""

    def record(self, body: dict[str, Any]) -> None:
        if "policy_version" in body:
            self.replies.append((time.monotonic(), int(body["policy_version"])))
        else:
            self.failures.append(f"{body.get('code')}: {body.get('message')}")
        self.arrived.set()

    async def next(self) -> None:
        self.arrived.clear()
        await self.arrived.wait()

    async def replies_reach(self, count: int) -> None:
        while len(self.replies) < count:
            await self.next()


@dataclass(frozen=True)
class Swap:
    seconds: float
    """From the publication to the first reply tagged with the new version."""
    failed: int
    finished_on_old: int
    loaded: float
    """From the publication to the backend's load_version returning (the weights in use)."""


def checkpoints(base: Path, count: int) -> list[Path]:
    """``count`` versions of the tiny model: its weights with the output layer scaled (same shapes)."""
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    original = model.lm_head.weight.detach().clone()
    directories = []
    for version in range(1, count + 1):
        with torch.no_grad():
            model.lm_head.weight.copy_(original * (1.0 + 0.25 * version))
        directory = base.parent / f"v{version}"
        model.save_pretrained(str(directory))
        directories.append(directory)
    return directories


def request(index: int, max_tokens: int) -> bytes:
    ask = LLMRequest(
        policy=POLICY,
        messages=[ChatMessage(role="user", content=f"question {index}: tell me about Paris")],
        sampling=SamplingParams(max_tokens=max_tokens, seed=index),
    )
    return ask.model_dump_json().encode()


async def sender(service: InferenceService, load: Load, first: int, step: int, max_tokens: int) -> None:
    """One request in flight at every moment until told to stop."""
    index = first
    while not load.stop.is_set():
        load.record(json.loads(await service.handle(request(index, max_tokens), None)))
        index += step


async def swap(service: InferenceService, load: Load, version: int, checkpoint: Path) -> Swap:
    published = PolicyVersionPublished(policy=POLICY, version=version, checkpoint=str(checkpoint))
    failed_before, seen = len(load.failures), len(load.replies)
    started = time.monotonic()

    async def publish_and_load() -> float:
        await service.on_version(published.model_dump_json().encode())
        return time.monotonic()

    loading = asyncio.create_task(publish_and_load())
    while not any(v == version for _, v in load.replies[seen:]):
        if loading.done() and service.backend.policy_version != version:
            raise RuntimeError(f"version {version} was not loaded: see the log")
        await load.next()
    first = next(t for t, v in load.replies[seen:] if v == version)
    loaded = await loading - started
    old = sum(1 for t, v in load.replies[seen:] if v < version and t >= started)
    return Swap(first - started, len(load.failures) - failed_before, old, loaded)


async def measure(backend: Any, versions: list[Path], senders: int, max_tokens: int) -> list[Swap]:
    """Half the versions in place, the other half with in-place loading off."""
    service = InferenceService(backend, policy=POLICY, consumer_id="bench", publish=_no_publish)
    load = Load()
    tasks = [asyncio.create_task(sender(service, load, i, senders, max_tokens)) for i in range(senders)]
    swaps = []
    try:
        await load.replies_reach(2 * senders)
        for number, checkpoint in enumerate(versions, start=1):
            backend.in_place = number <= len(versions) // 2
            swaps.append(await swap(service, load, number, checkpoint))
            path = "in place" if backend.in_place else "restart"
            note(f"  version {number} ({path}): {swaps[-1]}")
            await load.replies_reach(len(load.replies) + senders)  # the load runs on the new version a while
    finally:
        load.stop.set()
        await asyncio.gather(*tasks)
    for failure in load.failures[:5]:
        note(f"  failed: {failure}")
    return swaps


async def run_backend(kind: str, base: Path, versions: list[Path], senders: int, max_tokens: int) -> None:
    note(f"{kind}: {senders} senders, {max_tokens} tokens a request, {len(versions)} versions")
    if kind == "torch":
        from pipeline.inference.backends.torch_backend import TorchBackend

        backend: Any = TorchBackend(base, max_batch=senders)
    else:
        from pipeline.inference.backends.vllm_backend import VllmBackend

        backend = VllmBackend(base)
        await backend.start()
    try:
        swaps = await measure(backend, versions, senders, max_tokens)
    finally:
        await backend.close()
    half = len(swaps) // 2
    in_place, restart = swaps[:half], swaps[half:]
    fast = statistics.median(s.seconds for s in in_place)
    slow = statistics.median(s.seconds for s in restart)
    failed = sum(s.failed for s in swaps)
    old = sum(s.finished_on_old for s in in_place)
    loads = [statistics.median(s.loaded for s in part) * 1000 for part in (in_place, restart)]
    note(
        f"{kind}: in place {fast * 1000:.0f} ms (median of {half}), restart {slow * 1000:.0f} ms; "
        f"{failed} failed; {old} finished on the old version across the in-place swaps, 0 re-run; "
        f"backend counted {backend.in_place_loads} in place, {backend.restarts} restarts; "
        f"load_version took {loads[0]:.0f} ms in place, {loads[1]:.0f} ms by the restart path"
    )
    ratio = slow / fast
    summary(
        "version_swap",
        f"{kind} publication to first new-version reply",
        f"{fast * 1000:.0f} ms in place, {failed} failed",
        f"{slow * 1000:.0f} ms restart",
        ratio,
        f">= {TARGET_RATIO:.0f}x, 0 failed",
        ratio >= TARGET_RATIO and failed == 0,
    )


async def _no_publish(subject: str, data: bytes, headers: dict[str, str]) -> None:
    """Heartbeats have nowhere to go in process (the requests carry no reply inbox)."""


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--backends", default="torch,vllm", help="comma-separated: torch, vllm")
    parser.add_argument("--swaps", type=int, default=3, help="versions loaded each way (default 3)")
    parser.add_argument("--senders", type=int, default=4, help="requests kept in flight (default 4)")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens a request (default 32)")
    arguments = parser.parse_args()
    kinds = [kind.strip() for kind in arguments.backends.split(",") if kind.strip()]
    if "vllm" in kinds:
        try:
            import vllm  # noqa: F401
        except ImportError:
            note("vLLM is not installed here: run with .venv-vllm/bin/python (see .ci/run); torch only")
            kinds.remove("vllm")
    with tempfile.TemporaryDirectory(prefix="version-swap-") as scratch:
        base = build_tiny_model(Path(scratch) / "v0")
        versions = checkpoints(base, 2 * arguments.swaps)
        for kind in kinds:
            asyncio.run(run_backend(kind, base, versions, arguments.senders, arguments.max_tokens))


if __name__ == "__main__":
    sys.exit(main())
