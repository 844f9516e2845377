"""Batch payloads: the safetensors format (version 2) against the TSB1 format it replaces, in one run.

For ``--samples`` samples (default 64) of ``--min-tokens``..``--max-tokens`` tokens (default 200..1000,
a quarter of them prompt with a loss mask of 0), the same batch is encoded both ways and each way is timed
(median of ``--repeat`` runs, after one warm-up):

- encode: what the materializer does per batch, from the samples' packed arrays (``samples.arrays``):
  ``encode_packed`` against the version-1 encoder ``encode_packed_v1``.
- to tensors: what a trainer does per batch before its step. TSB1 (the baseline): ``decode_batch`` into
  Python objects, then ``to_tensors`` (right-padded torch tensors). safetensors: ``payload_tensors`` (the
  reference trainer's path), and a trainer outside this codebase (``safetensors.torch.load`` + padding
  with ``pad_sequence``; no project code).
- decode: ``decode_batch`` of each into a ``TrainingBatch`` (what the relay's readers and tests use).

The ratio column is the baseline's time over the row's (above 1: faster than TSB1).

    python bench/batches.py
    python bench/batches.py --samples 256 --max-tokens 4000
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from safetensors.torch import load
from torch.nn.utils.rnn import pad_sequence

from pipeline.batches.format import (
    BatchSample,
    TrainingBatch,
    decode_batch,
    encode_packed,
    encode_packed_v1,
    encode_v1,
    pack_arrays,
)
from pipeline.training import payload_tensors, to_tensors

from common import machine, summary


def make_batch(samples: int, low: int, high: int, seed: int) -> TrainingBatch:
    rng = random.Random(seed)
    made = []
    for n in range(samples):
        length = rng.randint(low, high)
        prompt = length // 4
        ids = tuple(rng.randrange(150_000) for _ in range(length))
        mask = (0,) * prompt + (1,) * (length - prompt)
        logprobs = tuple(0.0 if m == 0 else -rng.random() * 3 for m in mask)
        made.append(
            BatchSample(
                f"sample-{n:04d}", f"episode-{n // 2}", f"group-{n // 8}", (f"turn-{n}",), rng.randint(0, 9),
                rng.random(), rng.gauss(0, 1), False, ids, mask, logprobs,
            )
        )  # fmt: skip
    return TrainingBatch("batch-0001", "main", "config-hash", 10, tuple(made))


def outside_trainer(payload: bytes) -> dict[str, torch.Tensor]:
    """What a trainer without this codebase does: load, cut by cu_seqlens, pad."""
    tensors = load(payload)
    lengths = tensors["cu_seqlens"].diff().tolist()
    return {
        name: pad_sequence(list(torch.split(tensors[name], lengths)), batch_first=True)
        for name in ("input_ids", "loss_mask", "logprobs")
    }


def timed(fn: Callable[[], Any], repeat: int) -> float:
    fn()  # warm-up
    runs = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - start)
    return statistics.median(runs)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--min-tokens", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)

    batch = make_batch(args.samples, args.min_tokens, args.max_tokens, args.seed)
    headers = [sample.header() for sample in batch.samples]
    packed = [pack_arrays(s.input_ids, s.loss_mask, s.logprobs) for s in batch.samples]

    def encode_v2() -> bytes:
        return encode_packed(
            batch.batch_id, batch.policy, batch.config_hash, batch.newest_version, headers, packed
        )

    old, new = encode_v1(batch), encode_v2()
    assert decode_batch(old) == decode_batch(new)  # logprobs are float32 in both: not == batch
    assert torch.equal(payload_tensors(new).input_ids, to_tensors(decode_batch(old)).input_ids)

    rows: list[tuple[str, str, float, float]] = []
    fields = (batch.batch_id, batch.policy, batch.config_hash, batch.newest_version, headers, packed)
    encode_base = timed(lambda: encode_packed_v1(*fields), args.repeat)
    rows.append(("encode", "TSB1 (baseline)", encode_base, encode_base))
    rows.append(("encode", "safetensors (encode_packed)", timed(encode_v2, args.repeat), encode_base))
    tensors_base = timed(lambda: to_tensors(decode_batch(old)), args.repeat)
    rows.append(("to tensors", "TSB1: decode_batch + to_tensors (baseline)", tensors_base, tensors_base))
    rows.append(
        (
            "to tensors",
            "safetensors: payload_tensors",
            timed(lambda: payload_tensors(new), args.repeat),
            tensors_base,
        )
    )
    rows.append(
        (
            "to tensors",
            "safetensors: plain load + pad_sequence",
            timed(lambda: outside_trainer(new), args.repeat),
            tensors_base,
        )
    )
    decode_base = timed(lambda: decode_batch(old), args.repeat)
    rows.append(("decode", "TSB1 (baseline)", decode_base, decode_base))
    rows.append(("decode", "safetensors", timed(lambda: decode_batch(new), args.repeat), decode_base))

    tokens = batch.tokens
    sizes = f"payload TSB1 {len(old):,} bytes, safetensors {len(new):,} bytes"
    print(f"{machine()}; {args.samples} samples, {tokens} tokens; {sizes}")
    print(f"{'what':<12}{'how':<46}{'median ms':>12}{'x baseline':>12}")
    for what, how, seconds, base in rows:
        print(f"{what:<12}{how:<46}{seconds * 1000:>12.3f}{base / seconds:>12.2f}")
    for what, how, seconds, base in rows:
        if "baseline" not in how and "plain load" not in how:
            figure, baseline = f"{seconds * 1000:.3f} ms", f"TSB1 {base * 1000:.3f} ms"
            summary("batches", f"{what} ({how})", figure, baseline, base / seconds, None)


if __name__ == "__main__":
    main()
