"""Training batches: the binary batch format, the outbox relay to JetStream BATCHES and reading batches back."""
