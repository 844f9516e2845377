"""Answers from the log: each request of an episode gets that episode's next recorded turn.

``request.episode_id`` names the recorded episode. The reply carries the recorded tokens, logprobs,
text, tool calls and policy version, so an agent re-run on it sees exactly what it saw the first time.
"""

from __future__ import annotations

import asyncio
import time

from pipeline.inference.backends import Generation
from pipeline.inference.client import RequestRejected
from pipeline.log import Store, expand_turns
from schemas import LLMRequest, TurnCompleted


class ReplayBackend:
    def __init__(self, store: Store) -> None:
        self.store = store
        self.policy_version = 0
        self._turns: dict[str, list[TurnCompleted]] = {}
        self._cursor: dict[str, int] = {}
        self._loading = asyncio.Lock()

    async def generate(self, request: LLMRequest) -> Generation:
        started = time.monotonic()
        if not request.episode_id:
            raise RequestRejected(
                "episode_id", "the replay backend answers per recorded episode; set episode_id"
            )
        turns = await self._recorded(request.episode_id)
        index = self._cursor.get(request.episode_id, 0)
        if index >= len(turns):
            raise RequestRejected(
                "episode_id",
                f"episode {request.episode_id} has {len(turns)} recorded turns; this is request {index + 1}",
            )
        self._cursor[request.episode_id] = index + 1
        turn = turns[index]
        return Generation(
            prompt_token_ids=turn.prompt_token_ids,
            completion_token_ids=turn.completion_token_ids,
            completion_logprobs=turn.completion_logprobs,
            text=turn.reply.text,
            finish_reason=turn.reply.finish_reason,
            policy_version=turn.policy_version,
            prefix_break=turn.prefix_break,
            render_drift=turn.render_drift,
            chat_template=turn.chat_template,
            tool_calls=list(turn.reply.tool_calls),
            reasoning=turn.reply.reasoning,
            started_at=started,
            first_token_at=time.monotonic(),
        )

    async def _recorded(self, episode_id: str) -> list[TurnCompleted]:
        async with self._loading:
            if episode_id not in self._turns:
                recorded = await self.store.read_stream(f"episode-{episode_id}")
                # whole turns: a recorded turn holds what it adds to its parent
                self._turns[episode_id] = expand_turns(
                    [r.event for r in recorded if isinstance(r.event, TurnCompleted)]
                )
        return self._turns[episode_id]

    def rewind(self, episode_id: str) -> None:
        """Start the episode's recorded turns over (for a second re-run)."""
        self._cursor.pop(episode_id, None)

    def token_bytes(self, token_id: int) -> bytes:
        return f"<{token_id}>".encode()  # the log holds ids, not the vocabulary

    async def load_version(self, version: int, checkpoint: str) -> None:
        """Replays are what was recorded; new policy versions do not change them."""

    async def close(self) -> None:
        pass
