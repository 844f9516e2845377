"""Inference backends behind one interface: vLLM (GPU), torch (CPU or GPU), replay (the log), scripted."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from schemas import FinishReason, LLMRequest, ToolCall

InFlight = Literal["restart", "drain"]
"""What a backend does with the requests in flight when a new policy version is loaded. ``restart``: they are
cut short, their partial completions of the old version dropped, and run again from their prompt on the new
version (a reply's tokens all come from the version it names; ``Generation.restarted_seconds`` says how long
the dropped attempts ran). ``drain``: the swap waits for them to finish on the old version, tagged with it."""

IN_FLIGHT_DEFAULT: InFlight = "restart"
"""Measured faster to a first reply of the new version (docs/benchmarks.md#new-weights-in-place)."""


@dataclass(frozen=True, slots=True)
class Generation:
    """What an engine produced for one request: its own token ids and raw logprobs."""

    prompt_token_ids: Sequence[int]
    """The whole prompt: a list, or the request's prefix ``Chain`` extended by the new ids (no copy)."""
    completion_token_ids: list[int]
    completion_logprobs: list[float]
    text: str
    finish_reason: FinishReason
    policy_version: int
    prefix_break: bool = False
    extends_prefix: bool = False
    """The prompt is the request's prefix ids then more, as this backend built it (the service need not
    compare them); False: the service compares before it leaves the prefix out of the reply."""
    render_drift: bool | None = None
    chat_template: str | None = None
    tool_calls: list[ToolCall] | None = None
    """Already parsed (replay); None: the service parses hermes tool calls out of ``text``."""
    reasoning: str | None = None
    """Already split (replay), with ``tool_calls``; otherwise the service splits it off ``text``."""
    top_logprobs: list[list[tuple[int, float]]] | None = None
    """Per completion token, the ``top_logprobs`` most likely (token id, raw logprob), when asked."""
    started_at: float = field(default_factory=time.monotonic)
    """time.monotonic() when the engine started on the request (after any queueing)."""
    first_token_at: float = field(default_factory=time.monotonic)
    restarted_seconds: float = 0.0
    """How long the request ran before a new policy version cut it short and it was started again on that
    version (``in_flight="restart"``); that time also counts as queued. 0: it ran once."""


class Backend(Protocol):
    """An inference engine. ``generate`` may be called for many requests at once."""

    policy_version: int

    async def generate(self, request: LLMRequest) -> Generation:
        """Also optional on a backend: ``token_bytes(token_id) -> bytes``, the raw bytes of one token of its
        vocabulary, for per-token logprob detail (without it a token shows as ``<id>``)."""
        ...

    async def load_version(self, version: int, checkpoint: str) -> None:
        """Switch to new weights; the requests in flight are restarted on them or finish on the old ones
        first (the backend's ``InFlight`` policy)."""

    async def close(self) -> None: ...
