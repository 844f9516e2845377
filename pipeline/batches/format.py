"""Training batches on the wire: a deterministic binary encoding.

``encode_batch`` gives the same bytes for the same batch, always: a rebuild with the same configuration
produces byte-identical payloads. Layout: ``TSB1``, a uint32 header length, the header (canonical JSON:
batch fields and per-sample metadata with each sample's token count), then the arrays of every sample in
order: input ids (int32), loss mask (uint8), logprobs (float32), little-endian.
"""

from __future__ import annotations

import json
import struct
import sys
from array import array
from dataclasses import dataclass
from typing import Any, Final

MAGIC: Final = b"TSB1"
BATCHES_CHANNEL: Final = "turnstile_batches"
"""NOTIFYed by the materializer when it commits a batch to the outbox; the relay LISTENs."""
_SAMPLE_ARRAYS: Final = struct.Struct("<I")


@dataclass(frozen=True, slots=True)
class BatchSample:
    sample_id: str
    episode_id: str
    group_id: str
    turn_ids: tuple[str, ...]
    policy_version: int
    reward: float
    advantage: float
    stale: bool
    input_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]
    logprobs: tuple[float, ...]

    def header(self) -> dict[str, Any]:
        return {
            "sample_id": self.sample_id,
            "episode_id": self.episode_id,
            "group_id": self.group_id,
            "turn_ids": list(self.turn_ids),
            "policy_version": self.policy_version,
            "reward": self.reward,
            "advantage": self.advantage,
            "stale": self.stale,
            "tokens": len(self.input_ids),
        }


@dataclass(frozen=True, slots=True)
class TrainingBatch:
    batch_id: str
    policy: str
    config_hash: str
    newest_version: int
    samples: tuple[BatchSample, ...]

    @property
    def tokens(self) -> int:
        return sum(len(sample.input_ids) for sample in self.samples)


def pack_arrays(input_ids: tuple[int, ...], loss_mask: tuple[int, ...], logprobs: tuple[float, ...]) -> bytes:
    """One sample's arrays: input ids (int32), loss mask (uint8), logprobs (float32), after its length."""
    if not len(input_ids) == len(loss_mask) == len(logprobs):
        lengths = f"{len(input_ids)} ids, {len(loss_mask)} mask, {len(logprobs)} logprobs"
        raise ValueError(f"sample arrays differ in length: {lengths}")
    ids, mask, lps = array("i", input_ids), array("B", loss_mask), array("f", logprobs)
    return _SAMPLE_ARRAYS.pack(len(ids)) + _little(ids) + mask.tobytes() + _little(lps)


def unpack_arrays(data: bytes | memoryview, offset: int = 0) -> tuple[list[int], list[int], list[float], int]:
    """The arrays packed at ``offset``, and the offset after them."""
    (count,) = _SAMPLE_ARRAYS.unpack_from(data, offset)
    offset += _SAMPLE_ARRAYS.size
    ids = _from_little("i", data[offset : offset + 4 * count])
    offset += 4 * count
    mask = list(data[offset : offset + count])
    offset += count
    lps = _from_little("f", data[offset : offset + 4 * count])
    return ids.tolist(), mask, lps.tolist(), offset + 4 * count


def encode_batch(batch: TrainingBatch) -> bytes:
    return encode_packed(
        batch.batch_id,
        batch.policy,
        batch.config_hash,
        batch.newest_version,
        [sample.header() for sample in batch.samples],
        [pack_arrays(s.input_ids, s.loss_mask, s.logprobs) for s in batch.samples],
    )


def encode_packed(
    batch_id: str,
    policy: str,
    config_hash: str,
    newest_version: int,
    headers: list[dict[str, Any]],
    arrays: list[bytes],
) -> bytes:
    """``encode_batch`` for samples whose arrays are already packed (``pack_arrays``): the same bytes."""
    header = {
        "batch_id": batch_id,
        "policy": policy,
        "config_hash": config_hash,
        "newest_version": newest_version,
        "samples": headers,
    }
    head = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    return b"".join([MAGIC, struct.pack("<I", len(head)), head, *arrays])


def decode_batch(data: bytes) -> TrainingBatch:
    if data[:4] != MAGIC:
        raise ValueError(f"not a Turnstile training batch (starts with {data[:4]!r}, expected {MAGIC!r})")
    (length,) = struct.unpack_from("<I", data, 4)
    header = json.loads(data[8 : 8 + length])
    offset = 8 + length
    view = memoryview(data)
    samples = []
    for meta in header["samples"]:
        ids, mask, lps, offset = unpack_arrays(view, offset)
        samples.append(
            BatchSample(
                sample_id=meta["sample_id"],
                episode_id=meta["episode_id"],
                group_id=meta["group_id"],
                turn_ids=tuple(meta["turn_ids"]),
                policy_version=meta["policy_version"],
                reward=meta["reward"],
                advantage=meta["advantage"],
                stale=meta["stale"],
                input_ids=tuple(ids),
                loss_mask=tuple(mask),
                logprobs=tuple(lps),
            )
        )
    if offset != len(data):
        raise ValueError(f"training batch has {len(data) - offset} trailing bytes")
    return TrainingBatch(
        batch_id=header["batch_id"],
        policy=header["policy"],
        config_hash=header["config_hash"],
        newest_version=header["newest_version"],
        samples=tuple(samples),
    )


def _little(values: array[Any]) -> bytes:
    if sys.byteorder == "big":  # pragma: no cover
        values = array(values.typecode, values)
        values.byteswap()
    return values.tobytes()


def _from_little(typecode: str, data: bytes | memoryview) -> array[Any]:
    values = array(typecode)
    values.frombytes(data)
    if sys.byteorder == "big":  # pragma: no cover
        values.byteswap()
    return values
