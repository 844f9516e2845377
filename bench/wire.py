"""What reading an inference reply costs as its arrays grow: ``parse_wire`` (the whole ``LLMResponse``
validated, packed token ids and logprobs unpacked) against ``json.loads`` of the same bytes in the same run
(the floor: any reader parses the JSON), at prompt/completion sizes up to a 32k-token turn.

Each size's reply holds that many new prompt ids and a quarter as many completion ids and logprobs, packed
as the consumer sends them, and a text of four characters a completion token. The cost per token must stay
flat as the reply grows (linear, never quadratic).

    python bench/wire.py                 # sizes 100, 1k, 8k, 32k prompt tokens
    python bench/wire.py --sizes 100,4000 --repeat 7
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import timeit
import uuid
from collections.abc import Sequence

from rich.console import Console
from rich.table import Table

from schemas import LLMResponse, parse_wire


def reply_bytes(prompt_tokens: int, rng: random.Random) -> bytes:
    completion = max(prompt_tokens // 4, 1)
    reply = LLMResponse(
        request_id=uuid.UUID(int=rng.getrandbits(128)),
        text="abcd" * completion,
        finish_reason="stop",
        prompt_token_ids=[rng.randrange(150_000) for _ in range(prompt_tokens)],
        completion_token_ids=[rng.randrange(150_000) for _ in range(completion)],
        completion_logprobs=[-rng.random() * 5 for _ in range(completion)],
        policy_version=3,
        consumer_id="bench",
    )
    return reply.model_dump_json().encode()


def best_us(call: object, number: int, repeat: int) -> float:
    """The best of ``repeat`` timings of ``number`` calls, in microseconds a call (the least disturbed)."""
    return min(timeit.repeat(call, number=number, repeat=repeat)) / number * 1e6  # type: ignore[arg-type]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument(
        "--sizes", default="100,1000,8000,32000", help="prompt tokens per reply, comma-separated"
    )
    parser.add_argument(
        "--repeat", type=int, default=5, help="timings per size; the best is kept (default 5)"
    )
    args = parser.parse_args(argv)
    sizes = [int(size) for size in args.sizes.split(",")]
    rng = random.Random(7)
    table = Table(title="reading an LLMResponse: parse_wire against json.loads of the same bytes")
    for column in ("prompt + completion tokens", "bytes", "parse_wire us", "json.loads us", "x json.loads",
                   "parse_wire ns/token"):  # fmt: skip
        table.add_column(column, justify="right")
    for size in sizes:
        data = reply_bytes(size, rng)
        tokens = size + max(size // 4, 1)
        number = max(20, 400_000 // tokens)
        parsed = best_us(lambda data=data: parse_wire(data), number, args.repeat)
        floor = best_us(lambda data=data: json.loads(data), number, args.repeat)
        per_token = parsed * 1000 / tokens
        table.add_row(f"{tokens:,}", f"{len(data):,}", f"{parsed:,.1f}", f"{floor:,.1f}",
                      f"{parsed / floor:.2f}", f"{per_token:.1f}")  # fmt: skip
        print(f"SUMMARY wire parse_wire at {tokens} tokens: {parsed / floor:.2f}x json.loads "
              f"({parsed:.1f} us vs {floor:.1f} us, {per_token:.1f} ns/token)")  # fmt: skip
    Console().print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
