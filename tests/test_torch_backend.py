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
from transformers import AutoModelForCausalLM

from consumers.inference import InferenceConfig
from pipeline.inference.backends.torch_backend import TorchBackend
from pipeline.inference.client import NatsLLMClient, versions_subject
from pipeline.inference.service import InferenceService
from schemas import ChatMessage, LLMRequest, PolicyVersionPublished, SamplingParams, TokenPrefix
from tests.conftest import Servers
from tests.reference import recomputed_logprobs
from tests.serving import serving


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
    servers: Servers, policy: str, model_dir: Path, consumer_id: str
) -> AbstractAsyncContextManager[InferenceService]:
    config = InferenceConfig(servers.nats_url, policy, model=model_dir, consumer_id=consumer_id, max_batch=8)
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
            assert second.prompt_token_ids[: len(prefix)] == prefix
            assert not second.prefix_break
            return [first.consumer_id, second.consumer_id]

        served = await asyncio.gather(*(episode(i) for i in range(24)))
    await client.close()
    assert {consumer for pair in served for consumer in pair} == {"t1", "t2"}
    assert all(first == second for first, second in served), "later turns stick to the first consumer"


async def test_a_published_policy_version_is_loaded_between_requests(
    servers: Servers, tiny_model_dir: Path, tmp_path: Path
) -> None:
    checkpoint = tmp_path / "v1"
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    with torch.no_grad():
        model.lm_head.weight.mul_(3.0)
    model.save_pretrained(str(checkpoint))
    policy = f"p{uuid.uuid4().hex[:8]}"
    client = await NatsLLMClient.connect(servers.nats_url)
    publisher = await nats.connect(servers.nats_url)
    async with torch_consumer(servers, policy, tiny_model_dir, "t1"):
        before = await client(ask("hello", policy=policy, temperature=0, max_tokens=4))
        in_flight = [
            asyncio.create_task(client(ask(f"long {i}", policy=policy, max_tokens=64))) for i in range(4)
        ]
        await asyncio.sleep(0.05)
        published = PolicyVersionPublished(policy=policy, version=1, checkpoint=str(checkpoint))
        await publisher.publish(versions_subject(policy), published.model_dump_json().encode())
        finished = await asyncio.gather(*in_flight)  # none dropped by the reload
        async with asyncio.timeout(60):
            after = await client(ask("hello", policy=policy, temperature=0, max_tokens=4))
            while after.policy_version != 1:
                await asyncio.sleep(0.2)
                after = await client(ask("hello", policy=policy, temperature=0, max_tokens=4))
    await publisher.close()
    await client.close()
    assert before.policy_version == 0
    assert all(r.policy_version in (0, 1) and r.completion_token_ids for r in finished)
    assert after.prompt_token_ids == before.prompt_token_ids
    expected = recomputed_logprobs(checkpoint, after.prompt_token_ids, after.completion_token_ids)
    assert max(abs(a - b) for a, b in zip(after.completion_logprobs, expected, strict=True)) <= 1e-4
    assert after.completion_logprobs != before.completion_logprobs
