"""Train on Turnstile's batches with plain PyTorch, in a process of your own (README: "Batches any trainer
can load"). A bigram policy stands in for your model; the batch stream is a torch ``IterableDataset``.

    TURNSTILE_NATS_URL=... TURNSTILE_DATABASE_URL=... python examples/train_with_pytorch.py --policy demo
"""

import argparse
import os

import torch
from torch.utils.data import DataLoader

from pipeline.training import BatchStream

parser = argparse.ArgumentParser()
parser.add_argument("--policy", required=True)
parser.add_argument("--durable", default="plain-torch")  # this trainer's name: what it trained is recorded
parser.add_argument("--vocab", type=int, default=1000)
parser.add_argument("--idle", type=float, default=None, help="stop after this many seconds without a batch")
parser.add_argument("--checkpoint", default="plain-torch.pt")
args = parser.parse_args()

nats_url, database_url = os.environ["TURNSTILE_NATS_URL"], os.environ["TURNSTILE_DATABASE_URL"]
model = torch.nn.Embedding(args.vocab, args.vocab)  # logits of the next token given this one
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
with BatchStream(
    nats_url, database_url, policy=args.policy, durable=args.durable, idle_timeout=args.idle
) as stream:
    for step, batch in enumerate(DataLoader(stream, batch_size=None), start=1):
        logprobs = torch.log_softmax(model(batch["input_ids"][:, :-1]), dim=-1)
        taken = logprobs.gather(-1, batch["input_ids"][:, 1:].unsqueeze(-1)).squeeze(-1)
        mask = batch["loss_mask"][:, 1:]
        loss = -(batch["advantages"].unsqueeze(1) * taken * mask).sum() / mask.sum().clamp(min=1)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        torch.save(model.state_dict(), args.checkpoint)  # your checkpoint, durable first ...
        stream.commit(version=step, losses=[loss.item()])  # ... then recorded as trained and acked
        print(f"step {step}: batch {batch['batch_id']} loss {loss.item():.4f}", flush=True)
