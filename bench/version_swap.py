"""New policy versions under a steady request load: loaded in place against the restart path, same run.

For each backend (torch, and vLLM where it is installed: run with ``.venv-vllm/bin/python``) on the tiny
model, one backend started once, and for each request size (``--max-tokens 8,32``): ``--senders`` requesters
each keep one request in flight through the consumer's ``InferenceService`` (the code a NATS message
reaches, in process: the NATS hop is the same for every path and left out). Then ``--swaps`` versions are
published (``PolicyVersionPublished`` handed to ``service.on_version``) and loaded in place for each policy
for the requests in flight (``--in-flight restart,drain``: cut short and run again on the new version, or
finished on the old one first), then ``--restarts`` more with in-place loading off, drained (the baseline:
vLLM restarts its engine on the checkpoint; torch loads a whole new model, as the backend did before). Per
swap: the time from the publication to the first reply tagged with the new version (the figure the target
is set on), the replies that failed (an ``LLMError``), those that finished on the old version after the
publication, those restarted on the new one (``timings.restarted_ms`` > 0), and the time to the first
token of a new-version reply (the same less that reply's decoding, which both paths pay alike)::

    .venv-vllm/bin/python bench/version_swap.py               # torch and vLLM
    .venv/bin/python bench/version_swap.py --backends torch --max-tokens 8,32
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
from collections.abc import Iterator
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

from common import machine, note, summary  # noqa: E402

POLICY = "bench"
TARGET_RATIO = 10.0


@dataclass(frozen=True)
class Reply:
    at: float
    version: int
    restarted: bool
    sender: int
    first_token_at: float
    """When its first token was sampled: ``at`` less the time from its first token to its last."""


@dataclass
class Load:
    """The replies of the steady load (``Reply`` each) and the failures."""

    replies: list[Reply] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    """Set by every reply or failure; cleared by whoever waits for the next."""

    def record(self, body: dict[str, Any], sender: int) -> None:
        if "policy_version" in body:
            timings, at = body.get("timings", {}), time.monotonic()
            restarted = bool(timings.get("restarted_ms"))
            decoding = (timings.get("total_ms", 0.0) - timings.get("first_token_ms", 0.0)) / 1000
            self.replies.append(Reply(at, int(body["policy_version"]), restarted, sender, at - decoding))
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
    restarted: int
    """Replies run again on the new version after a swap cut them short."""
    loaded: float
    """From the publication to the backend's load_version returning (the weights in use)."""
    to_first_token: float
    """From the publication to the first token of a reply tagged with the new version: the swap without
    the decoding of that reply's later tokens, which both paths pay alike."""


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
        load.record(json.loads(await service.handle(request(index, max_tokens), None)), sender=first)
        index += step


class Published:
    """The versions this run published, standing in for the log that the service checks each one against:
    the check costs the same on every path (one look-up), so the bench needs no PostgreSQL (nor does the
    GPU machine that runs bench/gpu_swap.sh)."""

    def __init__(self) -> None:
        self.checkpoints: dict[int, str] = {}

    async def checkpoint(self, policy: str, version: int) -> str | None:
        return self.checkpoints.get(version)

    async def newest(self, policy: str) -> tuple[int, str] | None:
        return max(self.checkpoints.items(), default=None)


async def swap(service: InferenceService, load: Load, version: int, checkpoint: Path, senders: int) -> Swap:
    published = PolicyVersionPublished(policy=POLICY, version=version, checkpoint=str(checkpoint))
    assert isinstance(service.versions, Published)
    service.versions.checkpoints[version] = str(checkpoint)  # as the trainer does: the log first
    failed_before, seen = len(load.failures), len(load.replies)
    started = time.monotonic()

    async def publish_and_load() -> float:
        await service.on_version(published.model_dump_json().encode())
        return time.monotonic()

    loading = asyncio.create_task(publish_and_load())
    while not any(reply.version == version for reply in load.replies[seen:]):
        if loading.done() and service.backend.policy_version != version:
            raise RuntimeError(f"version {version} was not loaded: see the log")
        await load.next()
    first = next(reply.at for reply in load.replies[seen:] if reply.version == version)
    loaded = await loading - started
    # The requests in flight at the publication: each sender's first reply after it
    while len(answered := _first_per_sender(load.replies[seen:], started)) < senders:
        await load.next()
    old = sum(1 for reply in answered if reply.version < version)
    restarted = sum(1 for reply in answered if reply.restarted)
    # among the replies in by now (each sender's first after the publication, at least)
    token = min(reply.first_token_at for reply in load.replies[seen:] if reply.version == version)
    failed = len(load.failures) - failed_before
    return Swap(first - started, failed, old, restarted, loaded, token - started)


def _first_per_sender(replies: list[Reply], since: float) -> list[Reply]:
    firsts: dict[int, Reply] = {}
    for reply in replies:
        if reply.at >= since:
            firsts.setdefault(reply.sender, reply)
    return list(firsts.values())


@dataclass(frozen=True)
class Way:
    """One way of loading a version: in place with an in-flight policy, or the restart baseline."""

    name: str
    in_place: bool
    in_flight: str


def paths(in_flight: list[str], swaps: int, restarts: int) -> Iterator[Way]:
    for policy in in_flight:
        for _ in range(swaps):
            yield Way(f"in place, {policy}", True, policy)
    for _ in range(restarts):
        yield Way("restart", False, "drain")  # the path before in-place loading: drain, then restart


async def measure(
    backend: Any, plan: list[Way], versions: Iterator[Path], senders: int, max_tokens: int
) -> list[Swap]:
    """One swap per entry of ``plan``, under a steady load of ``max_tokens``-token requests."""
    service = InferenceService(
        backend,
        policy=POLICY,
        consumer_id="bench",
        publish=_no_publish,
        versions=Published(),  # type: ignore[arg-type]
    )
    load = Load()
    tasks = [asyncio.create_task(sender(service, load, i, senders, max_tokens)) for i in range(senders)]
    swaps = []
    try:
        await load.replies_reach(len(load.replies) + 2 * senders)
        for way in plan:
            backend.in_place, backend.in_flight = way.in_place, way.in_flight
            number = backend.policy_version + 1
            swaps.append(await swap(service, load, number, next(versions), senders))
            note(f"  version {number} ({way.name}): {swaps[-1]}")
            await load.replies_reach(len(load.replies) + senders)  # the load runs on the new version a while
    finally:
        load.stop.set()
        await asyncio.gather(*tasks)
    for failure in load.failures[:5]:
        note(f"  failed: {failure}")
    return swaps


def report(kind: str, max_tokens: int, plan: list[Way], swaps: list[Swap]) -> list[str]:
    """A SUMMARY line per in-place policy against the restart baseline; the table's rows, returned."""
    by_way: dict[str, list[Swap]] = {}
    for way, measured in zip(plan, swaps, strict=True):
        by_way.setdefault(way.name, []).append(measured)
    slow = statistics.median(s.seconds for s in by_way["restart"])
    rows = []
    for name, measured in by_way.items():
        median = statistics.median(s.seconds for s in measured)
        failed = sum(s.failed for s in measured)
        each = ", ".join(f"{s.seconds:.2f}" for s in measured)
        rows.append(
            f"| {kind} | {max_tokens} | {name} | {median:.2f} s ({each}) | {slow / median:.1f}x | {failed} "
            f"| {sum(s.finished_on_old for s in measured)} | {sum(s.restarted for s in measured)} "
            f"| {statistics.median(s.loaded for s in measured):.2f} s "
            f"| {statistics.median(s.to_first_token for s in measured):.2f} s |"
        )
        if name != "restart":
            summary(
                "version_swap",
                f"{kind} {max_tokens}-token requests, {name}: publication to first new-version reply",
                f"{median * 1000:.0f} ms, {failed} failed",
                f"{slow * 1000:.0f} ms restart",
                slow / median,
                f">= {TARGET_RATIO:.0f}x, 0 failed",
                slow / median >= TARGET_RATIO and failed == 0,
            )
    return rows


TABLE_HEAD = (
    "| backend | tokens | path | to first new-version reply (median; each) | vs restart | failed "
    "| finished on old | restarted on new | load_version | to first new-version token |\n"
    "| --- | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"
)


async def run_backend(kind: str, base: Path, versions: Iterator[Path], arguments: argparse.Namespace) -> None:
    senders = arguments.senders
    if kind == "torch":
        from pipeline.inference.backends.torch_backend import TorchBackend

        backend: Any = TorchBackend(base, max_batch=senders)
    else:
        from pipeline.inference.backends.vllm_backend import VllmBackend

        backend = VllmBackend(base)
        await backend.start()
    # torch always drains (its running requests finish on the old version while admission pauses)
    policies = arguments.in_flight if kind == "vllm" else ["drain"]
    plan = list(paths(policies, arguments.swaps, arguments.restarts))
    rows = []
    try:
        for max_tokens in arguments.max_tokens:
            note(f"{kind}: {senders} senders, {max_tokens} tokens a request, {len(plan)} versions")
            swaps = await measure(backend, plan, versions, senders, max_tokens)
            rows += report(kind, max_tokens, plan, swaps)
    finally:
        await backend.close()
    note(f"{kind}: the backend counted {backend.in_place_loads} loads in place, {backend.restarts} restarts")
    print("\n".join([TABLE_HEAD, *rows]), flush=True)


async def _no_publish(subject: str, data: bytes, headers: dict[str, str]) -> None:
    """Heartbeats have nowhere to go in process (the requests carry no reply inbox)."""


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--backends", default="torch,vllm", help="comma-separated: torch, vllm")
    parser.add_argument(
        "--swaps", type=int, default=3, help="versions loaded in place per in-flight policy (default 3)"
    )
    parser.add_argument(
        "--restarts", type=int, default=None, help="versions loaded by the restart path (default: --swaps)"
    )
    parser.add_argument(
        "--in-flight", type=_names("restart", "drain"), default="restart,drain", help="in-place policies"
    )
    parser.add_argument("--senders", type=int, default=4, help="requests kept in flight (default 4)")
    parser.add_argument(
        "--max-tokens", type=_sizes, default="32", help="tokens a request, comma-separated (default 32)"
    )
    arguments = parser.parse_args()
    if arguments.restarts is None:
        arguments.restarts = arguments.swaps
    kinds = [kind.strip() for kind in arguments.backends.split(",") if kind.strip()]
    if "vllm" in kinds:
        try:
            import vllm  # noqa: F401
        except ImportError:
            note("vLLM is not installed here: run with .venv-vllm/bin/python (see .ci/run); torch only")
            kinds.remove("vllm")
    # is_available() asks the driver without starting CUDA here: vLLM's engine process may then fork
    note(f"{machine()}; {'CUDA' if torch.cuda.is_available() else 'no GPU'}")
    with tempfile.TemporaryDirectory(prefix="version-swap-") as scratch:
        base = build_tiny_model(Path(scratch) / "v0")
        per_size = len(arguments.in_flight) * arguments.swaps + arguments.restarts
        versions = checkpoints(base, per_size * len(arguments.max_tokens))
        for kind in kinds:
            asyncio.run(run_backend(kind, base, iter(versions), arguments))


def _names(*allowed: str) -> Any:
    def parse(text: str) -> list[str]:
        names = [name.strip() for name in text.split(",") if name.strip()]
        wrong = [name for name in names if name not in allowed]
        if wrong or not names:
            raise argparse.ArgumentTypeError(f"{text!r}: give some of {', '.join(allowed)}, comma-separated")
        return names

    return parse


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(size) for size in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give token counts of 1 or more, comma-separated")
    return sizes


if __name__ == "__main__":
    sys.exit(main())
