"""Continuous batching in the torch backend (issue 35): a short request beside a long generation, and the
throughput of a batch against one request at a time.

On the long-context tiny model (``turnstile model init-long``: a 4,096-token generation fits its context),
with a ``TorchBackend`` in process:

- ``alone``: a short request's first-token time (from the call to its first token) with nothing else
  running, the median of ``--repeats`` before the long generation and as many after it;
- ``beside``: the same while a ``--long-tokens`` (4,096) greedy generation runs (the opencode title call
  that held its main call in the queue for 225 s), one short request after another, the median;
- ``one at a time`` (``--serial``; ~a minute): the same with ``max_batch=1``, what a backend that does not
  add a request to a running generation gives: the short one waits for the long one to end;
- throughput: ``--requests`` requests of ``--tokens`` tokens each, all at once, generated tokens per
  second with ``max_batch`` 16 against ``max_batch=1`` (one at a time), in the same run.

The target (issue 35): the short request's first token beside the long generation within 2x its time alone.

    python bench/batching.py
    python bench/batching.py --repeats 9 --serial

Report ``cat /proc/loadavg`` beside the figures (the first line has it): the machine is shared.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from pipeline.inference.backends.torch_backend import TorchBackend
from pipeline.inference.tinymodel import build_long_model
from schemas import ChatMessage, LLMRequest, SamplingParams

from common import machine, note, summary

LONG_PROMPT = "Write a long story."
"""Greedy on the long tiny model, this runs to 4,096 tokens without an end-of-message token."""


def ask(content: str, max_tokens: int, **sampling: float | int) -> LLMRequest:
    return LLMRequest(
        policy="p",
        messages=[ChatMessage(role="user", content=content)],
        sampling=SamplingParams(max_tokens=max_tokens, **sampling),
    )


async def first_token_s(backend: TorchBackend, index: int) -> float:
    """One short request (16 tokens): seconds from the call to its first token."""
    called = time.monotonic()
    generation = await backend.generate(ask(f"Give the session a title {index}", 16, temperature=1.0))
    return generation.first_token_at - called


def describe(median: float, times: list[float]) -> str:
    return f"median {median * 1000:.1f} ms, best {min(times) * 1000:.1f} ms, of {len(times)}"


async def shorts(backend: TorchBackend, repeats: int) -> list[float]:
    return [await first_token_s(backend, index) for index in range(repeats)]


async def beside_long(backend: TorchBackend, repeats: int, long_tokens: int) -> tuple[list[float], int]:
    """Short requests one after another while a long greedy generation runs; their first-token times and
    the tokens the long one generated."""
    long = asyncio.create_task(backend.generate(ask(LONG_PROMPT, long_tokens, temperature=0.0)))
    # until it is decoding, so that the shorts arrive mid-generation (the step counter is a plain int: polled)
    while backend.steps < 50 and not long.done():  # noqa: ASYNC110
        await asyncio.sleep(0.01)
    times = await shorts(backend, repeats)
    if not long.done():
        note(f"the long generation was still running after the short requests ({backend.steps} steps)")
    return times, len((await long).completion_token_ids)


async def throughput(backend: TorchBackend, requests: int, tokens: int) -> float:
    """Generated tokens per second for ``requests`` requests sent at once (seeded: the same tokens for
    every backend)."""
    started = time.monotonic()
    generations = await asyncio.gather(
        *(backend.generate(ask(f"question {i}", tokens, temperature=1.0, seed=i)) for i in range(requests))
    )
    return sum(len(g.completion_token_ids) for g in generations) / (time.monotonic() - started)


async def main(arguments: argparse.Namespace) -> None:
    print(machine(), flush=True)
    with tempfile.TemporaryDirectory(prefix="turnstile-bench-batching-") as scratch:
        model = build_long_model(Path(scratch) / "long")
        batched = TorchBackend(model, max_batch=16)
        serial = TorchBackend(model, max_batch=1)
        await shorts(batched, 2)  # warm-up
        before = await shorts(batched, arguments.repeats)
        times, generated = await beside_long(batched, arguments.repeats, arguments.long_tokens)
        alone = statistics.median([*before, *await shorts(batched, arguments.repeats)])
        beside = statistics.median(times)
        note(f"short request alone: first token {describe(alone, before)} (before and after the long one)")
        note(f"beside a {generated}-token generation: first token {describe(beside, times)}")
        if arguments.serial:
            waited, _ = await beside_long(serial, 1, arguments.long_tokens)
            note(f"one at a time (max_batch=1): first token {waited[0] * 1000:.0f} ms")
        one_by_one = await throughput(serial, arguments.requests, arguments.tokens)
        together = await throughput(batched, arguments.requests, arguments.tokens)
        note(
            f"{arguments.requests} requests of {arguments.tokens} tokens: {together:.0f} tokens/s batched, "
            f"{one_by_one:.0f} tokens/s one at a time"
        )
        await batched.close()
        await serial.close()
    summary(
        "batching",
        f"short request's first token beside a {generated}-token generation / alone",
        f"{beside * 1000:.1f} ms",
        f"{alone * 1000:.1f} ms alone",
        beside / alone,
        "<= 2.0",
        beside / alone <= 2.0,
    )
    summary(
        "batching",
        f"throughput, {arguments.requests} requests batched / one at a time",
        f"{together:.0f} tokens/s",
        f"{one_by_one:.0f} tokens/s",
        together / one_by_one,
        None,
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=15, help="short requests per median")
    parser.add_argument("--long-tokens", type=int, default=4096, help="the long generation's tokens")
    parser.add_argument("--requests", type=int, default=16, help="requests in the throughput run")
    parser.add_argument("--tokens", type=int, default=64, help="tokens each in the throughput run")
    parser.add_argument("--serial", action="store_true", help="also one at a time beside the long one")
    asyncio.run(main(parser.parse_args()))
