"""Train with TRL's AsyncGRPOTrainer on Turnstile's batches (README: "Learners"): its rollout worker's queue
holds the stream's samples with Turnstile's own advantages, and its weight transfer writes each version as a
checkpoint and publishes it (TRL's vLLM server and NCCL are not used: inference consumers load versions).
trl 1.16's AsyncGRPOTrainer needs a CUDA device and its FlashAttention kernel from the Hub.

    pip install -e '.[trl]'
    TURNSTILE_NATS_URL=... TURNSTILE_DATABASE_URL=... python examples/train_with_trl_async.py \\
        --policy demo --model models/tiny --checkpoints checkpoints/trl-async --steps 20
"""

import argparse
import os
from pathlib import Path

from transformers import AutoTokenizer
from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

from pipeline.training import StreamRolloutWorker, placeholder_prompts, reward_turnstile

parser = argparse.ArgumentParser()
parser.add_argument("--policy", required=True)
parser.add_argument("--model", type=Path, required=True, help="the weights of version 0 (a local directory)")
parser.add_argument("--checkpoints", type=Path, required=True, help="where version directories are written")
parser.add_argument("--durable", default="trl-async")  # this trainer's name: what it trained is recorded
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--samples-per-step", type=int, default=8)
parser.add_argument("--max-staleness", type=int, default=4)
args = parser.parse_args()

nats_url, database_url = os.environ["TURNSTILE_NATS_URL"], os.environ["TURNSTILE_DATABASE_URL"]
worker = StreamRolloutWorker(
    nats_url, database_url, policy=args.policy, durable=args.durable, model=args.model,
    checkpoints=args.checkpoints, max_staleness=args.max_staleness,
)  # fmt: skip
config = AsyncGRPOConfig(
    output_dir=str(args.checkpoints / "trl"),
    max_steps=args.steps,
    per_device_train_batch_size=args.samples_per_step,
    token_budget=0,  # a fixed number of samples a micro-batch (no vLLM server to ask for its context length)
    max_staleness=args.max_staleness,  # the same rule as the worker's
    weight_sync_steps=1,  # a version a step
    report_to=[],
    save_strategy="no",  # versions are the checkpoints
)
try:
    AsyncGRPOTrainer(
        model=str(worker.start_weights),  # this durable's newest version, or --model
        reward_funcs=reward_turnstile,  # not called: the worker's samples carry their advantages
        args=config,
        train_dataset=placeholder_prompts(args.steps * args.samples_per_step),
        processing_class=AutoTokenizer.from_pretrained(worker.start_weights, padding_side="left"),
        rollout_worker=worker,
        weight_transfer=worker.weight_transfer(),
    ).train()
finally:
    worker.stop()
print(f"published up to version {worker.published}; {worker.stale} stale batches skipped", flush=True)
