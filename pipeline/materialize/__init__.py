"""The materializer: the log folded into trajectories (pure math), read models, training batches and the
batch outbox, exactly once."""
