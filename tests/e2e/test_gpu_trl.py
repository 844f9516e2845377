"""AsyncGRPOTrainer itself, on a CUDA device, training on Turnstile samples (marker ``gpu``):

    python -m pytest -q -m gpu --noconftest tests/e2e/test_gpu_trl.py -s

trl 1.16's AsyncGRPOTrainer packs samples into a tree and runs FlashAttention from a Hub kernel
(``kernels-community/flash-attn3``, through the ``kernels`` package). Where that kernel is not in the local
Hugging Face cache (a machine that cannot reach the Hub), the trainer runs with the same attention in plain
torch (``tests/support/attention.py``) and the test prints which it used. It needs no servers: the samples
are Turnstile samples built here, turned into ``RolloutSample``s by the same ``rollout_samples`` that
``StreamRolloutWorker`` uses, and the weight transfer writes checkpoints with ``write_checkpoint``, as
``CheckpointWeightTransfer`` does (the stream and the log are covered on CPU by
``tests/integration/test_trl.py``). Besides torch, transformers, accelerate and numpy it needs the wheels
of trl==1.16.0 and datasets (with pyarrow, pandas, dill, xxhash, multiprocess), and the project's own
dependencies that ``pipeline.training`` imports (pydantic, pydantic-settings, sqlalchemy, psycopg,
nats-py, alembic, stamina).
"""

from __future__ import annotations

import os
import queue
import random
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from pipeline.batches import BatchSample
from pipeline.training import placeholder_prompts, write_checkpoint
from pipeline.training.trl_adapters import rollout_samples
from tests.support.attention import varlen_attention
from tests.support.models import built_model

pytestmark = pytest.mark.gpu
DEVICE = os.environ.get("TURNSTILE_GPU_TEST_DEVICE", "cuda")  # cpu: check the test itself where there is none
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")


@pytest.fixture(scope="module")
def model_dir() -> Iterator[Path]:
    if DEVICE == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device here: run on a GPU machine (or set TURNSTILE_GPU_TEST_DEVICE=cpu)")
    pytest.importorskip("trl.experimental.async_grpo", reason="pip install -e '.[trl]'")
    from pipeline.inference.tinymodel import build_tiny_model

    with built_model(build_tiny_model, "tiny", "turnstile-gpu-trl-") as directory:
        yield directory


def turnstile_samples(groups: int, size: int, seed: int = 0) -> list[BatchSample]:
    """Samples as the materializer makes them: a prompt (mask 0), a completion (mask 1, its logprobs), the
    group's advantages (reward - mean)."""
    rng = random.Random(seed)
    samples = []
    for g in range(groups):
        rewards = [rng.random() for _ in range(size)]
        mean = sum(rewards) / size
        for k, reward in enumerate(rewards):
            prompt = [rng.randrange(3, 999) for _ in range(6)]
            completion = [rng.randrange(3, 999) for _ in range(rng.randint(3, 12))]
            samples.append(
                BatchSample(
                    f"s{g}-{k}", f"e{g}-{k}", f"g{g}", (f"t{g}-{k}",), 0, reward, reward - mean, False,
                    tuple(prompt + completion), (0,) * len(prompt) + (1,) * len(completion),
                    (0.0,) * len(prompt) + tuple(-rng.uniform(3.0, 8.0) for _ in completion),
                )
            )  # fmt: skip
    return samples


class QueueWorker:
    """A rollout worker whose buffer holds the samples given (trl's ``RolloutWorkerProtocol``)."""

    def __init__(self, samples: list[Any]) -> None:
        self.rollout_buffer: queue.Queue[Any] = queue.Queue()
        self.metrics_queue: queue.Queue[Any] = queue.Queue()
        for sample in samples:
            self.rollout_buffer.put(sample)
        self.versions: list[int] = []

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def check_health(self, stale_after_s: float) -> None: ...

    def update_model_version(self, model_version: int) -> None:
        self.versions.append(model_version)


class DirectoryTransfer:
    """Writes each version's weights as a checkpoint, as ``CheckpointWeightTransfer`` does (no log here)."""

    def __init__(self, base: Path, root: Path) -> None:
        self.base, self.root, self.written = base, root, []

    def init_weight_transfer(self) -> None: ...

    def pause(self) -> None: ...

    def resume(self) -> None: ...

    def destroy(self) -> None: ...

    def send_weights(self, iterator: Iterator[tuple[str, torch.Tensor]]) -> None:
        weights = {name: t.detach().to("cpu", copy=True).float().contiguous() for name, t in iterator}
        self.written.append(write_checkpoint(self.root / f"v{len(self.written) + 1:06d}", self.base, weights))


def reward_zero(completions: list[Any], **_: Any) -> list[float]:
    return [0.0] * len(completions)


def attention_kernel(monkeypatch: pytest.MonkeyPatch) -> str:
    """The trainer's FlashAttention kernel when it can be loaded, else the same attention in torch."""
    from trl.experimental.async_grpo import packing

    try:
        packing._flash_attn()
        return "kernels-community/flash-attn3"
    except Exception as error:
        kernel = types.SimpleNamespace(flash_attn_varlen_func=varlen_attention)
        monkeypatch.setattr(packing, "_flash_attn", lambda: kernel)
        return f"torch varlen attention (the kernel: {type(error).__name__})"


def test_async_grpo_trainer_trains_turnstile_samples_on_cuda(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    used = attention_kernel(monkeypatch)
    on_cpu = DEVICE == "cpu"
    if on_cpu:  # the GPU's peak FLOP/s, asked for its MFU metric, has no CPU answer
        from trl.experimental.async_grpo import async_grpo_trainer

        monkeypatch.setattr(async_grpo_trainer, "get_peak_flops_per_device", lambda *_: 1e12)

    samples = rollout_samples(turnstile_samples(groups=6, size=4), version_offset=0, groups={})
    worker = QueueWorker(samples)
    transfer = DirectoryTransfer(model_dir, tmp_path / "checkpoints")
    config = AsyncGRPOConfig(
        output_dir=str(tmp_path / "out"), max_steps=3, per_device_train_batch_size=4, num_generations=4,
        token_budget=0, learning_rate=1e-2, weight_sync_steps=1, max_staleness=3, report_to=[],
        save_strategy="no", logging_steps=1, bf16=not on_cpu, dtype="float32" if on_cpu else "bfloat16",
        use_cpu=on_cpu,
    )  # fmt: skip
    before = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    trainer = AsyncGRPOTrainer(
        model=str(model_dir), reward_funcs=reward_zero, args=config, train_dataset=placeholder_prompts(8),
        processing_class=AutoTokenizer.from_pretrained(model_dir, padding_side="left"),
        rollout_worker=worker, weight_transfer=transfer,
    )  # fmt: skip
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    card = "CPU" if on_cpu else torch.cuda.get_device_name()
    print(f"AsyncGRPOTrainer on {card} with {used}: losses {losses}")

    # the trainer's cold sync at train begin, then one per step, each after its checkpoint was written
    assert worker.versions == [1, 2, 3, 4]
    assert [p.name for p in transfer.written] == ["v000001", "v000002", "v000003", "v000004"]
    after = AutoModelForCausalLM.from_pretrained(transfer.written[-1], dtype=torch.float32).state_dict()
    assert any(not torch.equal(before[name], after[name]) for name in before)
    assert worker.rollout_buffer.qsize() <= len(samples) - 3 * 4  # three steps of four (and a prefetch)
