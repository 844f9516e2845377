"""``schemas.ids.new_uuid``: ids of ``uuid.uuid4()``'s form, unique, and never shared with a forked child."""

from __future__ import annotations

import os
import pickle
import uuid

from schemas import TurnCompleted, new_uuid


def test_a_new_uuid_is_a_version_4_uuid_like_any_other() -> None:
    made = new_uuid()
    assert isinstance(made, uuid.UUID)
    assert (made.version, made.variant) == (4, uuid.RFC_4122)
    again = uuid.UUID(str(made))
    assert (again, hash(again), again.hex, again.bytes) == (made, hash(made), made.hex, made.bytes)
    assert pickle.loads(pickle.dumps(made)) == made
    assert made.is_safe == uuid.uuid4().is_safe


def test_new_uuids_are_distinct_and_their_random_bits_vary() -> None:
    made = [new_uuid() for _ in range(5_000)]  # many buffers' worth
    assert len(set(made)) == len(made)
    fixed = (0xF000 << 64) | (0xC000 << 48)  # the version and variant bits: the only ones that stay
    varying = 0
    for value in made:
        varying |= value.int ^ made[0].int
    assert varying == ((1 << 128) - 1) & ~fixed


def test_a_forked_child_does_not_hand_out_its_parents_next_ids() -> None:
    new_uuid()  # the buffer holds the next ids now
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child process
        os.close(read)
        os.write(write, b"".join(new_uuid().bytes for _ in range(8)))
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        theirs = pipe.read()
    os.waitpid(child, 0)
    ours = b"".join(new_uuid().bytes for _ in range(8))
    assert len(theirs) == len(ours) == 128
    assert {theirs[i : i + 16] for i in range(0, 128, 16)}.isdisjoint(
        ours[i : i + 16] for i in range(0, 128, 16)
    )


def test_events_get_their_ids_from_it() -> None:
    field = TurnCompleted.model_fields["event_id"]
    assert field.default_factory is new_uuid
