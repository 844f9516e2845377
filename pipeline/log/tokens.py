"""Packing of a turn's token arrays into one binary value (the ``events.tokens`` column).

Layout, little-endian: magic ``TSK1``, three uint32 counts (prompt ids, completion ids, completion
logprobs), then the prompt ids and completion ids as int32 and the logprobs as float32. Token ids
and logprobs are the engine's own; they are never re-tokenized or rounded further downstream.
"""

from __future__ import annotations

import struct
import sys

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
    prompt, completion, logprobs = unpack_token_tuples(blob)
    return list(prompt), list(completion), list(logprobs)


def unpack_token_tuples(blob: bytes) -> tuple[tuple[int, ...], tuple[int, ...], tuple[float, ...]]:
    """``unpack_tokens`` as tuples, read straight from the bytes (the materializer's hot loop)."""
    if len(blob) < _HEADER.size:
        raise InvalidEvent(f"stored token arrays are not in the {_MAGIC!r} layout ({len(blob)} bytes)")
    magic, n_prompt, n_completion, n_logprobs = _HEADER.unpack_from(blob)
    if magic != _MAGIC or len(blob) != _HEADER.size + 4 * (n_prompt + n_completion + n_logprobs):
        raise InvalidEvent(f"stored token arrays are not in the {_MAGIC!r} layout ({len(blob)} bytes)")
    cut, end = _HEADER.size + 4 * n_prompt, _HEADER.size + 4 * (n_prompt + n_completion)
    if sys.byteorder == "little":  # a memoryview cast reads native order: no format string to compile
        view = memoryview(blob)
        return (
            tuple(view[_HEADER.size : cut].cast("i")),
            tuple(view[cut:end].cast("i")),
            tuple(view[end:].cast("f")),
        )
    return (  # pragma: no cover
        struct.unpack_from(f"<{n_prompt}i", blob, _HEADER.size),
        struct.unpack_from(f"<{n_completion}i", blob, cut),
        struct.unpack_from(f"<{n_logprobs}f", blob, end),
    )
