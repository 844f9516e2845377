"""The fold's packed turns (``pipeline.materialize.packed``) give what ``trajectory`` gives over tuples: the
same parents, the same sample arrays byte for byte, on random episodes (chains, branches, roots, partial
prefixes, equal lengths, empty completions)."""

from __future__ import annotations

import random
import uuid
from array import array

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.batches.format import pack_arrays, pack_individual
from pipeline.errors import InvalidEvent
from pipeline.log.tokens import pack_tokens
from pipeline.materialize import packed
from pipeline.materialize.trajectory import Turn, concat_samples, discounted_rewards, parents


def episode(seed: int) -> tuple[list[Turn], list[packed.PackedTurn]]:
    """Up to 8 turns: each continues an earlier one (whole or a prefix of it), or starts a new root; some
    name the turn they continue in full (``extends``), as the fold records a delta turn."""
    rng = random.Random(seed)
    turns: list[Turn] = []
    for index in range(rng.randint(1, 8)):
        extends = None
        if turns and rng.random() < 0.7:
            parent = rng.choice(turns)
            whole = parent.prompt_token_ids + parent.completion_token_ids
            cut = len(whole) if rng.random() < 0.7 else rng.randint(0, len(whole))
            prompt = whole[:cut] + tuple(rng.randrange(4) for _ in range(rng.randint(0, 3)))
            if cut == len(whole) and rng.random() < 0.5:
                extends = parent.turn_id
        else:
            prompt = tuple(rng.randrange(4) for _ in range(rng.randint(0, 4)))
        completion = tuple(rng.randrange(4) for _ in range(rng.randint(0, 3)))
        turns.append(
            Turn(
                turn_id=uuid.UUID(int=rng.getrandbits(128)),
                episode_id="e",
                index=index,
                prompt_token_ids=prompt,
                completion_token_ids=completion,
                completion_logprobs=tuple(-rng.choice([0.0, 0.5, 1.25]) for _ in completion),
                policy_version=rng.randint(0, 2),
                reward=rng.choice([0.0, 1.0]),
                extends=extends,
            )
        )
    return turns, [as_packed(turn) for turn in turns]


def as_packed(turn: Turn) -> packed.PackedTurn:
    prompt, completion, logprobs = packed.token_bytes(
        pack_tokens(
            list(turn.prompt_token_ids), list(turn.completion_token_ids), list(turn.completion_logprobs)
        )
    )
    return packed.PackedTurn(
        turn_id=str(turn.turn_id), uuid=turn.turn_id, episode_id=turn.episode_id, index=turn.index,
        prompt=prompt, completion=completion, logprobs=logprobs, policy_version=turn.policy_version,
        reward=turn.reward, extends=None if turn.extends is None else str(turn.extends),
    )  # fmt: skip


def as_text(tree: dict[uuid.UUID, uuid.UUID | None]) -> dict[str, str | None]:
    return {str(turn): None if parent is None else str(parent) for turn, parent in tree.items()}


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 2**32))
def test_parents_and_samples_are_those_of_the_tuples(seed: int) -> None:
    turns, packed_turns = episode(seed)
    tree = parents(turns)
    assert packed.parents(packed_turns) == as_text(tree)
    values = discounted_rewards(turns, tree, 0.5)
    for turn, packed_turn in zip(turns, packed_turns, strict=True):
        assert packed.individual_arrays(packed_turn) == pack_individual(
            turn.prompt_token_ids, turn.completion_token_ids, turn.completion_logprobs
        )
    expected = concat_samples(turns, tree, values)
    got = packed.concat_samples(packed_turns, as_text(tree), {str(k): v for k, v in values.items()})
    assert [[str(t) for t in s.turn_ids] for s in expected] == [[t.turn_id for t in s.path] for s in got]
    for want, have in zip(expected, got, strict=True):
        assert have.arrays == pack_arrays(want.input_ids, want.loss_mask, want.logprobs)
        assert (have.policy_version, have.reward, have.tokens, have.model_tokens) == (
            want.policy_version, want.reward, len(want.input_ids), sum(want.loss_mask),
        )  # fmt: skip


def test_token_bytes_refuse_what_unpack_refuses() -> None:
    blob = pack_tokens([1, 2], [3], [-0.5])
    prompt, completion, logprobs = packed.token_bytes(blob)
    assert (array("i", prompt).tolist(), array("i", completion).tolist(), list(packed.floats(logprobs))) == (
        [1, 2], [3], [-0.5],
    )  # fmt: skip
    for torn in (blob[:10], blob[:-1], b"TSK2" + blob[4:]):
        with pytest.raises(InvalidEvent, match="not in the b'TSK1' layout"):
            packed.token_bytes(torn)
