"""Wire APIs (OpenAI chat completions, OpenAI responses, Anthropic messages), one dialect module each: a
request parsed into Turnstile's terms, a reply rendered as that API's JSON or stream events, errors in its
shape. ``DIALECTS`` is the registry the gateway makes its chat routes from; ``inprocess`` serves the OpenAI
SDK in process."""

from collections.abc import Sequence
from typing import Final

from pipeline.dialects.anthropic import AnthropicMessages, AnthropicRequestError, count_tokens_estimate
from pipeline.dialects.base import (
    ChatCall,
    ChatHandler,
    ChatResult,
    ChoiceData,
    Dialect,
    ParseMemo,
    RequestError,
    WireReply,
    same_json,
)
from pipeline.dialects.inprocess import InProcessTransport, openai_client
from pipeline.dialects.openai import OpenAIChat, OpenAIRequestError, model_object
from pipeline.dialects.responses import OpenAIResponses, ResponsesCall, ResponsesRequestError

OPENAI: Final = OpenAIChat()
ANTHROPIC: Final = AnthropicMessages()
RESPONSES: Final = OpenAIResponses()
DIALECTS: Final[Sequence[Dialect]] = (OPENAI, ANTHROPIC, RESPONSES)
"""Every wire API the gateway serves; a new one is a module with a ``Dialect`` and an entry here."""


def dialect_for_path(path: str) -> Dialect:
    """The dialect whose routes end like ``path`` (``.../messages``: Anthropic's), for answering a request
    to an unknown route in the shape its client expects; OpenAI's otherwise."""
    last = path.rstrip("/").removesuffix("/count_tokens").rsplit("/", 1)[-1]  # Anthropic's token count
    for dialect in DIALECTS:
        if any(route.rsplit("/", 1)[-1] == last for route in dialect.paths):
            return dialect
    return OPENAI


__all__ = [
    "ANTHROPIC",
    "DIALECTS",
    "OPENAI",
    "RESPONSES",
    "AnthropicMessages",
    "AnthropicRequestError",
    "ChatCall",
    "ChatHandler",
    "ChatResult",
    "ChoiceData",
    "Dialect",
    "InProcessTransport",
    "OpenAIChat",
    "OpenAIRequestError",
    "OpenAIResponses",
    "ParseMemo",
    "RequestError",
    "ResponsesCall",
    "ResponsesRequestError",
    "WireReply",
    "count_tokens_estimate",
    "dialect_for_path",
    "model_object",
    "openai_client",
    "same_json",
]
