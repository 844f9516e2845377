"""Packing of a turn's token arrays into one binary value (the ``events.tokens`` column).

Layout, little-endian: magic ``TSK1``, three uint32 counts (prompt ids, completion ids, completion
logprobs), then the prompt ids and completion ids as int32 and the logprobs as float32. Token ids
and logprobs are the engine's own; they are never re-tokenized or rounded further downstream.
"""

from __future__ import annotations

import struct
import sys
from array import array

from pipeline.errors import InvalidEvent

_MAGIC = b"TSK1"
_HEADER = struct.Struct("<4sIII")


def _little_endian(values: array[int] | array[float]) -> bytes:
    if sys.byteorder == "big":
        values.byteswap()
    return values.tobytes()


def pack_tokens(prompt_ids: list[int], completion_ids: list[int], completion_logprobs: list[float]) -> bytes:
    header = _HEADER.pack(_MAGIC, len(prompt_ids), len(completion_ids), len(completion_logprobs))
    return b"".join(
        (
            header,
            _little_endian(array("i", prompt_ids)),
            _little_endian(array("i", completion_ids)),
            _little_endian(array("f", completion_logprobs)),
        )
    )


def unpack_tokens(blob: bytes) -> tuple[list[int], list[int], list[float]]:
    magic, n_prompt, n_completion, n_logprobs = _HEADER.unpack_from(blob)
    if magic != _MAGIC or len(blob) != _HEADER.size + 4 * (n_prompt + n_completion + n_logprobs):
        raise InvalidEvent(f"stored token arrays are not in the {_MAGIC!r} layout ({len(blob)} bytes)")
    arrays: list[array[int] | array[float]] = []
    offset = _HEADER.size
    for code, count in (("i", n_prompt), ("i", n_completion), ("f", n_logprobs)):
        values = array(code)
        values.frombytes(blob[offset : offset + 4 * count])
        if sys.byteorder == "big":
            values.byteswap()
        arrays.append(values)
        offset += 4 * count
    prompt, completion, logprobs = arrays
    return list(prompt), list(completion), list(logprobs)  # type: ignore[arg-type]
