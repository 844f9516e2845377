"""The inference path: LLM clients over NATS, the inference service a consumer runs, chat rendering
with token-exact continuation and the engine backends' interface. The engines themselves
(``backends.torch_backend``, ``backends.vllm_backend``) and the tiny local model (``tinymodel``) are
imported by name: they need torch."""

from pipeline.inference.backends import IN_FLIGHT_DEFAULT, Backend, Generation, InFlight
from pipeline.inference.chat import ChatRenderer, ChatTokenizer, Prompt, split_tool_calls
from pipeline.inference.client import (
    CONSUMER_HEADER,
    HEARTBEAT_HEADER,
    QUEUE_GROUP,
    InferenceError,
    InferenceTimeout,
    LLMClient,
    NatsLLMClient,
    NoInferenceConsumer,
    PendingCall,
    PrefixUnknown,
    QueueLLMClient,
    RequestRejected,
    raise_for_error,
    request_subject,
)
from pipeline.inference.held import DEFAULT_BUDGET_BYTES
from pipeline.inference.replies import DEFAULT_BYTES as DEFAULT_RETRY_REPLY_BYTES
from pipeline.inference.replies import DEFAULT_REPLIES as DEFAULT_RETRY_REPLIES
from pipeline.inference.replies import RetryReplies
from pipeline.inference.script import Script
from pipeline.inference.service import InferenceService

__all__ = [
    "CONSUMER_HEADER",
    "DEFAULT_BUDGET_BYTES",
    "DEFAULT_RETRY_REPLIES",
    "DEFAULT_RETRY_REPLY_BYTES",
    "HEARTBEAT_HEADER",
    "IN_FLIGHT_DEFAULT",
    "QUEUE_GROUP",
    "Backend",
    "ChatRenderer",
    "ChatTokenizer",
    "Generation",
    "InFlight",
    "InferenceError",
    "InferenceService",
    "InferenceTimeout",
    "LLMClient",
    "NatsLLMClient",
    "NoInferenceConsumer",
    "PendingCall",
    "PrefixUnknown",
    "Prompt",
    "QueueLLMClient",
    "RequestRejected",
    "RetryReplies",
    "Script",
    "raise_for_error",
    "request_subject",
    "split_tool_calls",
]
