"""One step of the torch backend's continuous batch, run off the event loop: what the scheduler in
``torch_backend`` decided (``Plan``) done with the model, and the requests that finished in it.

A step is a decode forward pass (one token for every row of the batch), then the prefill of the rows
admitted: whole prompts in one left-padded forward pass, or one chunk of a prompt too long for the step's
token budget (that row keeps a cache of its own until its last chunk), and the scripted rows' scoring. A
prefilled row samples its first token from its prefill's last logits and joins the batch. A row that
finishes (end of message, stop string, budget) leaves the batch in the step it finished.

A failure stays with what it belongs to: a row's own (its seed, its sampling) fails that row; a prefill
pass that fails for several newcomers is retried for each alone; a decode pass that fails fails the rows
of the batch (no row's logits can be trusted) and the batch starts again empty.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from transformers import DynamicCache

from pipeline.inference.backends import Generation
from pipeline.inference.backends.ragged import RaggedBatch
from schemas import FinishReason, LLMRequest, SamplingParams

log = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class Row:
    """One request from admission to reply."""

    request: LLMRequest
    prompt: Sequence[int]
    start: int
    """The first prompt position the prefill feeds (the tail of a sliding-window model's prompt; else 0)."""
    budget: int
    """Tokens it may generate: ``max_tokens``, cut to what the context leaves."""
    prefix_break: bool
    render_drift: bool | None
    future: asyncio.Future[Generation]
    forced: tuple[list[int], FinishReason] | None = None
    """The scripted completion and how it ends (teacher forcing); None: sample."""
    completion: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    error: BaseException | None = None
    version: int = 0
    started_at: float = 0.0
    first_token_at: float = 0.0
    generator: torch.Generator | None = None
    fed: int = 0
    """Prompt tokens prefilled so far (from ``start``)."""
    cache: DynamicCache | None = None
    """Its own cache while its prefill runs in chunks; None once it joined the batch."""

    @property
    def done(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    @property
    def unfed(self) -> int:
        """Prompt tokens its prefill has still to feed."""
        return len(self.prompt) - self.start - self.fed

    def fail(self, error: BaseException) -> None:
        self.error = error


@dataclass(frozen=True, slots=True)
class Plan:
    """What one step does besides decoding the batch."""

    leaving: list[Row]
    """Rows whose caller stopped waiting: out of the batch (and of a chunked prefill) before the step."""
    whole: list[Row]
    """Newcomers prefilled whole, together."""
    chunk: tuple[Row, int] | None
    """A row whose prefill goes on with this many tokens."""
    forced: list[Row]
    """Scripted rows, scored."""


class Stepper:
    """The batch and the model work on it; used from one thread at a time."""

    def __init__(self, device: str, pad_id: int, finished: Callable[[Row], FinishReason | None]) -> None:
        self.device = device
        self.pad_id = pad_id
        self.finished = finished
        self.batch: RaggedBatch[Row] = RaggedBatch()
        self.steps = 0
        """Decode passes run: each running row gains one token per step."""

    @torch.inference_mode()
    def step(self, plan: Plan, model: Any) -> list[Row]:
        """Do ``plan`` and decode once; the rows that finished (or failed) in it."""
        leaving = set(plan.leaving)
        self.batch.keep(lambda row: row not in leaving)
        if len(self.batch):
            self._decode(model)
        for row in plan.forced:
            self._guarded(row, partial(self._teacher_force, row, model))
        if plan.whole:
            self._prefill_isolated(plan.whole, model)
        newcomers = [*plan.forced, *plan.whole]
        if plan.chunk is not None:
            row, length = plan.chunk
            self._guarded(row, partial(self._prefill_chunk, row, length, model))
            newcomers.append(row)
        # those that ended before joining the batch, then those that end in it (the same step or later)
        outside = [row for row in newcomers if row.done and row not in self.batch.rows]
        return outside + self.batch.keep(lambda row: not row.done)

    def _decode(self, model: Any) -> None:
        rows = self.batch.rows
        ids = torch.tensor([[row.completion[-1]] for row in rows], device=self.device)
        positions = torch.tensor(
            [[len(row.prompt) + len(row.completion) - 1] for row in rows], device=self.device
        )
        try:
            output = model(
                input_ids=ids,
                attention_mask=self.batch.grow(),
                position_ids=positions,
                past_key_values=self.batch.cache,
                use_cache=True,
            )
        except Exception as error:
            log.exception("a decode step of %d requests failed", len(rows))
            for row in rows:
                row.fail(error)
            return
        self.steps += 1
        self._choose(rows, output.logits[:, -1, :].float())

    def _prefill_isolated(self, rows: list[Row], model: Any) -> None:
        """Prefill newcomers together; if that pass fails, each again alone, so a bad one fails alone."""
        for row in rows:
            self._guarded(row, partial(self._admit, row))
        rows = [row for row in rows if not row.done]
        if not rows:
            return
        try:
            self._prefill_whole(rows, model)
        except Exception as error:
            if len(rows) == 1:
                log.exception("request %s failed", rows[0].request.request_id)
                rows[0].fail(error)
                return
            log.warning("a prefill of %d requests failed (%s); each again alone", len(rows), error)
            for row in rows:
                self._guarded(row, partial(self._prefill_whole, [row], model))

    def _admit(self, row: Row) -> None:
        row.started_at = time.monotonic()
        row.generator = _generator(row.request.sampling)

    def _prefill_whole(self, rows: list[Row], model: Any) -> None:
        """One left-padded forward pass over the newcomers' prompt tails at their true positions."""
        width = max(row.unfed for row in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        positions = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            fed = row.unfed
            ids[i, width - fed :] = torch.tensor(row.prompt[row.start :])
            mask[i, width - fed :] = 1
            positions[i, width - fed :] = torch.arange(row.start, len(row.prompt))
        mask = mask.to(self.device)
        output = model(
            input_ids=ids.to(self.device),
            attention_mask=mask,
            position_ids=positions.to(self.device),
            past_key_values=DynamicCache(config=model.config),
            use_cache=True,
        )
        for row in rows:
            row.fed = row.unfed + row.fed
        self._choose(rows, output.logits[:, -1, :].float())
        self.batch.join(rows, output.past_key_values, mask)

    def _prefill_chunk(self, row: Row, length: int, model: Any) -> None:
        """The next ``length`` prompt tokens of a row prefilled alone across steps; the last chunk's logits
        give its first token and it joins the batch."""
        if row.fed == 0:
            self._admit(row)
            row.cache = DynamicCache(config=model.config)
        begin = row.start + row.fed
        output = model(
            input_ids=torch.tensor([row.prompt[begin : begin + length]], device=self.device),
            position_ids=torch.arange(begin, begin + length, device=self.device)[None],
            past_key_values=row.cache,
            use_cache=True,
        )
        row.fed += length
        if row.unfed > 0:
            return
        self._choose([row], output.logits[:, -1, :].float())
        cache, row.cache = row.cache, None
        assert cache is not None
        self.batch.join([row], cache, torch.ones((1, row.fed), dtype=torch.long, device=self.device))

    def _teacher_force(self, row: Row, model: Any) -> None:
        """Score the scripted completion with one forward pass over the prompt's tail + the completion."""
        assert row.forced is not None
        row.started_at = time.monotonic()
        completion, finish_reason = row.forced
        ids = [*row.prompt[row.start :], *completion]
        positions = torch.arange(row.start, row.start + len(ids), device=self.device)[None]
        logits = model(input_ids=torch.tensor([ids], device=self.device), position_ids=positions).logits[0]
        scored = torch.log_softmax(logits[len(row.prompt) - row.start - 1 : -1].float(), dim=-1)
        chosen = scored.gather(1, torch.tensor(completion, device=self.device)[:, None])[:, 0]
        row.completion, row.logprobs = list(completion), [float(v) for v in chosen]
        if row.request.top_logprobs is not None:
            row.top = [_top(position, row.request.top_logprobs) for position in scored]
        row.first_token_at = time.monotonic()
        row.finish_reason = finish_reason

    def _choose(self, rows: list[Row], logits: torch.Tensor) -> None:
        """Each row's next token from its logits (one row of ``logits`` each, in order)."""
        raw_logprobs = torch.log_softmax(logits, dim=-1)
        for i, row in enumerate(rows):
            if not row.done:
                try:
                    self._take(row, logits[i], raw_logprobs[i])
                except Exception as error:
                    log.exception("request %s failed", row.request.request_id)
                    row.fail(error)

    def _take(self, row: Row, logits: torch.Tensor, raw_logprobs: torch.Tensor) -> None:
        assert row.generator is not None
        token = _sample(logits, row.request.sampling, row.generator)
        row.completion.append(token)
        row.logprobs.append(float(raw_logprobs[token]))
        if row.request.top_logprobs is not None:
            row.top.append(_top(raw_logprobs, row.request.top_logprobs))
        if len(row.completion) == 1:
            row.first_token_at = time.monotonic()
        row.finish_reason = self.finished(row)

    @staticmethod
    def _guarded(row: Row, work: Callable[[], None]) -> None:
        """``work()`` for ``row``; an exception fails that row (logged) instead of the step."""
        try:
            work()
        except Exception as error:
            log.exception("request %s failed", row.request.request_id)
            row.fail(error)


def _top(logprobs: torch.Tensor, k: int) -> list[tuple[int, float]]:
    """The ``k`` most likely (token id, logprob) at one position (none for k = 0)."""
    if k == 0:
        return []
    best = torch.topk(logprobs, min(k, logprobs.shape[-1]))
    return [(int(t), float(v)) for v, t in zip(best.values, best.indices, strict=True)]


def _generator(sampling: SamplingParams) -> torch.Generator:
    seed = sampling.seed if sampling.seed is not None else random.getrandbits(63)
    return torch.Generator().manual_seed(seed)


def _sample(logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator) -> int:
    if sampling.temperature == 0:
        return int(torch.argmax(logits))
    scores = logits.cpu() / sampling.temperature
    if sampling.top_k is not None and sampling.top_k < scores.numel():
        kth = torch.topk(scores, sampling.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if sampling.top_p < 1.0:
        ordered, order = torch.sort(scores, descending=True)
        cumulative = torch.softmax(ordered, dim=-1).cumsum(dim=-1)
        drop = (
            cumulative - torch.softmax(ordered, dim=-1) >= sampling.top_p
        )  # keep the token that crosses top_p
        scores = scores.scatter(0, order[drop], float("-inf"))
    probabilities = torch.softmax(scores, dim=-1)
    return int(torch.multinomial(probabilities, 1, generator=generator))
