"""Continuous batching in the torch backend: requests join and leave a running batch at token boundaries.

Order, not time: a short request beside a long generation is shown to finish within a few of the long
one's steps (the backend's decode step counter), never with a timed assertion; the time ratio is in
``bench/batching.py``. A request decoded inside a mixed batch gets the token ids it gets alone (same seed)
and the logprobs of a plain forward pass over it.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from consumers.inference import InferenceConfig
from pipeline.errors import ConfigError
from pipeline.inference.backends import Generation
from pipeline.inference.backends.steps import Plan, Row
from pipeline.inference.backends.torch_backend import TorchBackend
from pipeline.inference.client import NatsLLMClient
from schemas import ChatMessage, LLMRequest, SamplingParams
from tests.conftest import Servers
from tests.support.reference import recomputed_logprobs
from tests.support.serving import serving
from tests.support.waiting import wait_until

LONG_STORY = "Write a long story."
"""Greedy on the long model, this runs to 4,096 tokens without an end-of-message token (checked below)."""


def ask(content: str, **sampling: Any) -> LLMRequest:
    return LLMRequest(
        policy="p",
        messages=[ChatMessage(role="user", content=content)],
        sampling=SamplingParams(**{"max_tokens": 12, "seed": 1, **sampling}),
    )


def assert_exact(model_dir: Path, generation: Generation) -> None:
    """The engine's logprobs are those of one plain forward pass over prompt + completion."""
    expected = recomputed_logprobs(
        model_dir, list(generation.prompt_token_ids), generation.completion_token_ids
    )
    error = max(abs(a - b) for a, b in zip(generation.completion_logprobs, expected, strict=True))
    assert error <= 1e-4, f"off by {error}"


def three_more_steps(backend: TorchBackend, tasks: list[asyncio.Task[Generation]]) -> Callable[[], bool]:
    """A condition: the batch ran three more decode steps from now (or everything finished)."""
    steps = backend.steps
    return lambda: backend.steps >= steps + 3 or all(task.done() for task in tasks)


@pytest.fixture(params=["tiny", "long"])
def model_dir(request: pytest.FixtureRequest) -> Path:
    """Both attention kinds: full (a cache of every column) and sliding-window (the last window only)."""
    return request.getfixturevalue(f"{request.param}_model_dir")


MIXED = [
    ask("hi", max_tokens=40, temperature=1.0, seed=11),
    ask("a much longer question " * 8, max_tokens=30, top_k=20, seed=12),  # prefilled in chunks below
    ask("What is 17 + 25? Think step by step.", max_tokens=20, temperature=0.7, top_p=0.9, seed=13),
    ask("greedy", max_tokens=25, temperature=0),
]


async def test_requests_that_join_a_running_batch_get_what_they_get_alone(model_dir: Path) -> None:
    # 24 tokens a step: the 70-token prompt cannot be prefilled in one step beside the running rows
    backend = TorchBackend(model_dir, max_batch=4, max_batch_tokens=24)
    try:
        alone = [await backend.generate(request) for request in MIXED]
        assert backend.running == 0
        joined: list[asyncio.Task[Generation]] = []
        for request in MIXED:  # each arrives while the earlier ones decode
            joined.append(asyncio.create_task(backend.generate(request)))
            await wait_until(three_more_steps(backend, joined), 60, "three more steps")
        mixed = await asyncio.gather(*joined)
    finally:
        await backend.close()
    for one, batched in zip(alone, mixed, strict=True):
        assert batched.completion_token_ids == one.completion_token_ids
        assert batched.prompt_token_ids == one.prompt_token_ids
        assert_exact(model_dir, batched)
        pairs = zip(batched.completion_logprobs, one.completion_logprobs, strict=True)
        assert max(abs(a - b) for a, b in pairs) <= 1e-4


@pytest.mark.slow  # ~30 s: 4,096 decode steps and a forward pass over them to check the logprobs
async def test_a_short_request_beside_a_4096_token_generation_finishes_while_that_one_runs(
    long_model_dir: Path,
) -> None:
    """Opencode's title call (4,096 tokens) held its main call in the queue for 225 s: now the short one
    joins at the next token boundary and its reply goes out a few of the long one's steps later."""
    backend = TorchBackend(long_model_dir, max_batch=4)
    try:
        long = asyncio.create_task(backend.generate(ask(LONG_STORY, max_tokens=4096, temperature=0)))
        await wait_until(lambda: backend.steps >= 100, 120, "the long generation to be under way")
        before = backend.steps
        short = await backend.generate(ask("hi", max_tokens=16, temperature=1.0, seed=3))
        during = backend.steps - before
        assert not long.done(), "the long generation is still running"
        # its first token from the prefill, one decode step for each further one, and the step it arrived in
        assert len(short.completion_token_ids) == 16
        assert during <= len(short.completion_token_ids) + 1
        assert_exact(long_model_dir, short)
        generation = await long
    finally:
        await backend.close()
    assert len(generation.completion_token_ids) == 4096
    assert generation.finish_reason == "length"
    assert_exact(long_model_dir, generation)


async def test_through_a_consumer_a_short_call_is_answered_while_a_long_one_generates(
    servers: Servers, long_model_dir: Path
) -> None:
    """The user's path: two calls to one torch consumer over NATS, the second sent while the first
    generates; its reply arrives first, and the first one still completes."""
    policy = f"p{uuid.uuid4().hex[:8]}"
    config = InferenceConfig(servers.nats_url, policy, model=long_model_dir, consumer_id="c")
    client = await NatsLLMClient.connect(servers.nats_url)
    try:
        async with serving(config) as service:
            backend = service.backend
            assert isinstance(backend, TorchBackend)
            story = ask(LONG_STORY, max_tokens=1024, temperature=0).model_copy(update={"policy": policy})
            long = asyncio.create_task(client(story))
            await wait_until(lambda: backend.steps >= 50, 120, "the long call to be generating")
            short = await client(ask("hi", max_tokens=8).model_copy(update={"policy": policy}))
            assert not long.done(), "the short call was answered while the long one generates"
            first = await long
    finally:
        await client.close()
    assert 0 < len(short.completion_token_ids) <= 8
    assert len(first.completion_token_ids) == 1024


async def test_a_cancelled_request_leaves_the_batch_and_the_others_are_untouched(
    tiny_model_dir: Path,
) -> None:
    backend = TorchBackend(tiny_model_dir, max_batch=4)
    requests = [ask(f"question {i}", max_tokens=96, temperature=1.0, seed=20 + i) for i in range(3)]
    try:
        alone = [await backend.generate(request) for request in requests]
        tasks = [asyncio.create_task(backend.generate(request)) for request in requests]
        await wait_until(lambda: backend.running == 3, 60, "all three to run")
        victim = requests[1].request_id
        tasks[1].cancel()  # what the service's task does when its caller goes away or the consumer stops
        await wait_until(
            lambda: victim not in {row.request.request_id for row in backend.stepper.batch.rows},
            60,
            "the cancelled request to leave the batch",
        )
        results = await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        await backend.close()
    assert isinstance(results[1], asyncio.CancelledError)
    for index in (0, 2):
        result = results[index]
        assert isinstance(result, Generation), result
        assert result.completion_token_ids == alone[index].completion_token_ids
        assert_exact(tiny_model_dir, result)
    assert backend.running == 0


async def test_a_long_request_leaving_takes_its_columns_with_it(tiny_model_dir: Path) -> None:
    """A newcomer is padded to the long request's width when it joins; once the long one finishes, the
    batch's cache shrinks to the newcomer's own length instead of carrying the padding to its end."""
    backend = TorchBackend(tiny_model_dir, max_batch=4)
    try:
        # greedy, both run to their budgets (no end-of-message token on these prompts)
        long = asyncio.create_task(backend.generate(ask("old", max_tokens=240, temperature=0)))
        await wait_until(lambda: backend.steps >= 120, 60, "the long request to be half-way")
        later = asyncio.create_task(backend.generate(ask("hi", max_tokens=400, temperature=0)))
        generation = await long
        widest = len(generation.prompt_token_ids) + len(generation.completion_token_ids)
        assert not later.done()
        await wait_until(lambda: 0 < backend.stepper.batch.width < widest - 60, 60, "the padding to go")
        await later
    finally:
        await backend.close()


async def test_no_more_than_max_batch_requests_run_at_once(tiny_model_dir: Path) -> None:
    backend = TorchBackend(tiny_model_dir, max_batch=2)
    seen: list[int] = []

    async def watch() -> None:
        while True:
            seen.append(backend.running)
            await asyncio.sleep(0)

    watcher = asyncio.create_task(watch())
    try:
        requests = [ask(f"q{i}", max_tokens=24, temperature=1.0, seed=i) for i in range(6)]
        generations = await asyncio.gather(*(backend.generate(request) for request in requests))
    finally:
        watcher.cancel()
        await backend.close()
    assert max(seen) == 2
    assert all(generation.completion_token_ids for generation in generations)


async def test_a_weight_swap_waits_for_the_running_requests_and_newcomers_get_the_new_version(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    with torch.no_grad():
        model.lm_head.weight.mul_(3.0)
    model.save_pretrained(str(tmp_path / "v1"))
    backend = TorchBackend(tiny_model_dir, max_batch=4)
    try:
        # greedy, this runs to its budget (no end-of-message token): still running when the swap is ready
        running = asyncio.create_task(backend.generate(ask("old", max_tokens=400, temperature=0)))
        await wait_until(lambda: backend.steps >= 3, 60, "the first request to run")
        swap = asyncio.create_task(backend.load_version(1, str(tmp_path / "v1")))
        await wait_until(lambda: backend._swaps_waiting == 1 or swap.done(), 60, "the swap to wait")
        assert not running.done()  # the weights are read, and the swap waits for this one to finish
        assert not swap.done()
        newcomer = asyncio.create_task(backend.generate(ask("new", max_tokens=8)))  # waits for the swap
        old, new = await asyncio.gather(running, newcomer)
        await swap
    finally:
        await backend.close()
    assert (old.policy_version, new.policy_version) == (0, 1)
    assert old.started_at < new.started_at
    assert_exact(tiny_model_dir, old)  # all of it on the old weights, though the swap came mid-way
    assert_exact(tmp_path / "v1", new)


def test_a_step_too_small_for_the_batch_is_refused(tiny_model_dir: Path) -> None:
    with pytest.raises(ConfigError, match="max_batch_tokens at least max_batch"):
        TorchBackend(tiny_model_dir, max_batch=8, max_batch_tokens=4)


async def test_a_step_that_fails_outside_any_request_fails_its_requests_and_the_backend_serves_on(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fault of the step itself (a bug, not a request's own failure: injected here, once) answers the
    requests it held with the error instead of leaving them waiting forever; the next one is served."""
    backend = TorchBackend(tiny_model_dir, max_batch=4)
    real_step = backend.stepper.step

    def broken_once(plan: Plan, model: Any) -> list[Row]:
        monkeypatch.setattr(backend.stepper, "step", real_step)
        raise RuntimeError("injected")

    monkeypatch.setattr(backend.stepper, "step", broken_once)
    try:
        with pytest.raises(RuntimeError, match="injected"):
            await backend.generate(ask("first", max_tokens=8))
        after = await backend.generate(ask("second", max_tokens=8))
    finally:
        await backend.close()
    assert after.completion_token_ids
    assert backend.running == 0
