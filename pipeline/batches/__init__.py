"""Training batches: the deterministic batch format (safetensors), the outbox relay to JetStream
``BATCHES`` and reading batches back (inline or from the object store)."""

from pipeline.batches.format import (
    BATCHES_CHANNEL,
    BatchSample,
    TrainingBatch,
    decode_batch,
    encode_batch,
    encode_packed,
    is_safetensors,
    read_metadata,
)
from pipeline.batches.relay import (
    BATCH_PAYLOADS_BUCKET,
    BATCHES_STREAM,
    BatchNotPublished,
    BatchPayloadError,
    OutboxRelay,
    batch_subject,
    ensure_batches_stream,
    ensure_payload_store,
    fetch_batch_payload,
    fetch_training_batch,
    read_batch_message,
)

__all__ = [
    "BATCHES_CHANNEL",
    "BATCHES_STREAM",
    "BATCH_PAYLOADS_BUCKET",
    "BatchNotPublished",
    "BatchPayloadError",
    "BatchSample",
    "OutboxRelay",
    "TrainingBatch",
    "batch_subject",
    "decode_batch",
    "encode_batch",
    "encode_packed",
    "ensure_batches_stream",
    "ensure_payload_store",
    "fetch_batch_payload",
    "fetch_training_batch",
    "is_safetensors",
    "read_batch_message",
    "read_metadata",
]
