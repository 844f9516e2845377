"""The trainer's side: batches from JetStream as tensors exactly once, the PPO-clip update and policy
versions."""
