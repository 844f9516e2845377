"""Training batches on the wire: a safetensors file any trainer can load, byte-deterministic.

``encode_batch`` gives the same bytes for the same batch, always: a rebuild with the same configuration
produces byte-identical payloads. A payload is a safetensors file (https://github.com/huggingface/safetensors:
an 8-byte little-endian header length, a JSON header, the tensors' bytes) holding the samples' token arrays
concatenated in sample order, the offsets that cut them apart (``cu_seqlens``, as in packed "varlen"
training) and per-sample scalars:

    input_ids    int32   [tokens]        loss_mask     uint8   [tokens]     logprobs   float32 [tokens]
    cu_seqlens   int64   [samples + 1]   advantages    float32 [samples]    rewards    float32 [samples]
    policy_versions int64 [samples]

and exactly one metadata entry, ``turnstile``: canonical JSON (sorted keys, no spaces) of the batch fields
and each sample's header (ids, turn ids, policy version, reward and advantage as exact doubles, stale,
tokens) with ``"format": "turnstile.batch", "version": 2``. One entry because the safetensors writer keeps
metadata in a hash map: with several keys their order, and so the bytes, could change between runs.
Tensors are written in the writer's own order (by alignment, then name), which does not depend on the run.

Version 1 payloads (``TSB1``: a uint32 header length, canonical JSON, then each sample's arrays) stay
readable: ``decode_batch`` reads both. ``pack_arrays`` is still how the materializer keeps a sample's
arrays in ``samples.arrays`` (not a wire format).
"""

from __future__ import annotations

import json
import struct
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

MAGIC: Final = b"TSB1"  # version 1 payloads
METADATA_KEY: Final = "turnstile"
FORMAT: Final = "turnstile.batch"
VERSION: Final = 2
TOKEN_TENSORS: Final = ("input_ids", "loss_mask", "logprobs")
SAMPLE_TENSORS: Final = ("advantages", "rewards", "policy_versions")
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


def pack_individual(
    prompt_ids: Sequence[int], completion_ids: Sequence[int], completion_logprobs: Sequence[float]
) -> bytes:
    """``pack_arrays`` of a one-turn sample whose prompt is masked out and whose completion is trained (the
    ``individual`` style): the same bytes, without building the three whole sequences first."""
    if len(completion_ids) != len(completion_logprobs):
        raise ValueError(f"{len(completion_ids)} completion ids for {len(completion_logprobs)} logprobs")
    prompt, completion = len(prompt_ids), len(completion_ids)
    return b"".join(
        (
            _SAMPLE_ARRAYS.pack(prompt + completion),
            _little(array("i", prompt_ids)),
            _little(array("i", completion_ids)),
            bytes(prompt),
            b"\x01" * completion,
            bytes(4 * prompt),
            _little(array("f", completion_logprobs)),
        )
    )


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
    import numpy as np
    from safetensors.numpy import save

    if len(headers) != len(arrays):
        raise ValueError(f"{len(headers)} sample headers for {len(arrays)} packed arrays")
    header = {
        "format": FORMAT,
        "version": VERSION,
        "batch_id": batch_id,
        "policy": policy,
        "config_hash": config_hash,
        "newest_version": newest_version,
        "samples": headers,
    }
    ids, mask, lps = [], [], []
    lengths = [0]
    for packed in arrays:  # each: uint32 n, n int32 ids, n uint8 mask, n float32 logprobs (little-endian)
        (n,) = _SAMPLE_ARRAYS.unpack_from(packed)
        start = _SAMPLE_ARRAYS.size
        if len(packed) != start + 9 * n:
            raise ValueError(f"packed sample arrays of {len(packed)} bytes for {n} tokens")
        ids.append(packed[start : start + 4 * n])
        mask.append(packed[start + 4 * n : start + 5 * n])
        lps.append(packed[start + 5 * n :])
        lengths.append(lengths[-1] + n)
    tensors = {
        "input_ids": np.frombuffer(b"".join(ids), dtype="<i4"),
        "loss_mask": np.frombuffer(b"".join(mask), dtype="u1"),
        "logprobs": np.frombuffer(b"".join(lps), dtype="<f4"),
        "cu_seqlens": np.asarray(lengths, dtype="<i8"),
        "advantages": np.asarray([h["advantage"] for h in headers], dtype="<f4"),
        "rewards": np.asarray([h["reward"] for h in headers], dtype="<f4"),
        "policy_versions": np.asarray([h["policy_version"] for h in headers], dtype="<i8"),
    }
    return save(tensors, metadata={METADATA_KEY: _canonical(header)})


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def read_metadata(data: bytes | memoryview) -> dict[str, Any]:
    """The ``turnstile`` metadata entry of a payload, parsed (the safetensors header holds it as text)."""
    (length,) = struct.unpack_from("<Q", data, 0)
    if length > len(data) - 8:
        raise ValueError(f"safetensors header of {length} bytes in a payload of {len(data)}")
    header = json.loads(bytes(data[8 : 8 + length]))
    text = header.get("__metadata__", {}).get(METADATA_KEY)
    if text is None:
        raise ValueError(
            f"a safetensors file without the {METADATA_KEY!r} metadata entry: not a training batch"
        )
    found: dict[str, Any] = json.loads(text)
    if found.get("format") != FORMAT or found.get("version") != VERSION:
        raise ValueError(f"unknown batch format {found.get('format')!r} version {found.get('version')!r}")
    return found


def is_safetensors(data: bytes | memoryview) -> bool:
    return len(data) > 9 and bytes(data[8:9]) == b"{"


def decode_batch(data: bytes) -> TrainingBatch:
    """A payload of either version as a ``TrainingBatch`` (``ValueError`` when it is neither)."""
    if data[:4] == MAGIC:
        return _decode_v1(data)
    if is_safetensors(data):
        return _decode_v2(data)
    raise ValueError(
        f"not a Turnstile training batch (starts with {bytes(data[:9])!r}: neither safetensors nor {MAGIC!r})"
    )


def _decode_v2(data: bytes) -> TrainingBatch:
    from safetensors import SafetensorError
    from safetensors.numpy import load

    header = read_metadata(data)
    try:
        tensors = load(bytes(data))
    except SafetensorError as error:
        raise ValueError(f"a damaged safetensors payload: {error}") from None
    cut = tensors["cu_seqlens"].tolist()
    rows = header["samples"]
    if len(cut) != len(rows) + 1 or cut[0] != 0 or cut[-1] != len(tensors["input_ids"]):
        raise ValueError(
            f"cu_seqlens {cut[:4]}... does not cut {len(tensors['input_ids'])} tokens in {len(rows)}"
        )
    ids, mask, lps = (tensors[name].tolist() for name in TOKEN_TENSORS)
    samples = []
    for index, meta in enumerate(rows):
        start, end = cut[index], cut[index + 1]
        if meta["tokens"] != end - start:
            raise ValueError(
                f"sample {meta['sample_id']}: {end - start} tokens, its header says {meta['tokens']}"
            )
        samples.append(_sample(meta, ids[start:end], mask[start:end], lps[start:end]))
    return TrainingBatch(
        batch_id=header["batch_id"],
        policy=header["policy"],
        config_hash=header["config_hash"],
        newest_version=header["newest_version"],
        samples=tuple(samples),
    )


def _sample(meta: dict[str, Any], ids: list[int], mask: list[int], lps: list[float]) -> BatchSample:
    return BatchSample(
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


def encode_v1(batch: TrainingBatch) -> bytes:
    """The version 1 (``TSB1``) bytes of a batch: what older materializers wrote (tests, benchmarks)."""
    return encode_packed_v1(
        batch.batch_id,
        batch.policy,
        batch.config_hash,
        batch.newest_version,
        [sample.header() for sample in batch.samples],
        [pack_arrays(s.input_ids, s.loss_mask, s.logprobs) for s in batch.samples],
    )


def encode_packed_v1(
    batch_id: str,
    policy: str,
    config_hash: str,
    newest_version: int,
    headers: list[dict[str, Any]],
    arrays: list[bytes],
) -> bytes:
    """``encode_v1`` from packed arrays: what the materializer wrote before version 2."""
    header = {
        "batch_id": batch_id,
        "policy": policy,
        "config_hash": config_hash,
        "newest_version": newest_version,
        "samples": headers,
    }
    head = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    return b"".join([MAGIC, struct.pack("<I", len(head)), head, *arrays])


def _decode_v1(data: bytes) -> TrainingBatch:
    (length,) = struct.unpack_from("<I", data, 4)
    header = json.loads(data[8 : 8 + length])
    offset = 8 + length
    view = memoryview(data)
    samples = []
    for meta in header["samples"]:
        ids, mask, lps, offset = unpack_arrays(view, offset)
        samples.append(_sample(meta, ids, mask, lps))
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
