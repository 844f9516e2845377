"""The vLLM backend on the tiny model (vllm-cpu in CI, in its own virtualenv ``.venv-vllm``).

Run with ``.venv-vllm/bin/python -m pytest -q -m vllm tests/e2e/test_vllm_backend.py``. One engine serves the
whole module; the policy-version tests swap its weights (in place, then by a restart onto a model of another
shape), so they come last.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from pipeline.inference.backends import Generation
from pipeline.inference.backends.torch_backend import TorchBackend
from pipeline.inference.backends.vllm_backend import VllmBackend
from pipeline.inference.chat import ChatRenderer
from pipeline.inference.client import RequestRejected
from schemas import ChatMessage, LLMRequest, SamplingParams, TokenPrefix
from tests.support.reference import recomputed_logprobs
from tests.support.waiting import wait_until

# Reported as skipped, not left out, where vLLM is not installed (it has a virtualenv of its own: .ci/run).
pytest.importorskip("vllm", reason="vLLM is not installed here; its tests run in .venv-vllm (see .ci/run)")
pytestmark = pytest.mark.vllm

ENGINE_ENVIRONMENT = {
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache on CPU (the default takes a share of the RAM)
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # on CPU: the model runs in the engine-core process itself
    "HF_HUB_OFFLINE": "1",
}


def ask(content: str, **sampling: Any) -> LLMRequest:
    return LLMRequest(
        policy="p",
        messages=[ChatMessage(role="user", content=content)],
        sampling=SamplingParams(**{"max_tokens": 12, **sampling}),
    )


def max_difference(a: list[float], b: list[float]) -> float:
    return max((abs(x - y) for x, y in zip(a, b, strict=True)), default=0.0)


@pytest.fixture(scope="module")
def engine_environment() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        for name, value in ENGINE_ENVIRONMENT.items():
            patch.setenv(name, value)
        yield


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory, engine_environment: None) -> Path:
    from pipeline.inference.tinymodel import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("vllm-models") / "tiny")


@pytest.fixture(scope="module")
def renderer(model_dir: Path) -> ChatRenderer:
    return ChatRenderer(AutoTokenizer.from_pretrained(str(model_dir)))


@pytest.fixture(scope="module")
async def backend(model_dir: Path, engine_environment: None) -> AsyncIterator[VllmBackend]:
    backend = VllmBackend(model_dir)
    await backend.start()
    yield backend
    await backend.close()


def check_shape(generation: Generation, request: LLMRequest, backend: VllmBackend) -> None:
    completion = generation.completion_token_ids
    assert len(completion) == len(generation.completion_logprobs) > 0
    assert all(logprob <= 0.0 for logprob in generation.completion_logprobs)
    assert generation.finish_reason in ("stop", "length")
    if generation.finish_reason == "length":
        assert len(completion) == request.sampling.max_tokens
    ends_on_eos = completion[-1] in backend.eos_ids
    assert ends_on_eos == (generation.finish_reason == "stop" and not request.sampling.stop)
    text_ids = completion[:-1] if ends_on_eos else completion
    assert generation.text == backend.tokenizer.decode(text_ids, skip_special_tokens=False)


async def test_concurrent_generations_have_their_prompts_and_one_logprob_per_token(
    backend: VllmBackend, renderer: ChatRenderer
) -> None:
    requests = [
        ask("hi"),
        ask("What is 17 + 25? Think step by step.", temperature=0.7, top_p=0.9),
        ask("a much longer question " * 8, top_k=20, max_tokens=20),
        ask("greedy", temperature=0),
    ]
    generations = await asyncio.gather(*(backend.generate(request) for request in requests))
    for request, generation in zip(requests, generations, strict=True):
        assert generation.prompt_token_ids == renderer.prompt(request).token_ids
        assert generation.policy_version == 0
        assert not generation.prefix_break
        assert generation.started_at <= generation.first_token_at
        check_shape(generation, request, backend)


async def test_logprobs_are_raw_and_equal_a_transformers_forward_pass_and_the_torch_backend(
    backend: VllmBackend, model_dir: Path
) -> None:
    # Temperature, top-p and top-k change what is sampled, never the reported (raw) logprobs.
    requests = [
        ask("Tell me about Paris.", max_tokens=24),
        ask("Tell me about Paris.", temperature=0.5, top_p=0.8, top_k=50, max_tokens=24),
        ask("What is 3*4?", temperature=1.7, max_tokens=24, seed=11),
        ask("What is 3*4?", temperature=0, max_tokens=24),
    ]
    generations = await asyncio.gather(*(backend.generate(request) for request in requests))
    for generation in generations:
        expected = recomputed_logprobs(
            model_dir, generation.prompt_token_ids, generation.completion_token_ids
        )
        assert max_difference(generation.completion_logprobs, expected) <= 1e-4

    # Greedy decoding on both backends: the same tokens with the same raw logprobs.
    torch_backend = TorchBackend(model_dir)
    try:
        greedy = [ask("What is 3*4?", temperature=0, max_tokens=24), ask("hello there", temperature=0)]
        ours = await asyncio.gather(*(backend.generate(request) for request in greedy))
        theirs = await asyncio.gather(*(torch_backend.generate(request) for request in greedy))
    finally:
        await torch_backend.close()
    for vllm_generation, torch_generation in zip(ours, theirs, strict=True):
        assert vllm_generation.prompt_token_ids == torch_generation.prompt_token_ids
        assert vllm_generation.completion_token_ids == torch_generation.completion_token_ids
        assert vllm_generation.text == torch_generation.text
        assert vllm_generation.finish_reason == torch_generation.finish_reason
        assert (
            max_difference(vllm_generation.completion_logprobs, torch_generation.completion_logprobs) <= 1e-4
        )


async def test_greedy_and_seeded_sampling_are_reproducible(backend: VllmBackend) -> None:
    greedy = [await backend.generate(ask("same", temperature=0, max_tokens=8)) for _ in range(2)]
    assert greedy[0].completion_token_ids == greedy[1].completion_token_ids
    seeded = await asyncio.gather(*(backend.generate(ask("same", seed=7, max_tokens=8)) for _ in range(2)))
    assert seeded[0].completion_token_ids == seeded[1].completion_token_ids
    assert seeded[0].completion_logprobs == seeded[1].completion_logprobs


async def test_max_tokens_and_stop_strings_end_a_completion(backend: VllmBackend) -> None:
    short = await backend.generate(ask("count", max_tokens=3, temperature=0))
    assert short.finish_reason == "length"
    assert len(short.completion_token_ids) == len(short.completion_logprobs) == 3

    unstopped = await backend.generate(ask("x", seed=3, max_tokens=40))
    stop = backend.tokenizer.decode(unstopped.completion_token_ids[5:7])
    stopped = await backend.generate(ask("x", seed=3, max_tokens=40, stop=[stop]))
    assert stop in stopped.text
    assert stopped.finish_reason == "stop"
    assert len(stopped.completion_token_ids) <= 7
    assert stopped.completion_token_ids == unstopped.completion_token_ids[: len(stopped.completion_token_ids)]


async def test_a_later_turn_continues_the_earlier_turns_tokens_exactly(
    backend: VllmBackend, renderer: ChatRenderer
) -> None:
    first = await backend.generate(ask("question 1", max_tokens=6, seed=5))
    prefix = first.prompt_token_ids + first.completion_token_ids
    request = LLMRequest(
        policy="p",
        sampling=SamplingParams(max_tokens=6),
        messages=[
            ChatMessage(role="user", content="question 1"),
            ChatMessage(role="assistant", content=first.text),
            ChatMessage(role="user", content="and then?"),
        ],
        prefix=TokenPrefix(token_ids=prefix, message_count=2),
    )
    second = await backend.generate(request)
    assert second.prompt_token_ids[: len(prefix)] == prefix
    assert second.prompt_token_ids == renderer.prompt(request).token_ids
    assert len(second.prompt_token_ids) > len(prefix)
    assert not second.prefix_break
    check_shape(second, request, backend)


async def test_a_prompt_longer_than_the_context_is_rejected(backend: VllmBackend) -> None:
    with pytest.raises(RequestRejected, match="context is 4096") as rejected:
        await backend.generate(ask("word " * 5000))
    assert rejected.value.field == "messages"


def scaled_checkpoint(model_dir: Path, directory: Path) -> Path:
    """A copy of the model with its output layer tripled: same shapes (loaded in place), other logprobs."""
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight.mul_(3.0)
    model.save_pretrained(str(directory))
    return directory


def eos_heavy_checkpoint(model_dir: Path, directory: Path) -> tuple[Path, int]:
    """A copy of the model (weights only) whose every step ends the turn with probability ~8%.

    A large constant in one embedding dimension dominates the final RMS norm, so that dimension of the
    last hidden state is ~sqrt(hidden) for every position; the end-of-turn row of ``lm_head`` reads it.
    """
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    eos = int(model.generation_config.eos_token_id)
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] += 100.0
        model.lm_head.weight[eos].zero_()
        model.lm_head.weight[eos, 0] = 0.4
    model.save_pretrained(str(directory))
    return directory, eos


async def running_mid_generation(
    backend: VllmBackend, requests: list[LLMRequest]
) -> list[asyncio.Task[Generation]]:
    """``requests`` in flight, each with a few tokens generated: a short request admitted after them has
    been answered (vLLM schedules the earlier ones in the same steps or before)."""
    running = [asyncio.create_task(backend.generate(request)) for request in requests]
    await wait_until(lambda: len(backend._in_flight) == len(requests), 60, "the requests to be admitted")
    await backend.generate(ask("short", max_tokens=3, temperature=0))
    assert not any(task.done() for task in running), "the requests finished before the swap: make them longer"
    return running


async def test_requests_in_flight_at_a_swap_restart_on_the_new_version_and_keep_none_of_the_old(
    backend: VllmBackend, model_dir: Path, tmp_path: Path
) -> None:
    backend.in_flight = "restart"
    checkpoint = scaled_checkpoint(model_dir, tmp_path / "v1")
    long = [ask(f"long {i}", max_tokens=64, seed=i) for i in range(4)]
    running = await running_mid_generation(backend, long)
    await backend.load_version(1, str(checkpoint))
    finished = await asyncio.gather(*running)
    assert (backend.in_place_loads, backend.restarts) == (1, 0)  # into the running engine
    for request, generation in zip(long, finished, strict=True):
        # aborted with tokens of version 0, run again from the prompt on version 1, and tagged with it
        assert generation.policy_version == 1
        assert generation.restarted_seconds > 0
        check_shape(generation, request, backend)
        # every token from version 1's weights: none of version 0's partial completion was kept
        expected = recomputed_logprobs(
            checkpoint, generation.prompt_token_ids, generation.completion_token_ids
        )
        assert max_difference(generation.completion_logprobs, expected) <= 1e-4
        old = recomputed_logprobs(model_dir, generation.prompt_token_ids, generation.completion_token_ids)
        assert max_difference(generation.completion_logprobs, old) > 1e-2  # the versions are told apart


async def test_requests_in_flight_at_a_swap_drain_on_the_old_version(
    backend: VllmBackend, model_dir: Path, tmp_path: Path
) -> None:
    backend.in_flight = "drain"
    serving, version = Path(backend.checkpoint), backend.policy_version + 1
    checkpoint, eos = eos_heavy_checkpoint(model_dir, tmp_path / "eos")
    greedy = ask("hello", temperature=0, max_tokens=4)
    before = await backend.generate(greedy)
    long = [ask(f"long {i}", max_tokens=64, seed=i) for i in range(4)]
    running = await running_mid_generation(backend, long)
    loads = backend.in_place_loads
    await backend.load_version(version, str(checkpoint))
    finished = await asyncio.gather(*running)  # admitted before the swap: finished on the old version
    assert [generation.policy_version for generation in finished] == [version - 1] * 4
    for request, generation in zip(long, finished, strict=True):
        assert generation.restarted_seconds == 0
        check_shape(generation, request, backend)
        # ... and produced by the old version's weights, every token of it
        expected = recomputed_logprobs(serving, generation.prompt_token_ids, generation.completion_token_ids)
        assert max_difference(generation.completion_logprobs, expected) <= 1e-4
    assert backend.policy_version == version
    assert (backend.in_place_loads, backend.restarts) == (loads + 1, 0)  # into the running engine

    # The same prompt as before the swap: vLLM's prefix cache must not answer it with version 0's KV blocks.
    after = await backend.generate(greedy)
    assert after.policy_version == version
    assert after.prompt_token_ids == before.prompt_token_ids
    assert after.completion_logprobs != before.completion_logprobs
    expected = recomputed_logprobs(checkpoint, after.prompt_token_ids, after.completion_token_ids)
    assert max_difference(after.completion_logprobs, expected) <= 1e-4

    # Sampled turns now end on the end-of-turn token: it stays in the ids (with its logprob), not the text.
    requests = [ask("hello", seed=seed, max_tokens=100) for seed in range(4)]
    sampled = await asyncio.gather(*(backend.generate(request) for request in requests))
    for request, generation in zip(requests, sampled, strict=True):
        assert generation.policy_version == version
        assert generation.finish_reason == "stop"
        assert generation.completion_token_ids[-1] == eos
        assert "<|im_end|>" not in generation.text
        check_shape(generation, request, backend)
        expected = recomputed_logprobs(
            checkpoint, generation.prompt_token_ids, generation.completion_token_ids
        )
        assert max_difference(generation.completion_logprobs, expected) <= 1e-4


async def test_top_logprobs_are_the_most_likely_tokens_with_their_raw_logprobs(backend: VllmBackend) -> None:
    detailed = ask("Tell me about Paris.", temperature=1.0, seed=2, max_tokens=12).model_copy(
        update={"top_logprobs": 3}
    )
    plain = ask("Tell me about Paris.", temperature=1.0, seed=2, max_tokens=12)
    generation, other = await asyncio.gather(backend.generate(detailed), backend.generate(plain))
    assert other.top_logprobs is None  # only when asked
    assert generation.top_logprobs is not None
    assert len(generation.top_logprobs) == len(generation.completion_token_ids)
    # the weights it serves now: an earlier test in this module may have loaded a new policy version
    model = AutoModelForCausalLM.from_pretrained(backend.checkpoint, dtype=torch.float32).eval()
    with torch.inference_mode():
        ids = generation.prompt_token_ids + generation.completion_token_ids
        logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    for index, (position, chosen) in enumerate(
        zip(generation.top_logprobs, generation.completion_logprobs, strict=True)
    ):
        assert len(position) == 3
        values = [logprob for _, logprob in position]
        assert values == sorted(values, reverse=True)
        assert values[0] >= chosen - 1e-6
        row = logprobs[len(generation.prompt_token_ids) - 1 + index]
        assert max(abs(float(row[token]) - logprob) for token, logprob in position) <= 1e-4  # raw logprobs
        assert values[-1] >= float(torch.topk(row, 3).values[-1]) - 1e-4  # none better was left out


async def test_a_checkpoint_of_another_shape_restarts_the_engine_and_is_served(
    backend: VllmBackend, model_dir: Path, tmp_path: Path
) -> None:
    # Last in the module: it leaves the engine on a model of another shape.
    config = AutoConfig.from_pretrained(str(model_dir))
    config.intermediate_size *= 2  # in place is impossible: the MLP's tensors change shape
    torch.manual_seed(3)
    AutoModelForCausalLM.from_config(config).save_pretrained(str(tmp_path / "wider"))
    # Back to the random weights first: the checkpoint an earlier test loaded was trained to end turns, and
    # its replies could all finish before the swap (random weights over a 150k vocabulary rarely pick eos).
    await backend.load_version(backend.policy_version + 1, str(model_dir))
    loads_before, serving = backend.in_place_loads, Path(backend.checkpoint)
    version = backend.policy_version + 1
    backend.in_flight = "restart"  # across the engine restart too
    long = [ask(f"long {i}", max_tokens=48, seed=i) for i in range(3)]
    in_flight = [asyncio.create_task(backend.generate(request)) for request in long]

    def admitted() -> bool:  # each one running or, on a fast machine, already done
        return len(backend._in_flight) + sum(task.done() for task in in_flight) == len(long)

    await wait_until(admitted, 60, "the requests to be admitted")
    await backend.load_version(version, str(tmp_path / "wider"))
    finished = await asyncio.gather(*in_flight)  # none failed
    assert (backend.in_place_loads, backend.restarts) == (loads_before, 1)
    weights = {version - 1: serving, version: tmp_path / "wider"}
    for generation in finished:
        # the old version ends a turn often: one may have finished before the swap, and says so
        assert (generation.restarted_seconds > 0) == (generation.policy_version == version)
        expected = recomputed_logprobs(
            weights[generation.policy_version], generation.prompt_token_ids, generation.completion_token_ids
        )
        assert max_difference(generation.completion_logprobs, expected) <= 1e-4

    generation = await backend.generate(ask("hello", temperature=0, max_tokens=8))
    assert generation.policy_version == version
    expected = recomputed_logprobs(
        tmp_path / "wider", generation.prompt_token_ids, generation.completion_token_ids
    )
    assert max_difference(generation.completion_logprobs, expected) <= 1e-4
