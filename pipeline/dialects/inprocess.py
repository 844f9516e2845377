"""The OpenAI SDK served in process: ``openai_client(handler)`` is an ``openai.AsyncOpenAI`` whose requests an
httpx transport answers from a ``ChatHandler`` with the OpenAI dialect's translation, with no network, so an
agent written for the OpenAI SDK runs unchanged (``llm.openai()``)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Final, cast

import httpx

from pipeline.dialects.base import ChatHandler, RequestError
from pipeline.dialects.openai import (
    OpenAIChat,
    OpenAIRequestError,
    error_body,
    model_object,
    parse_chat_request,
)
from pipeline.errors import TurnstileError
from schemas import SamplingParams

if TYPE_CHECKING:  # imported by openai_client, when a client is made
    import openai

BASE_URL: Final = "http://turnstile.invalid/v1"
_OPENAI: Final = OpenAIChat()


class InProcessTransport(httpx.AsyncBaseTransport):
    """Serves ``POST .../chat/completions`` and ``GET .../models`` from a ``ChatHandler``, in process.

    Request errors (and ``OpenAIRequestError`` raised by the handler) answer with their status and the
    OpenAI error body; any other ``TurnstileError`` answers 500 ``server_error``. Other exceptions are bugs
    and propagate (the SDK raises ``APIConnectionError`` from them).
    """

    def __init__(self, handler: ChatHandler, *, model: str, defaults: SamplingParams | None = None) -> None:
        self.handler, self.model, self.defaults = handler, model, defaults

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path.rstrip("/")
        try:
            if path.endswith("/chat/completions") and request.method == "POST":
                return await self._chat_completion(await request.aread())
            if path.endswith("/models") and request.method == "GET":
                return httpx.Response(200, json={"object": "list", "data": [model_object(self.model)]})
            if path.endswith(f"/models/{self.model}") and request.method == "GET":
                return httpx.Response(200, json=model_object(self.model))
            raise OpenAIRequestError(f"Invalid URL ({request.method} {request.url.path})", status=404)
        except RequestError as error:
            return httpx.Response(error.status, json=error_body(error))
        except TurnstileError as error:
            return httpx.Response(500, json=error_body(RequestError(str(error), status=500)))

    async def _chat_completion(self, content: bytes) -> httpx.Response:
        try:
            body = json.loads(content)
        except ValueError as error:
            raise OpenAIRequestError(f"the request body is not valid JSON: {error}") from None
        call = parse_chat_request(body, defaults=self.defaults)
        reply = _OPENAI.render(call, await self.handler(call), model=self.model)
        if reply.events is not None:
            return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=reply.events)
        return httpx.Response(200, json=reply.body)


def openai_client(
    handler: ChatHandler, *, model: str, defaults: SamplingParams | None = None
) -> openai.AsyncOpenAI:
    """An ``AsyncOpenAI`` whose every call is served by ``handler`` in process (no retries, no timeout:
    the handler's own LLM client owns those)."""
    import openai  # here: the SDK is a large import that a process without in-process clients never needs

    http_client = httpx.AsyncClient(
        transport=InProcessTransport(handler, model=model, defaults=defaults), timeout=None
    )
    # openai>=3 annotates http_client as an httpx2 client but accepts an httpx one as well.
    return openai.AsyncOpenAI(
        base_url=BASE_URL, api_key="in-process", max_retries=0, http_client=cast(Any, http_client)
    )
