"""An episode's turns as the materializer folds them: token arrays kept as the packed bytes of the log
(``events.tokens``: int32 ids, float32 logprobs, little-endian), ids as text.

``trajectory`` states the math over ``Turn`` (tuples of ints, ``uuid.UUID`` ids); the fold of a rebuild
runs it over millions of turns, where turning every array into a tuple of Python ints (and back into bytes
for the samples) and hashing ``UUID`` objects cost most of its time. Here a turn's prompt is its bytes, a
prefix is a byte comparison, and a sample's arrays are byte slices joined: the same results, byte for byte
(``tests/unit/test_packed.py`` checks each function against its ``trajectory`` twin).
"""

from __future__ import annotations

import struct
import sys
import uuid
from array import array
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from pipeline.errors import InvalidEvent
from pipeline.materialize.trajectory import path_to

_MAGIC = b"TSK1"
_HEADER = struct.Struct("<4sIII")
"""``events.tokens``: magic, then the counts of prompt ids, completion ids, logprobs (``pipeline.log``)."""
_SAMPLE_LENGTH = struct.Struct("<I")
"""A sample's packed arrays start with its token count (``pipeline.batches.format.pack_arrays``)."""


@dataclass(slots=True)
class PackedTurn:
    """``trajectory.Turn`` with its arrays as packed bytes and its id as text (``uuid`` keeps the object
    for the read models' uuid columns). Not frozen, only because that makes one cost twice as much to
    build; nothing changes one once built (``dataclasses.replace`` makes a new one)."""

    turn_id: str
    uuid: uuid.UUID
    episode_id: str
    index: int
    prompt: bytes
    completion: bytes
    logprobs: bytes
    policy_version: int
    reward: float = 0.0
    extends: str | None = None

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt) >> 2

    @property
    def completion_tokens(self) -> int:
        return len(self.completion) >> 2

    @property
    def length(self) -> int:
        """Prompt and completion, in tokens."""
        return (len(self.prompt) + len(self.completion)) >> 2

    def rewarded(self, reward: float) -> PackedTurn:
        """This turn with ``reward`` (``dataclasses.replace`` costs three times as much)."""
        return PackedTurn(
            self.turn_id, self.uuid, self.episode_id, self.index, self.prompt, self.completion, self.logprobs,
            self.policy_version, reward, self.extends,
        )  # fmt: skip


def token_bytes(blob: bytes) -> tuple[bytes, bytes, bytes]:
    """The prompt ids, completion ids and logprobs of ``events.tokens``, each as its packed bytes; the errors
    of ``pipeline.log.tokens.unpack_token_tuples`` for a blob that is not in that layout."""
    if len(blob) < _HEADER.size:
        raise InvalidEvent(f"stored token arrays are not in the {_MAGIC!r} layout ({len(blob)} bytes)")
    magic, n_prompt, n_completion, n_logprobs = _HEADER.unpack_from(blob)
    if magic != _MAGIC or len(blob) != _HEADER.size + 4 * (n_prompt + n_completion + n_logprobs):
        raise InvalidEvent(f"stored token arrays are not in the {_MAGIC!r} layout ({len(blob)} bytes)")
    cut, end = _HEADER.size + 4 * n_prompt, _HEADER.size + 4 * (n_prompt + n_completion)
    return blob[_HEADER.size : cut], blob[cut:end], blob[end:]


def floats(packed: bytes) -> Sequence[float]:
    """Packed float32 values as Python floats (C loops such as ``sum`` and ``max`` run over them)."""
    if sys.byteorder == "little":
        return memoryview(packed).cast("f")
    values = array("f", packed)  # pragma: no cover
    values.byteswap()  # pragma: no cover
    return values  # pragma: no cover


def _extends(turn: PackedTurn, parent: PackedTurn) -> bool:
    """``trajectory._extends``: the parent's prompt then completion begin the turn's prompt."""
    prompt = turn.prompt
    return (
        len(prompt) >= len(parent.prompt) + len(parent.completion)
        and prompt.startswith(parent.prompt)
        and prompt.startswith(parent.completion, len(parent.prompt))
    )


def parents(turns: Sequence[PackedTurn]) -> dict[str, str | None]:
    """``trajectory.parents`` of one episode's turns, in index order: the longest earlier turn (then the
    latest) whose tokens begin the prompt; a turn that names the one it extends is compared only with
    earlier turns at least as long."""
    by_id = {turn.turn_id: turn for turn in turns}
    result: dict[str, str | None] = {}
    for i, turn in enumerate(turns):
        named = by_id.get(turn.extends) if turn.extends is not None else None
        floor = named.length if named is not None else 0
        limit = turn.prompt_tokens
        best: PackedTurn | None = None
        for earlier in turns[:i]:
            length = earlier.length
            if (
                floor <= length <= limit
                and earlier is not named
                and earlier.index < turn.index
                and (best is None or (length, earlier.index) >= (best.length, best.index))
                and _extends(turn, earlier)
            ):
                best = earlier
        if named is not None and (best is None or (named.length, named.index) >= (best.length, best.index)):
            best = named
        result[turn.turn_id] = None if best is None else best.turn_id
    return result


def individual_arrays(turn: PackedTurn) -> bytes:
    """``pack_individual`` of the turn: prompt masked out, completion trained."""
    n_prompt = len(turn.prompt) >> 2
    n_completion = len(turn.completion) >> 2
    return b"".join(
        (
            _SAMPLE_LENGTH.pack(n_prompt + n_completion),
            turn.prompt,
            turn.completion,
            bytes(n_prompt),
            b"\x01" * n_completion,
            bytes(4 * n_prompt),
            turn.logprobs,
        )
    )


@dataclass(frozen=True, slots=True)
class PathSample:
    """``trajectory.concat_samples``'s sample of one root-to-leaf path, its arrays packed."""

    path: tuple[PackedTurn, ...]
    policy_version: int
    reward: float
    tokens: int
    model_tokens: int
    arrays: bytes


def concat_samples(
    turns: Sequence[PackedTurn], tree: Mapping[str, str | None], values: Mapping[str, float]
) -> list[PathSample]:
    """``trajectory.concat_samples`` (one sample per root-to-leaf path, in the leaves' order) with each
    sample's arrays packed as ``pack_arrays`` packs them."""
    by_id = {turn.turn_id: turn for turn in turns}
    has_children = {parent for parent in tree.values() if parent is not None}
    samples = []
    for leaf in turns:
        if leaf.turn_id in has_children:
            continue
        path = path_to(leaf, by_id, tree, _extends)
        n = leaf.length
        mask = bytearray(n)
        logprobs = bytearray(4 * n)
        for turn in path:
            start, end = len(turn.prompt) >> 2, turn.length
            mask[start:end] = b"\x01" * (end - start)
            logprobs[4 * start : 4 * end] = turn.logprobs
        versions = [turn.policy_version for turn in path if turn.completion]
        samples.append(
            PathSample(
                path=tuple(path),
                policy_version=min(versions, default=leaf.policy_version),
                reward=values[path[0].turn_id],
                tokens=n,
                model_tokens=mask.count(1),
                arrays=b"".join(
                    (_SAMPLE_LENGTH.pack(n), leaf.prompt, leaf.completion, bytes(mask), bytes(logprobs))
                ),
            )
        )
    return samples


def turn_ids(turns: Iterable[PackedTurn]) -> list[uuid.UUID]:
    """The turns' ids as ``uuid.UUID`` (the read models' ``uuid[]``)."""
    return [turn.uuid for turn in turns]
