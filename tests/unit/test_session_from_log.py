"""A session rebuilt from its stream (``EpisodeSession.from_log``: what a gateway replica does for a session
another replica served) continues the recorded turns token-exactly; a session catches up with what another
writer appended (``refresh``); a turn appended while another writer recorded only a delivery goes after it,
and one appended after another writer's turn is refused (no fork)."""

from __future__ import annotations

import pytest

from pipeline.episodes import EpisodeSession
from pipeline.errors import WrongExpectedVersion
from pipeline.log import InMemoryStore
from schemas import TurnCompleted, TurnDelivered
from tests.support.backends import PrefixEcho

QUESTION = [{"role": "user", "content": "What is 2 + 2?"}]


async def started_with_turns(
    store: InMemoryStore, llm: PrefixEcho
) -> tuple[EpisodeSession, list[dict[str, str]]]:
    """A session with two turns of one conversation; the conversation so far."""
    session = EpisodeSession(store, llm, policy="p")
    await session.start()
    messages = list(QUESTION)
    for follow_up in ("And 3 + 3?", "And 4 + 4?"):
        reply = await session.chat(messages)
        messages += [{"role": "assistant", "content": reply.text}, {"role": "user", "content": follow_up}]
    return session, messages


async def test_a_session_rebuilt_from_its_stream_continues_its_turns_token_exactly() -> None:
    store, llm = InMemoryStore(), PrefixEcho()
    first, messages = await started_with_turns(store, llm)
    rebuilt = EpisodeSession.from_log(store, llm, await store.read_stream(first.stream), max_turns=5)
    assert [turn.turn_id for turn in rebuilt.turns] == [turn.turn_id for turn in first.turns]
    assert rebuilt.turns[-1].prompt_token_ids == first.turns[-1].prompt_token_ids
    reply = await rebuilt.chat(messages)
    assert reply.parent_turn_id == first.turns[-1].turn_id
    parent = first.turns[-1]
    prefix = [*parent.prompt_token_ids, *parent.completion_token_ids]
    assert reply.prompt_token_ids[: len(prefix)] == prefix  # the engine was sent the recorded tokens
    assert rebuilt.max_turns == 5


async def test_a_session_catches_up_and_a_stale_append_cannot_fork_it() -> None:
    store, llm = InMemoryStore(), PrefixEcho()
    first, messages = await started_with_turns(store, llm)
    other = EpisodeSession.from_log(store, llm, await store.read_stream(first.stream))
    await other.chat(messages)  # another replica recorded a turn: the first session is stale
    with pytest.raises(WrongExpectedVersion):
        await first.chat(messages)
    first.shared = True
    with pytest.raises(WrongExpectedVersion):  # a turn moved the session on: refused all the same
        await first.chat(messages)
    await first.refresh()
    assert [t.turn_id for t in first.turns] == [t.turn_id for t in other.turns]
    recorded = [r.event for r in await store.read_stream(first.stream) if isinstance(r.event, TurnCompleted)]
    assert len(recorded) == 3  # no sibling was recorded


async def test_a_turn_goes_after_a_delivery_another_writer_recorded() -> None:
    store, llm = InMemoryStore(), PrefixEcho()
    first, messages = await started_with_turns(store, llm)
    first.shared = True
    handed = await first.chat(messages, confirm_delivery=True)  # recorded as not delivered yet
    messages += [{"role": "assistant", "content": handed.text}, {"role": "user", "content": "Thanks."}]
    other = EpisodeSession.from_log(store, llm, await store.read_stream(first.stream))
    other.mark_delivered([handed.turn_id])  # the other replica handed the reply over (a retry went there)
    await other.record_delivered()
    reply = await first.chat(messages)  # its expected version is stale by the delivery only
    events = [r.event for r in await store.read_stream(first.stream)]
    assert isinstance(events[-2], TurnDelivered)
    assert events[-2].turn_ids == [handed.turn_id]
    assert isinstance(events[-1], TurnCompleted)
    assert events[-1].turn_id == reply.turn_id
    assert reply.parent_turn_id == handed.turn_id
