"""The replies a consumer keeps for retries: a request sent again gets the same reply without a second
generation while its reply is kept, and what is kept stays within both bounds, the count and the bytes
(before, only the count: 4,096 replies of up to max_payload each)."""

from __future__ import annotations

import uuid

from hypothesis import given
from hypothesis import strategies as st

from pipeline.inference import InferenceService, RetryReplies
from pipeline.inference.backends.scripted import ScriptedBackend
from pipeline.inference.replies import ENTRY_BYTES
from schemas import ChatMessage, LLMRequest, LLMResponse


def service_keeping(replies: RetryReplies) -> tuple[InferenceService, ScriptedBackend]:
    async def publish(subject: str, body: bytes, headers: dict[str, str]) -> None:
        return None

    backend = ScriptedBackend()
    service = InferenceService(backend, policy="p", consumer_id="c", publish=publish, retry_replies=replies)
    return service, backend


def request(n: int, words: int = 1) -> bytes:
    content = " ".join(f"word{n}" for _ in range(words))
    message = ChatMessage(role="user", content=content)
    return LLMRequest(policy="p", messages=[message]).model_dump_json().encode()


async def test_a_retry_is_answered_from_memory_while_its_reply_is_among_the_newest_by_count() -> None:
    service, backend = service_keeping(RetryReplies(max_replies=3))
    sent = [request(n) for n in range(5)]
    first = [await service.handle(body, None) for body in sent]
    assert backend.requests_seen == 5
    assert [await service.handle(body, None) for body in sent[2:]] == first[2:]  # the newest three
    assert backend.requests_seen == 5
    again = await service.handle(sent[0], None)  # dropped: generated again, with the same request id
    assert backend.requests_seen == 6
    assert (
        LLMResponse.model_validate_json(again).request_id
        == LLMResponse.model_validate_json(first[0]).request_id
    )
    assert len(service.retry_replies) == 3


async def test_the_replies_kept_stay_within_their_bytes() -> None:
    one = len(await service_keeping(RetryReplies())[0].handle(request(0, words=200), None)) + ENTRY_BYTES
    service, backend = service_keeping(RetryReplies(max_replies=1000, max_bytes=int(2.5 * one)))
    sent = [request(n, words=200) for n in range(6)]
    for body in sent:
        await service.handle(body, None)
        assert service.retry_replies.bytes <= 2.5 * one
    assert len(service.retry_replies) == 2
    assert service.retry_replies.evicted == 4
    for body in sent[-2:]:
        await service.handle(body, None)
    assert backend.requests_seen == 6


async def test_a_reply_larger_than_the_bytes_alone_is_not_kept_and_zero_keeps_none() -> None:
    for replies in (RetryReplies(max_bytes=ENTRY_BYTES), RetryReplies(max_replies=0)):
        service, backend = service_keeping(replies)
        body = request(1)
        await service.handle(body, None)
        await service.handle(body, None)
        assert backend.requests_seen == 2
        assert (len(replies), replies.bytes, replies.evicted) == (0, 0, 2)


@given(
    st.integers(1, 6),
    st.integers(0, 3000),
    st.lists(st.tuples(st.integers(0, 8), st.integers(0, 1200)), max_size=40),
)
def test_the_bounds_hold_after_every_keep_and_the_bytes_add_up(
    max_replies: int, max_bytes: int, keeps: list[tuple[int, int]]
) -> None:
    replies = RetryReplies(max_replies, max_bytes)
    ids = [uuid.UUID(int=n) for n in range(9)]
    for which, size in keeps:
        replies.keep(ids[which], b"d", b"x" * size)
        assert len(replies) <= max_replies
        assert replies.bytes <= max_bytes
        kept = [replies.get(request_id) for request_id in ids]
        assert replies.bytes == sum(len(body) + ENTRY_BYTES for _, body in filter(None, kept))
