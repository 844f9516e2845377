"""Packing of a turn's token arrays into one binary value (the ``events.tokens`` column).

Layout, little-endian: magic ``TSK1``, three uint32 counts (prompt ids, completion ids, completion
logprobs), then the prompt ids and completion ids as int32 and the logprobs as float32. Token ids
and logprobs are the engine's own; they are never re-tokenized or rounded further downstream.
"""

from __future__ import annotations

import struct

from pipeline.errors import InvalidEvent

_MAGIC = b"TSK1"
_HEADER = struct.Struct("<4sIII")


def pack_tokens(prompt_ids: list[int], completion_ids: list[int], completion_logprobs: list[float]) -> bytes:
    counts = (len(prompt_ids), len(completion_ids), len(completion_logprobs))
    body = struct.pack(
        f"<{counts[0] + counts[1]}i{counts[2]}f", *prompt_ids, *completion_ids, *completion_logprobs
    )
    return _HEADER.pack(_MAGIC, *counts) + body


def unpack_tokens(blob: bytes) -> tuple[list[int], list[int], list[float]]:
    if len(blob) < _HEADER.size:
        raise InvalidEvent(f"stored token arrays are not in the {_MAGIC!r} layout ({len(blob)} bytes)")
    magic, n_prompt, n_completion, n_logprobs = _HEADER.unpack_from(blob)
    if magic != _MAGIC or len(blob) != _HEADER.size + 4 * (n_prompt + n_completion + n_logprobs):
        raise InvalidEvent(f"stored token arrays are not in the {_MAGIC!r} layout ({len(blob)} bytes)")
    ids = struct.unpack_from(f"<{n_prompt + n_completion}i", blob, _HEADER.size)
    logprobs = struct.unpack_from(f"<{n_logprobs}f", blob, _HEADER.size + 4 * (n_prompt + n_completion))
    return list(ids[:n_prompt]), list(ids[n_prompt:]), list(logprobs)
