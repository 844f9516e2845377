"""Inference consumer memory over a soak: is growth the held-turn budget filling, or a leak?

A 117k-episode soak grew a consumer from 137 to 559 MB. This runs ``--episodes`` multi-turn episodes
through an ``InferenceService`` in this process (the consumer's own request handling: parse, generate,
keep the turn, the reply) and prints, every ``--every`` episodes: the process's RSS, the memory Python has
allocated (tracemalloc), what the held turns account for (``held.bytes``, at most ``--held-mib``), the held
turns and evictions, and the replies kept for retries (``RetryReplies``: by count and by bytes).

Each turn continues the last by its held key, as sessions do: a 600-character system prompt and a tools
list on the first turn, a tool result and a user line on each later one. The backend (``--backend``):
``scripted`` makes an id per 4 characters of each new message and 32 completion ids (ids over 256, so
each is an int object of its own, as an engine's ``tolist()`` gives them); ``torch`` runs the tiny model
(``--model DIR``, ``turnstile model init-tiny``), slower: use a few hundred episodes.

Two runs, side by side in one process: the baseline with nothing held (``--held-mib 0``), then the run
with the budget. Their difference in allocated memory at the end is what holding costs; the figure is what
the budget accounts for against that difference (near 1: the accounting is right), and a leak shows as
growth that goes on in the second half of a run, after the budget and the retry replies are full.
At the end, the ten lines that allocated most of what is still held (tracemalloc).

    python bench/inference_memory.py                         # 20,000 episodes of 4 turns, 64 MiB held
    python bench/inference_memory.py --episodes 100000 --held-mib 256
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import sys
import time
import tracemalloc
import zlib
from pathlib import Path

from pipeline.inference import InferenceService
from pipeline.inference.backends import Backend, Generation
from pipeline.inference.backends.scripted import ScriptedBackend
from pipeline.inference.chain import Chain
from schemas import ChatMessage, LLMRequest, LLMResponse, TokenPrefix, ToolSpec, parse_wire

from common import note, summary

SYSTEM = "You are a careful agent. " * 24  # 600 characters
TOOLS = [
    ToolSpec.model_validate(
        {"function": {"name": name, "description": f"Run {name} in the sandbox and return its output.",
                      "parameters": {"type": "object", "properties": {
                          "command": {"type": "string", "description": "what to run"},
                          "timeout": {"type": "integer", "description": "seconds", "minimum": 1}},
                          "required": ["command"]}}}
    )
    for name in ("bash", "read_file", "write_file", "search")
]  # fmt: skip
COMPLETION = 32


class TokenizingBackend(ScriptedBackend):
    """The scripted backend with an id per 4 characters of each new message, and 32 completion ids."""

    async def generate(self, request: LLMRequest) -> Generation:
        generation = await super().generate(request)
        new: list[int] = []
        for message in request.messages[-2:] if request.prefix else request.messages:
            text = message.content or ""
            seed = zlib.crc32(text.encode())
            new += [300 + (seed + i) % 30_000 for i in range(max(1, len(text) // 4))]
        prompt = Chain.of(request.prefix.ids).then(new) if request.prefix else new
        completion = [300 + (len(new) * 7 + i) % 30_000 for i in range(COMPLETION)]
        return dataclasses.replace(
            generation,
            prompt_token_ids=prompt,
            completion_token_ids=completion,
            completion_logprobs=[-0.5] * COMPLETION,
        )


def make_backend(name: str, model: Path | None) -> Backend:
    if name == "torch":
        if model is None:
            raise SystemExit("--backend torch needs --model DIR (turnstile model init-tiny DIR)")
        from pipeline.inference.backends.torch_backend import TorchBackend

        return TorchBackend(model)
    return TokenizingBackend(text="Running it now.")


async def publish(subject: str, body: bytes, headers: dict[str, str]) -> None:
    return None


async def call(service: InferenceService, request: LLMRequest) -> LLMResponse:
    reply = parse_wire(await service.handle(request.model_dump_json(exclude_none=True).encode(), None))
    assert isinstance(reply, LLMResponse), reply
    return reply


async def episode(service: InferenceService, index: int, turns: int) -> None:
    """One conversation: each turn after the first continues the last by its held key, when it is held."""
    messages = [
        ChatMessage(role="system", content=SYSTEM),
        ChatMessage(role="user", content=f"Task {index}: list the files and count the lines of each."),
    ]
    reply = await call(service, LLMRequest(policy="p", messages=messages, tools=TOOLS))
    held = (reply.prompt_prefix_tokens + len(reply.prompt_token_ids) + COMPLETION, len(messages) + 1)
    for turn in range(1, turns):
        new = [
            ChatMessage(role="user", content=f"[tool output {turn}] " + "file.py 120 lines\n" * 8),
            ChatMessage(role="user", content=f"Now the next step ({turn})."),
        ]
        if reply.tokens_key is None:  # not held (budget 0): the whole conversation again, as sessions do
            prefix = TokenPrefix(
                token_ids=[*range(300, 300 + held[0])], message_count=held[1]
            )  # stand-in ids: what the baseline measures is the service's memory, not these
            assistant = ChatMessage(role="assistant", content=reply.text)
            request = LLMRequest(
                policy="p", messages=[*messages, assistant, *new], tools=TOOLS, prefix=prefix
            )
        else:
            prefix = TokenPrefix(key=reply.tokens_key, token_count=held[0], message_count=held[1])
            request = LLMRequest(policy="p", messages=new, prefix=prefix)
        reply = await call(service, request)
        held = (held[0] + len(reply.prompt_token_ids) + COMPLETION, held[1] + len(new) + 1)


def rss_mib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096 / 2**20


def memory_now() -> float:
    """Bytes Python has allocated (tracemalloc), or the process's RSS with --no-tracemalloc (tracemalloc's
    own record of each block takes memory too, so RSS is measured without it)."""
    return tracemalloc.get_traced_memory()[0] if tracemalloc.is_tracing() else rss_mib() * 2**20


@dataclasses.dataclass
class Run:
    allocated_mib: float = 0.0
    growth_second_half_mib: float = 0.0


async def soak(label: str, backend: Backend, args: argparse.Namespace, held_mib: float) -> Run:
    service = InferenceService(
        backend, policy="p", consumer_id="bench", publish=publish, held_bytes=int(held_mib * 2**20)
    )
    gc.collect()
    start = memory_now()
    half: float | None = None
    began = time.perf_counter()
    note(f"{label}: {args.episodes} episodes of {args.turns} turns, {held_mib:g} MiB held")
    print(f"{'episodes':>9} {'RSS MiB':>8} {'alloc MiB':>9} {'held MiB':>9} {'held turns':>10} "
          f"{'evicted':>8} {'retry replies':>13} {'replies MiB':>11}")  # fmt: skip
    for index in range(1, args.episodes + 1):
        await episode(service, index, args.turns)
        if index % args.every == 0 or index == args.episodes:
            allocated = (memory_now() - start) / 2**20
            replies = service.retry_replies.bytes / 2**20
            held, recent = service.held, len(service.retry_replies)
            print(f"{index:>9} {rss_mib():>8.1f} {allocated:>9.1f} {held.bytes / 2**20:>9.1f} "
                  f"{len(held):>10} {held.evicted:>8} {recent:>13} {replies:>11.1f}", flush=True)  # fmt: skip
            if half is None and index >= args.episodes // 2:
                half = allocated
    gc.collect()
    allocated = (memory_now() - start) / 2**20
    seconds = time.perf_counter() - began
    note(f"{label}: {args.episodes * args.turns / seconds:,.0f} turns/s; {allocated:.1f} MiB allocated")
    run = Run(allocated, allocated - (half or allocated))
    run.service = service  # type: ignore[attr-defined]  # kept alive for the snapshot
    return run


async def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--episodes", type=int, default=20_000)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--held-mib", type=float, default=64.0)
    parser.add_argument("--every", type=int, default=2_000)
    parser.add_argument("--backend", choices=["scripted", "torch"], default="scripted")
    parser.add_argument("--model", type=Path)
    parser.add_argument("--no-tracemalloc", action="store_true", help="measure RSS instead (no top lines)")
    args = parser.parse_args()
    if not args.no_tracemalloc:
        tracemalloc.start(1)
    baseline = await soak("baseline (nothing held)", make_backend(args.backend, args.model), args, 0)
    del baseline.service  # type: ignore[attr-defined]
    held = await soak("held", make_backend(args.backend, args.model), args, args.held_mib)
    service: InferenceService = held.service  # type: ignore[attr-defined]
    if tracemalloc.is_tracing():
        print("\nwhere the memory still allocated was allocated (top 10 lines):")
        for stat in tracemalloc.take_snapshot().statistics("lineno")[:10]:
            frame = stat.traceback[0]
            print(f"  {stat.size / 2**20:8.1f} MiB {stat.count:>9,} blocks  {frame.filename}:{frame.lineno}")
    measured = "allocated" if tracemalloc.is_tracing() else "RSS"
    holding = held.allocated_mib - baseline.allocated_mib
    accounted = service.held.bytes / 2**20
    kept = service.retry_replies
    print(f"\nretry replies kept: at most {kept.max_replies} and {kept.max_bytes / 2**20:g} MiB "
          "(not part of the held budget)")  # fmt: skip
    for label, run in (("baseline", baseline), ("held", held)):
        print(f"{label}: {measured} grew {run.growth_second_half_mib:+.1f} MiB over the second half")
    ratio = accounted / holding if holding else 0.0
    summary(
        "inference_memory",
        "held bytes accounted / memory holding costs (with - without held turns)",
        f"{accounted:.1f} MiB accounted", f"{holding:.1f} MiB {measured}", ratio,
        "0.8-1.25", 0.8 <= ratio <= 1.25,
    )  # fmt: skip


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
