"""An instant backend that answers every request with the same fixed reply (routing tests, benchmarks)."""

from __future__ import annotations

import asyncio
import time

from pipeline.inference.backends import Generation
from pipeline.inference.chain import Chain
from schemas import LLMRequest


class ScriptedBackend:
    def __init__(
        self, text: str = "ok", *, completion_ids: tuple[int, ...] = (11, 12, 2), delay: float = 0.0
    ) -> None:
        self.text = text
        self.completion_ids = list(completion_ids)
        self.delay = delay
        self.policy_version = 0
        self.requests_seen = 0

    async def generate(self, request: LLMRequest) -> Generation:
        self.requests_seen += 1
        started = time.monotonic()
        if self.delay:
            await asyncio.sleep(self.delay)
        new = [len(message.content or "") % 1000 for message in request.messages]
        prompt = Chain.of(request.prefix.ids).then(new) if request.prefix else new  # the prefix not copied
        return Generation(
            prompt_token_ids=prompt,
            completion_token_ids=self.completion_ids,
            completion_logprobs=[-0.5] * len(self.completion_ids),
            text=self.text,
            finish_reason="stop",
            policy_version=self.policy_version,
            extends_prefix=request.prefix is not None,
            started_at=started,
            first_token_at=time.monotonic(),
        )

    def token_bytes(self, token_id: int) -> bytes:
        return f"<{token_id}>".encode()  # no vocabulary: a stand-in text

    async def load_version(self, version: int, checkpoint: str) -> None:
        self.policy_version = version

    async def close(self) -> None:
        pass
