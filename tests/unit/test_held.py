"""The turns a consumer holds: kept as chains that share what came before, counted once each, evicted
least recently used within the token budget; a continuation stays token-exact however long it runs, and a
request whose held turn was evicted is answered from what it sends again."""

from __future__ import annotations

import random
import sys
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from pipeline.episodes import EpisodeSession
from pipeline.inference import InferenceService, raise_for_error
from pipeline.inference.backends.scripted import ScriptedBackend
from pipeline.inference.chain import Chain, as_list
from pipeline.inference.held import (
    TOKEN_ID_BYTES,
    TURN_BYTES,
    HeldPrefixes,
    ids_bytes,
    messages_bytes,
    tools_bytes,
)
from pipeline.log import InMemoryStore
from pipeline.log.turns import expand_turns
from schemas import LLMError, LLMRequest, LLMResponse, ToolSpec, TurnCompleted, parse_wire

chunks = st.lists(st.lists(st.integers(0, 50), max_size=6), min_size=1, max_size=8)


def chain_of(parts: list[list[int]]) -> Chain[int]:
    chain = Chain.of(parts[0])
    for part in parts[1:]:
        chain = chain.then(part)
    return chain


@given(chunks, st.data())
def test_a_chain_reads_as_the_list_of_its_chunks(parts: list[list[int]], data: st.DataObject) -> None:
    chain, whole = chain_of(parts), [i for part in parts for i in part]
    assert len(chain) == len(whole)
    assert list(chain) == chain.tolist() == as_list(chain) == whole
    assert [chain[i] for i in range(-len(whole), len(whole))] == whole + whole
    start, stop = data.draw(st.integers(-12, 12)), data.draw(st.integers(-12, 12))
    step = data.draw(st.sampled_from([None, 1, 2, -1]))
    assert chain[start:stop:step] == whole[start:stop:step]
    assert chain == whole
    assert whole == chain  # list == Chain: the list gives way to the chain's comparison
    assert chain == tuple(whole)
    assert chain != [*whole, 0]
    assert chain != whole[:-1] or not whole


def test_a_chain_is_out_of_range_like_a_list() -> None:
    chain = Chain.of([1, 2]).then([3])
    for index in (3, -4):
        try:
            chain[index]
        except IndexError:
            continue
        raise AssertionError(f"index {index} did not raise")
    assert Chain.of([1]).then([]) is not None
    assert Chain.of(chain) is chain


NO_TOOLS: list[ToolSpec] = []  # one list: counted once, as a conversation's continuations share theirs


def fits(tokens: int, turns: int) -> int:
    """A budget in bytes that holds ``turns`` turns of ``tokens`` ids in all, without messages."""
    return tokens * TOKEN_ID_BYTES + turns * TURN_BYTES + sys.getsizeof(NO_TOOLS)


def held_ids(held: HeldPrefixes) -> int:
    """The ids the held turns reach, each link counted once: what ``held.tokens`` must say."""
    links: dict[int, int] = {}
    for turn in held._turns.values():
        link: Chain[int] | None = turn.token_ids
        while link is not None:
            links[id(link)] = len(link.items)
            link = link.parent
    return sum(links.values())


def held_bytes(held: HeldPrefixes) -> int:
    """What ``held.bytes`` must say, counted again from scratch: each link and tools list the held turns
    reach, once, at its size."""
    sizes: dict[int, int] = {}
    tools: dict[int, int] = {}
    for turn in held._turns.values():
        for chain, size_of in ((turn.token_ids, ids_bytes), (turn.messages, messages_bytes)):
            link: Chain[Any] | None = chain
            while link is not None:
                sizes[id(link)] = size_of(link.items)
                link = link.parent
        tools[id(turn.tools)] = tools_bytes(turn.tools)
    return len(held) * TURN_BYTES + sum(sizes.values()) + sum(tools.values())


def test_a_conversation_held_turn_by_turn_costs_its_ids_once() -> None:
    held = HeldPrefixes()
    key = held.keep([1] * 50, [], NO_TOOLS)
    for turn in range(1, 100):
        assert key is not None
        parent = held.take(key, 50 + 10 * (turn - 1), 0)
        assert parent is not None
        key = held.keep(parent.token_ids.then([turn] * 10), parent.messages.then([]), NO_TOOLS)
    assert len(held) == 100
    assert held.tokens == held_ids(held) == 50 + 99 * 10  # each turn keeps what it adds (was 100 copies)


def test_evicting_a_turn_frees_only_the_ids_no_held_turn_needs() -> None:
    held = HeldPrefixes(budget_bytes=fits(tokens=100, turns=3))
    root = held.keep([0] * 40, [], NO_TOOLS)
    assert root is not None
    base = held.take(root, 40, 0)
    assert base is not None
    branch_a = held.keep(base.token_ids.then([1] * 20), [], NO_TOOLS)
    branch_b = held.keep(base.token_ids.then([2] * 20), [], NO_TOOLS)
    assert held.tokens == 80  # the root's 40 once, not once per branch
    held.take(root, 40, 0)  # the root was used last: the oldest is branch a now
    held.keep([3] * 30, [], NO_TOOLS)  # 110 ids > 100: branch a goes, and only its own 20 ids with it
    assert held.tokens == held_ids(held) == 90
    assert held.bytes == held_bytes(held) == fits(tokens=90, turns=3)
    assert branch_a is not None
    assert held.take(branch_a, 60, 0) is None
    assert branch_b is not None
    assert held.take(branch_b, 60, 0) is not None


def test_the_budget_counts_what_the_held_turns_reach_under_any_history() -> None:
    rng = random.Random(15)
    held = HeldPrefixes(budget_bytes=fits(tokens=500, turns=5))
    keys: list[tuple[str, int]] = []
    for _ in range(3_000):
        live = [(key, n) for key, n in keys if held.take(key, n, 0) is not None]
        if live and rng.random() < 0.8:
            key, length = rng.choice(live)
            parent = held.take(key, length, 0)
            assert parent is not None
            ids = parent.token_ids.then([rng.randrange(9)] * rng.randrange(0, 60))
        else:
            ids = Chain.of([rng.randrange(9)] * rng.randrange(1, 120))
        kept = held.keep(ids, [], NO_TOOLS)
        if kept is not None:
            keys.append((kept, len(ids)))
        assert held.tokens == held_ids(held)
        assert held.bytes == held_bytes(held) <= held.budget_bytes
    assert held.hits
    assert held.misses


class Wire:
    """An LLM client over in-process inference services (the consumer's own request handling)."""

    def __init__(self, service: InferenceService) -> None:
        self.service = service
        self.unknown = 0
        self.requests: list[LLMRequest] = []

    async def __call__(self, request: LLMRequest) -> LLMResponse:
        self.requests.append(request)
        data = request.model_dump_json(exclude_none=True).encode()  # as NatsLLMClient sends it
        reply = parse_wire(await self.service.handle(data, None))
        if isinstance(reply, LLMError):
            self.unknown += reply.code == "prefix_unknown"
            raise_for_error(reply)
        assert isinstance(reply, LLMResponse)
        return reply


def consumer(held_bytes: int = 64 * 2**20) -> InferenceService:
    async def publish(subject: str, body: bytes, headers: dict[str, str]) -> None:
        return None

    return InferenceService(
        ScriptedBackend(), policy="p", consumer_id="c", publish=publish, held_bytes=held_bytes
    )


async def talk(session: EpisodeSession, messages: list[Any], turns: int, tag: str) -> list[Any]:
    """``turns`` more turns of a conversation (``messages`` grows by each reply and a new user message);
    the messages of each request."""
    sent = []
    for k in range(turns):
        sent.append(list(messages))
        reply = await session.chat(messages)
        messages += [reply.message, {"role": "user", "content": f"{tag} observation {k} " + "x" * (k % 7)}]
    return sent


def assert_exact(turns: list[TurnCompleted], sent: list[Any], completion: list[int]) -> None:
    """Each turn's prompt is its parent's prompt + completion, then what the scripted engine makes of the
    request's messages (an id per message): the prompt the engine was given, token for token."""
    whole = expand_turns(turns)
    expected: list[int] = []
    for turn, messages in zip(whole, sent, strict=True):
        expected = [*expected, *[len(m["content"] if isinstance(m, dict) else m.content or "") % 1000
                                  for m in messages]]  # fmt: skip
        assert turn.prompt_token_ids == expected
        assert turn.completion_token_ids == completion
        expected = [*expected, *completion]


async def test_a_long_conversation_stays_token_exact_and_its_turns_are_held_once() -> None:
    store, service = InMemoryStore(), consumer()
    wire = Wire(service)
    session = EpisodeSession(store, wire, policy="p")
    await session.start()
    sent = await talk(session, [{"role": "user", "content": "start"}], 150, "a")
    await session.finish("done")

    turns = [r.event for r in await store.read_stream(session.stream) if isinstance(r.event, TurnCompleted)]
    assert_exact(turns, sent, [11, 12, 2])
    assert all(r.prefix is not None and r.prefix.held for r in wire.requests[1:])  # all continued by key
    assert service.held.hits == 149
    last = expand_turns(turns)[-1]
    # 150 held turns of one conversation hold the last turn's ids once (copies would hold ~75 times that)
    assert service.held.tokens == len(last.prompt_token_ids) + len(last.completion_token_ids)


async def test_a_turn_evicted_meanwhile_is_sent_again_whole_and_continued_exactly() -> None:
    store, service = InMemoryStore(), consumer(held_bytes=50_000)
    wire = Wire(service)
    first = EpisodeSession(store, wire, policy="p")
    second = EpisodeSession(store, wire, policy="p")
    await first.start()
    await second.start()
    conversation: list[Any] = [{"role": "user", "content": "a start"}]
    sent_first = await talk(first, conversation, 12, "a")  # ~31 kB held (the engine adds an id a message)
    sent_second = await talk(
        second, [{"role": "user", "content": "b start"}], 15, "b"
    )  # ~40 kB: the first goes
    assert service.held.tokens == held_ids(service.held)
    assert service.held.bytes == held_bytes(service.held) <= 50_000
    sent_first += await talk(first, conversation, 3, "a")
    await first.finish("done")
    await second.finish("done")

    assert wire.unknown == 1  # the first conversation's held turn was gone; resent whole once
    resent = wire.requests[-3]
    assert resent.prefix is not None
    assert resent.prefix.token_ids is not None
    for session, sent in ((first, sent_first), (second, sent_second)):
        recorded = await store.read_stream(session.stream)
        turns = [r.event for r in recorded if isinstance(r.event, TurnCompleted)]
        assert_exact(turns, sent, [11, 12, 2])


async def test_held_bytes_never_exceed_the_budget_over_many_episodes_with_tools_and_long_messages() -> None:
    store, service = InMemoryStore(), consumer(held_bytes=60_000)
    wire = Wire(service)
    rng = random.Random(36)
    function = {"name": "run", "description": "d" * 300, "parameters": {"type": "object", "properties": {}}}
    tools = [{"type": "function", "function": function}]
    sessions: list[tuple[EpisodeSession, list[Any]]] = []
    for episode in range(200):
        session = EpisodeSession(store, wire, policy="p")
        await session.start()
        sessions.append(
            (session, [{"role": "user", "content": f"task {episode} " + "x" * rng.randrange(2000)}])
        )
        session, messages = rng.choice(sessions[-20:])  # a new episode, or one of the recent ones goes on
        for _ in range(rng.randrange(1, 5)):
            reply = await session.chat(messages, tools=tools if episode % 2 else None)
            messages += [reply.message, {"role": "user", "content": "y" * rng.randrange(3000)}]
            assert service.held.bytes == held_bytes(service.held) <= 60_000
    assert service.held.evicted > 100  # the budget was full most of the run
    assert service.held.hits > 100  # and it still held what conversations went on with
    assert wire.unknown  # some were evicted before they went on: sent again whole
