"""The torch backend on the tiny model, in process and behind real NATS consumers."""

from __future__ import annotations

import asyncio
import uuid
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

import nats
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from consumers.inference import InferenceConfig
from pipeline.inference.backends.torch_backend import TorchBackend
from pipeline.inference.client import NatsLLMClient
from pipeline.inference.service import InferenceService
from pipeline.log import EventStore
from pipeline.versions import versions_subject
from schemas import (
    ChatMessage,
    LLMRequest,
    LLMResponse,
    PolicyVersionPublished,
    SamplingParams,
    TokenPrefix,
    parse_wire,
)
from tests.conftest import Servers
from tests.support.reference import recomputed_logprobs, recomputed_top
from tests.support.serving import serving
from tests.support.waiting import wait_until


def ask(content: str, *, policy: str = "p", episode: str | None = None, **sampling: Any) -> LLMRequest:
    return LLMRequest(
        policy=policy,
        episode_id=episode,
        messages=[ChatMessage(role="user", content=content)],
        sampling=SamplingParams(**{"max_tokens": 12, **sampling}),
    )


@pytest.fixture(scope="module")
def backend(tiny_model_dir: Path) -> TorchBackend:
    return TorchBackend(tiny_model_dir, max_batch=8)


async def test_batched_generation_logprobs_equal_a_plain_forward_pass(
    backend: TorchBackend, tiny_model_dir: Path
) -> None:
    requests = [
        ask("hi"),
        ask("What is 17 + 25? Think step by step.", temperature=0.7, top_p=0.9),
        ask("a much longer question " * 8, top_k=20),
        ask("greedy", temperature=0),
    ]
    generations = await asyncio.gather(*(backend.generate(r) for r in requests))  # one left-padded batch
    for request, generation in zip(requests, generations, strict=True):
        assert generation.prompt_token_ids == backend.renderer.prompt(request).token_ids
        assert len(generation.completion_token_ids) == len(generation.completion_logprobs) > 0
        expected = recomputed_logprobs(
            tiny_model_dir, generation.prompt_token_ids, generation.completion_token_ids
        )
        assert max(abs(a - b) for a, b in zip(generation.completion_logprobs, expected, strict=True)) <= 1e-4


async def test_sampling_is_reproducible_and_limits_are_honoured(backend: TorchBackend) -> None:
    greedy = [await backend.generate(ask("same", temperature=0, max_tokens=8)) for _ in range(2)]
    assert greedy[0].completion_token_ids == greedy[1].completion_token_ids
    seeded = await asyncio.gather(*(backend.generate(ask("same", seed=7, max_tokens=8)) for _ in range(2)))
    assert seeded[0].completion_token_ids == seeded[1].completion_token_ids
    short = await backend.generate(ask("count", max_tokens=3, temperature=1.5))
    if short.finish_reason == "length":
        assert len(short.completion_token_ids) == 3
    else:
        assert short.completion_token_ids[-1] in backend.eos_ids
    assert len(short.completion_token_ids) <= 3
    unstopped = await backend.generate(ask("x", seed=3, max_tokens=40, temperature=1.0))
    stop = backend.tokenizer.decode(unstopped.completion_token_ids[5:7])
    stopped = await backend.generate(ask("x", seed=3, max_tokens=40, temperature=1.0, stop=[stop]))
    assert stop in stopped.text
    assert len(stopped.completion_token_ids) <= 7
    assert stopped.finish_reason == "stop"


async def test_a_prompt_longer_than_the_context_is_rejected(backend: TorchBackend) -> None:
    from pipeline.inference.client import RequestRejected

    with pytest.raises(RequestRejected, match="context is 4096"):
        await backend.generate(ask("word " * 5000))


def torch_consumer(
    servers: Servers, policy: str, model_dir: Path, consumer_id: str, database_url: str | None = None
) -> AbstractAsyncContextManager[InferenceService]:
    config = InferenceConfig(
        servers.nats_url,
        policy,
        model=model_dir,
        consumer_id=consumer_id,
        max_batch=8,
        database_url=database_url,
    )
    return serving(config)


async def test_concurrent_episodes_over_two_torch_consumers_continue_token_exactly(
    servers: Servers, tiny_model_dir: Path
) -> None:
    policy = f"p{uuid.uuid4().hex[:8]}"
    client = await NatsLLMClient.connect(servers.nats_url)
    async with (
        torch_consumer(servers, policy, tiny_model_dir, "t1"),
        torch_consumer(servers, policy, tiny_model_dir, "t2"),
    ):
        # both in the queue group before the episodes start: on a loaded machine the second consumer's
        # subscription can reach the server after a burst of first calls, which then all go to the first
        seen: set[str] = set()

        async def both_answer() -> bool:
            reply = await client(ask("warm-up", policy=policy, episode=f"w{uuid.uuid4().hex}", max_tokens=1))
            seen.add(reply.consumer_id)
            return seen == {"t1", "t2"}

        await wait_until(both_answer, 120, "both consumers answering in the queue group", every=0)

        async def episode(index: int) -> list[str]:
            episode_id = f"e{index}"
            first = await client(ask(f"question {index}", policy=policy, episode=episode_id, max_tokens=6))
            prefix = first.prompt_token_ids + first.completion_token_ids
            second = await client(
                LLMRequest(
                    policy=policy,
                    episode_id=episode_id,
                    sampling=SamplingParams(max_tokens=6),
                    messages=[
                        ChatMessage(role="user", content=f"question {index}"),
                        ChatMessage(role="assistant", content=first.text),
                        ChatMessage(role="user", content="and then?"),
                    ],
                    prefix=TokenPrefix(token_ids=prefix, message_count=2),
                )
            )
            # the reply leaves out the prefix it was sent: it continued those tokens exactly
            assert second.prompt_prefix_tokens == len(prefix)
            assert second.prompt_token_ids
            assert not second.prefix_break
            return [first.consumer_id, second.consumer_id]

        served = await asyncio.gather(*(episode(i) for i in range(24)))
    await client.close()
    assert {consumer for pair in served for consumer in pair} == {"t1", "t2"}
    assert all(first == second for first, second in served), "later turns stick to the first consumer"


async def test_each_reply_comes_from_the_weights_of_the_version_it_is_tagged_with_across_a_reload(
    servers: Servers, tiny_model_dir: Path, tmp_path: Path, store: EventStore, database_url: str
) -> None:
    checkpoint = tmp_path / "v1"
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    with torch.no_grad():
        model.lm_head.weight.mul_(3.0)  # far from version 0: a reply tagged with the wrong version shows
    model.save_pretrained(str(checkpoint))
    weights = {0: tiny_model_dir, 1: checkpoint}
    policy = f"p{uuid.uuid4().hex[:8]}"
    client = await NatsLLMClient.connect(servers.nats_url)
    publisher = await nats.connect(servers.nats_url)
    replies: list[LLMResponse] = []
    in_flight: set[int] = set()
    stop = asyncio.Event()

    async def sender(index: int) -> int:
        """Keep one request in flight at every moment until told to stop; the number answered."""
        answered = 0
        while not stop.is_set():
            in_flight.add(index)
            replies.append(await client(ask(f"sender {index} asks {answered}", policy=policy, max_tokens=24)))
            in_flight.discard(index)
            answered += 1
        return answered

    async with torch_consumer(servers, policy, tiny_model_dir, "t1", database_url) as service:
        senders = [asyncio.create_task(sender(i)) for i in range(4)]
        await wait_until(lambda: len(replies) >= 4, 120, "the first replies")
        announced = PolicyVersionPublished(policy=policy, version=1, checkpoint=str(checkpoint))
        await store.append(f"policy-{policy}", [announced])  # as the trainer does: the log first
        await publisher.publish(versions_subject(policy), announced.model_dump_json().encode())
        assert in_flight == {0, 1, 2, 3}  # and so they stay while the consumer loads and swaps the weights
        await wait_until(
            lambda: sum(reply.policy_version == 1 for reply in replies) >= 8, 120, "replies of version 1"
        )
        stop.set()
        answered = await asyncio.gather(*senders)  # none failed or was dropped by the reload
        assert service.backend.policy_version == 1
        assert (service.backend.in_place_loads, service.backend.restarts) == (1, 0)  # copied into the model
    await publisher.close()
    await client.close()

    assert sum(answered) == len(replies)
    assert replies[0].policy_version == 0
    assert {reply.policy_version for reply in replies} == {0, 1}
    for reply in replies:
        assert reply.completion_token_ids
        expected = recomputed_logprobs(
            weights[reply.policy_version], reply.prompt_token_ids, reply.completion_token_ids
        )
        error = max(abs(a - b) for a, b in zip(reply.completion_logprobs, expected, strict=True))
        assert error <= 1e-4, f"a reply tagged version {reply.policy_version} is off by {error}"


async def test_a_checkpoint_of_another_shape_is_loaded_as_a_new_model_and_in_flight_replies_keep_theirs(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    config = AutoConfig.from_pretrained(str(tiny_model_dir))
    config.intermediate_size *= 2  # the weights cannot be copied into the running model
    torch.manual_seed(3)
    AutoModelForCausalLM.from_config(config).save_pretrained(str(tmp_path / "wider"))
    backend = TorchBackend(tiny_model_dir, max_batch=4)
    try:
        running = [
            asyncio.create_task(backend.generate(ask(f"q{i}", max_tokens=256, seed=i))) for i in range(4)
        ]
        # a step counted, not the swap lock held: a quiet machine ran a short batch between two looks
        await wait_until(lambda: backend.steps > 0, 60, "a batch to start")
        await backend.load_version(1, str(tmp_path / "wider"))
        finished = await asyncio.gather(*running)
        after = await backend.generate(ask("hello", max_tokens=12, seed=1))
    finally:
        await backend.close()
    assert (backend.in_place_loads, backend.restarts) == (0, 1)
    weights = {0: tiny_model_dir, 1: tmp_path / "wider"}
    assert [generation.policy_version for generation in finished] == [0, 0, 0, 0]  # the batch that ran
    assert after.policy_version == 1
    for generation in [*finished, after]:
        expected = recomputed_logprobs(
            weights[generation.policy_version], generation.prompt_token_ids, generation.completion_token_ids
        )
        assert max(abs(a - b) for a, b in zip(generation.completion_logprobs, expected, strict=True)) <= 1e-4


async def test_a_request_that_fails_inside_a_batch_fails_alone(backend: TorchBackend) -> None:
    # A seed beyond 64 bits (what an older client or another path could still send: the schema refuses it
    # now) makes torch raise while the batch runs; the other requests of that batch are answered.
    broken = SamplingParams.model_construct(**{**SamplingParams(max_tokens=4).model_dump(), "seed": 2**70})
    bad = ask("bad").model_copy(update={"sampling": broken})
    requests = [ask("one", max_tokens=4), ask("two", max_tokens=4), bad, ask("three", max_tokens=4)]
    results = await asyncio.gather(*(backend.generate(r) for r in requests), return_exceptions=True)
    assert isinstance(results[2], Exception)
    for result in (results[0], results[1], results[3]):
        assert not isinstance(result, BaseException), result
        assert result.completion_token_ids


async def test_prefix_ids_outside_the_vocabulary_are_refused_before_they_reach_a_batch(
    backend: TorchBackend,
) -> None:
    from pipeline.inference.client import RequestRejected

    vocabulary = int(backend.model.config.vocab_size)
    request = LLMRequest(
        policy="p",
        messages=[ChatMessage(role="user", content="a"), ChatMessage(role="assistant", content="b"),
                  ChatMessage(role="user", content="c")],
        prefix=TokenPrefix(token_ids=[1, vocabulary + 5], message_count=2),
    )  # fmt: skip
    with pytest.raises(RequestRejected, match=f"token id {vocabulary + 5} is outside the model's vocabulary"):
        await backend.generate(request)
    assert (await backend.generate(ask("still serving", max_tokens=2))).completion_token_ids


async def test_top_logprobs_are_the_most_likely_tokens_and_token_bytes_spell_the_text(
    backend: TorchBackend, tiny_model_dir: Path
) -> None:
    class Published:
        async def __call__(self, subject: str, body: bytes, headers: dict[str, str] | None = None) -> None:
            pass

    service = InferenceService(backend, policy="p", consumer_id="c", publish=Published())
    detailed = ask("Tell me about the weather in Zürich.", temperature=1.0, seed=5, max_tokens=16)
    detailed = detailed.model_copy(update={"top_logprobs": 3})
    plain = ask("hi", seed=5)
    replies = await asyncio.gather(
        *(service.handle(r.model_dump_json().encode(), None) for r in (detailed, plain))  # one batch
    )
    reply, other = (parse_wire(body) for body in replies)
    assert isinstance(reply, LLMResponse)
    assert isinstance(other, LLMResponse)
    assert (other.token_logprobs, other.top_logprobs) == (None, None)  # only when asked
    assert reply.token_logprobs is not None
    assert reply.top_logprobs is not None
    assert [t.token_id for t in reply.token_logprobs] == reply.completion_token_ids
    assert [t.logprob for t in reply.token_logprobs] == reply.completion_logprobs
    expected = recomputed_top(tiny_model_dir, reply.prompt_token_ids, reply.completion_token_ids, 3)
    assert [[t.token_id for t in position] for position in reply.top_logprobs] == expected
    for position, chosen in zip(reply.top_logprobs, reply.token_logprobs, strict=True):
        assert [t.logprob for t in position] == sorted((t.logprob for t in position), reverse=True)
        assert position[0].logprob >= chosen.logprob
    ids = [t.token_id for t in reply.token_logprobs if t.token_id not in backend.eos_ids]
    spelled = b"".join(bytes(t.bytes) for t in reply.token_logprobs if t.token_id not in backend.eos_ids)
    # the bytes are exact, even where a token holds part of a character (a random model writes such bytes)
    assert spelled.decode("utf-8", errors="replace") == backend.tokenizer.decode(ids)
    assert all(t.text == bytes(t.bytes).decode("utf-8", errors="replace") for t in reply.token_logprobs)
