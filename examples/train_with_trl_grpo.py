"""Train with TRL's GRPOTrainer on Turnstile's batches (README: "Learners"): the trainer's completions are the
stream's samples (``rollout_func``), every optimizer step publishes a policy version that inference consumers
load, and batches are acked once trained into a published version. GRPOTrainer recomputes advantages from
the rewards (per group of ``num_generations`` consecutive samples): Turnstile's advantages are not used.

    pip install -e '.[trl]'
    TURNSTILE_NATS_URL=... TURNSTILE_DATABASE_URL=... python examples/train_with_trl_grpo.py \\
        --policy demo --model models/tiny --checkpoints checkpoints/trl-grpo --steps 20
"""

import argparse
import os
from pathlib import Path

from transformers import AutoTokenizer
from trl import GRPOConfig, GRPOTrainer

from pipeline.training import StreamFeed, StreamRollouts, placeholder_prompts, reward_turnstile

parser = argparse.ArgumentParser()
parser.add_argument("--policy", required=True)
parser.add_argument("--model", type=Path, required=True, help="the weights of version 0 (a local directory)")
parser.add_argument("--checkpoints", type=Path, required=True, help="where version directories are written")
parser.add_argument("--durable", default="trl-grpo")  # this trainer's name: what it trained is recorded
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--group-size", type=int, default=4, help="the materializer's group size")
parser.add_argument("--max-staleness", type=int, default=None)
args = parser.parse_args()

nats_url, database_url = os.environ["TURNSTILE_NATS_URL"], os.environ["TURNSTILE_DATABASE_URL"]
with StreamFeed(nats_url, database_url, policy=args.policy, durable=args.durable) as feed:
    rollouts = StreamRollouts(
        feed, model=args.model, checkpoints=args.checkpoints, max_staleness=args.max_staleness
    )
    config = GRPOConfig(
        output_dir=str(args.checkpoints / "trl"),
        max_steps=args.steps,
        per_device_train_batch_size=args.group_size,
        num_generations=args.group_size,
        use_cpu=True,  # drop on a GPU machine
        report_to=[],
        save_strategy="no",  # versions are the checkpoints
    )
    GRPOTrainer(
        model=str(rollouts.start_weights),  # this durable's newest version, or --model
        reward_funcs=reward_turnstile,
        args=config,
        train_dataset=placeholder_prompts(args.steps * args.group_size),
        processing_class=AutoTokenizer.from_pretrained(rollouts.start_weights),
        rollout_func=rollouts,
        callbacks=[rollouts.callback()],
    ).train()
    print(f"published up to version {rollouts.published}; {rollouts.stale} stale batches skipped", flush=True)
