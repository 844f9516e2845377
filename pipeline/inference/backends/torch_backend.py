"""A transformers causal LM served with torch (CPU or GPU), requests batched continuously.

Requests join and leave the running batch at token boundaries (continuous batching). Each step of the
scheduler is one decode forward pass over the batch (a token for every running request) and, in the same
step, the prefill of the requests admitted: all of a newcomer's prompt when it fits the step's token budget
(``max_batch_tokens``, decode tokens included), else a chunk of it per step until it is done. A prefilled
request joins the batch's shared KV cache (``ragged.RaggedBatch``: one transformers ``DynamicCache``,
right-aligned rows, left padding masked); a finished one leaves it at once and its reply goes out, while the
others go on. At most ``max_batch`` requests run at once (prefilling included); the rest wait in order.
Every row samples with its own temperature, top-p, top-k, seed, stop strings and token budget
(``max_tokens``, cut to the context). Logprobs are ``log_softmax`` of the raw logits, before temperature or
truncation, as vLLM reports them, and a row's logits in the batch are those of a forward pass over it alone.

A model whose every layer attends within a sliding window (``turnstile model init-long``) is run on the tail
of each prompt only: the logits at a position depend on at most ``layers * (window - 1)`` tokens before it
(``attention_reach``), so the prefill starts there, at the true positions, and gives the numbers of a forward
pass over the whole prompt at a cost that does not grow with the prompt.

With a ``Script`` (``--script FILE``) the backend does not sample: the first matching rule's reply text,
as the tokenizer's ids, is the completion, scored by one forward pass over prompt + completion (teacher
forcing) — what the engine would have returned had it sampled that text. Such a request is scored in the
step that admits it and never joins the batch.

A new policy version goes in when no request is running, so no request mixes two versions: once the new
weights are read from disk, admission pauses, the requests running finish on the old weights (their replies
carry the old version), the weights change, and admission resumes on the new ones (what vLLM does too).
Its weights are copied into the model in place when the checkpoint is the same model with other values
(``weights.in_place_refusal``); otherwise (another shape or configuration) a whole new model is loaded from
the checkpoint, logged and counted in ``restarts``.

A request whose caller stops waiting (its task cancelled: the consumer stops, the requester went away)
leaves the batch at the next step; the others are not touched.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pipeline.errors import ConfigError
from pipeline.inference.backends import Generation
from pipeline.inference.backends.steps import Plan, Row, Stepper
from pipeline.inference.backends.weights import in_place_refusal, read_weights, state_refusal
from pipeline.inference.chat import ChatRenderer, token_bytes
from pipeline.inference.client import RequestRejected
from pipeline.inference.script import Script, describe
from schemas import FinishReason, LLMRequest

log = logging.getLogger(__name__)

DEFAULT_MAX_BATCH = 16
DEFAULT_MAX_BATCH_TOKENS = 2048
"""Tokens one step feeds the model (a token per running request, plus prefill): a newcomer's prompt longer
than what is left is prefilled in chunks over several steps, so no step stalls the batch for long."""


def attention_reach(config: Any) -> int | None:
    """How many tokens before a position its logits can depend on: ``layers * (window - 1)`` when every
    layer attends within a sliding window of ``window`` tokens (itself included); None when one sees all."""
    window, kinds = getattr(config, "sliding_window", None), getattr(config, "layer_types", None)
    if not window or not kinds or any(kind != "sliding_attention" for kind in kinds):
        return None
    return len(kinds) * (int(window) - 1)


def load_model(directory: str | Path, device: str, dtype: torch.dtype) -> Any:
    model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=dtype)
    return model.to(device).eval()  # type: ignore[arg-type]  # transformers' stubs type .to() oddly


class TorchBackend:
    def __init__(
        self,
        model_dir: str | Path,
        *,
        device: str | None = None,
        dtype: torch.dtype = torch.float32,
        max_batch: int = DEFAULT_MAX_BATCH,
        max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS,
        policy_version: int = 0,
        script: Script | None = None,
        in_place: bool = True,
    ) -> None:
        """``max_batch``: requests running at once; ``max_batch_tokens``: tokens fed in one step (at least
        ``max_batch``, so a step always has room for a chunk of a newcomer's prompt). ``in_place=False``:
        every version loaded as a whole new model (the fallback; a baseline)."""
        if max_batch < 1 or max_batch_tokens < max_batch:
            raise ConfigError(
                f"max_batch must be 1 or more and max_batch_tokens at least max_batch, got {max_batch} and "
                f"{max_batch_tokens}"
            )
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.dtype = dtype
        self.max_batch = max_batch
        self.max_batch_tokens = max_batch_tokens
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.model = load_model(model_dir, self.device, dtype)
        self.policy_version = policy_version
        self.checkpoint = str(model_dir)
        """The directory of the weights served now."""
        self.in_place = in_place
        self.in_place_loads = 0
        self.restarts = 0
        """Versions loaded as a whole new model (the checkpoint could not go into this one in place)."""
        self.context_length = int(getattr(self.model.config, "max_position_embeddings", 4096))
        self.reach = attention_reach(self.model.config)
        self.script = script
        self.eos_ids = self._eos_ids()
        self.renderer = ChatRenderer(self.tokenizer, stop_ids=self.eos_ids)  # the glue knows what we stop on
        for problem in self.renderer.diagnose():
            log.warning("chat template %s: %s", self.renderer.template_id, problem)
        pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos_ids[0]
        self.stepper = Stepper(self.device, pad_id, self._finished)
        self._queue: asyncio.Queue[Row] = asyncio.Queue()
        self._waiting: deque[Row] = deque()
        self._chunked: Row | None = None
        """The row whose prompt is being prefilled in chunks (one at a time, in arrival order)."""
        self._swap = asyncio.Lock()  # held while any request runs; a weight swap waits for it
        self._swaps_waiting = 0
        """Weight swaps ready and waiting for the running requests to finish: no admission meanwhile."""
        self._worker: asyncio.Task[None] | None = None

    @property
    def steps(self) -> int:
        """Decode steps run so far: a running request gains one token per step."""
        return self.stepper.steps

    @property
    def running(self) -> int:
        """Requests in the batch or being prefilled."""
        return len(self.stepper.batch) + (self._chunked is not None)

    def _eos_ids(self) -> list[int]:
        ids = self.model.generation_config.eos_token_id if self.model.generation_config else None
        if ids is None:
            ids = self.tokenizer.eos_token_id
        return [ids] if isinstance(ids, int) else list(ids)

    async def generate(self, request: LLMRequest) -> Generation:
        vocabulary = int(self.model.config.vocab_size)
        if request.prefix is not None and max(request.prefix.ids, default=0) >= vocabulary:  # at C speed
            bad = next(t for t in request.prefix.ids if t >= vocabulary)
            raise RequestRejected(
                "prefix.token_ids",
                f"token id {bad} is outside the model's vocabulary of {vocabulary}; send the ids this "
                "policy's engine returned",
            )
        prompt = self.renderer.prompt(request)
        length = len(prompt.token_ids)
        if length >= self.context_length:
            raise RequestRejected(
                "messages", f"the prompt is {length} tokens; the model's context is {self.context_length}"
            )
        row = Row(
            request,
            prompt.token_ids,
            start=self._tail_start(length),
            budget=min(request.sampling.max_tokens, self.context_length - length),
            prefix_break=prompt.prefix_break,
            render_drift=prompt.render_drift,
            future=asyncio.get_running_loop().create_future(),
        )
        if self.script is not None:
            row.forced = self._scripted(request, length)
        if self._worker is None:
            self._worker = asyncio.create_task(self._run(), name="torch-backend-batches")
        await self._queue.put(row)
        return await row.future

    def _scripted(self, request: LLMRequest, prompt_length: int) -> tuple[list[int], FinishReason]:
        """The script's reply as completion ids (the end-of-message token after it), cut where an engine
        would have stopped sampling it: after the first token that completes a stop string, or at the
        budget."""
        assert self.script is not None
        rule = self.script.match(request)
        if rule is None:
            raise RequestRejected(
                "messages", f"no rule of the script matches this request: {describe(request)}"
            )
        ids = [*self.tokenizer.encode(rule.reply.text(), add_special_tokens=False), self.eos_ids[0]]
        budget = min(request.sampling.max_tokens, self.context_length - prompt_length)
        stops = request.sampling.stop
        for length in range(1, len(ids)):  # the checks of _finished, in its order
            if stops and any(stop in self._text(ids[:length]) for stop in stops):
                return ids[:length], "stop"
            if length >= budget:
                return ids[:length], "length"
        return ids, "stop"  # ends on the end-of-message token (within the budget: budget >= 1)

    def _tail_start(self, prompt_length: int) -> int:
        """Where the prefill may start: the first position the last prompt token's logits depend on."""
        return 0 if self.reach is None else max(0, prompt_length - 1 - self.reach)

    def token_bytes(self, token_id: int) -> bytes:
        return token_bytes(self.tokenizer, token_id)

    async def load_version(self, version: int, checkpoint: str) -> None:
        """The checkpoint's weights, read from disk while requests run, then swapped in once the requests
        running have finished (admission pauses meanwhile: no request mixes two versions)."""
        started = time.monotonic()
        refusal = (
            "in-place loading is off" if not self.in_place else in_place_refusal(self.checkpoint, checkpoint)
        )
        weights = None if refusal is not None else await asyncio.to_thread(read_weights, checkpoint)
        if weights is not None:
            async with self._between_requests():
                refusal = state_refusal(self.model, weights)
                if refusal is None:
                    await asyncio.to_thread(self._overwrite, weights)
                    self.policy_version, self.checkpoint = version, checkpoint
                    self.in_place_loads += 1
        if refusal is not None:
            log.warning(
                "policy version %d: loading a whole new model from %s: %s", version, checkpoint, refusal
            )
            model = await asyncio.to_thread(load_model, checkpoint, self.device, self.dtype)
            async with self._between_requests():
                self.model, self.policy_version, self.checkpoint = model, version, checkpoint
                self.reach = attention_reach(model.config)
                self.restarts += 1
        how = "in place" if refusal is None else "as a new model"
        log.info(
            "loaded policy version %d from %s %s in %.3f s",
            version,
            checkpoint,
            how,
            time.monotonic() - started,
        )

    @contextlib.asynccontextmanager
    async def _between_requests(self) -> AsyncIterator[None]:
        """Held when no request runs: admission pauses until the running ones finish, then resumes after."""
        self._swaps_waiting += 1
        try:
            async with self._swap:
                yield
        finally:
            self._swaps_waiting -= 1

    @torch.no_grad()
    def _overwrite(self, weights: dict[str, torch.Tensor]) -> None:
        own = self.model.state_dict()  # the parameters' own storage: copying into it changes the model
        for name, tensor in weights.items():
            own[name].copy_(tensor)

    async def close(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            self._worker = None

    async def _run(self) -> None:
        """The scheduler: while requests wait or run, plan a step, run it off the loop, send what finished.
        The swap lock is held from the first admission until nothing runs (or a swap waits for it)."""
        while True:
            if not self._waiting:
                self._waiting.append(await self._queue.get())
            async with self._swap:
                while (plan := self._plan()) is not None:
                    try:
                        finished = await asyncio.to_thread(self.stepper.step, plan, self.model)
                    except Exception as error:  # a fault of the step's own: the consumer stays up
                        log.exception("a batch step failed; failing the requests it held")
                        finished = self._abandon(plan, error)
                    if self._chunked is not None and (self._chunked.done or not self._chunked.unfed):
                        self._chunked = None  # its prefill is done: it is in the batch, finished or failed
                    for row in finished:
                        self._reply(row)

    def _abandon(self, plan: Plan, error: Exception) -> list[Row]:
        """Every request of a step that failed outside any one request's work, failed with its error; the
        batch starts again empty."""
        rows = [*self.stepper.batch.rows, *plan.whole, *plan.forced, *([plan.chunk[0]] if plan.chunk else [])]
        self.stepper.batch.clear()
        for row in rows:
            row.fail(error)
        return rows

    def _plan(self) -> Plan | None:
        """The next step: the rows leaving, and the newcomers admitted within ``max_batch`` running requests
        and ``max_batch_tokens`` fed (arrival order; none while a swap waits). None: nothing to do."""
        leaving = self._leaving()
        running = len(self.stepper.batch) - len(leaving) + (self._chunked is not None)
        tokens = self.max_batch_tokens - running
        whole: list[Row] = []
        forced: list[Row] = []
        admitting = not self._swaps_waiting and self._chunked is None
        while admitting and self._waiting and running < self.max_batch:
            row = self._waiting[0]
            cost = row.unfed + (len(row.forced[0]) if row.forced is not None else 0)
            if cost > tokens and (whole or forced or row.forced is None):
                if not whole and not forced:  # more than a step holds: prefilled in chunks from now on
                    self._chunked = self._waiting.popleft()
                    self._chunked.version = self.policy_version
                break  # a scripted row is scored in one pass, over the budget if it must, when alone
            self._waiting.popleft()
            row.version = self.policy_version
            (forced if row.forced is not None else whole).append(row)
            tokens -= cost
            running += row.forced is None
        chunk = (self._chunked, min(tokens, self._chunked.unfed)) if self._chunked is not None else None
        if not (leaving or whole or forced or chunk or len(self.stepper.batch)):
            return None
        return Plan(leaving, whole, chunk, forced)

    def _leaving(self) -> list[Row]:
        """Take in the requests queued since the last step; the running ones whose caller stopped waiting
        (they leave the batch in the next step), and forget the waiting ones that did."""
        while not self._queue.empty():
            self._waiting.append(self._queue.get_nowait())
        self._waiting = deque(row for row in self._waiting if not row.future.done())
        leaving = [row for row in self.stepper.batch.rows if row.future.done()]
        if self._chunked is not None and self._chunked.future.done():
            self._chunked = None  # its own cache goes with it
        return leaving

    def _reply(self, row: Row) -> None:
        if row.future.done():
            return  # its caller stopped waiting
        if row.error is not None:
            row.future.set_exception(row.error)
            return
        row.future.set_result(
            Generation(
                prompt_token_ids=row.prompt,
                completion_token_ids=row.completion,
                completion_logprobs=row.logprobs,
                top_logprobs=row.top if row.request.top_logprobs is not None else None,
                text=self._text(row.completion),
                finish_reason=row.finish_reason or "length",
                policy_version=row.version,
                prefix_break=row.prefix_break,
                # the renderer continues as [*prefix ids, *new ids] unless it broke the prefix
                extends_prefix=row.request.prefix is not None and not row.prefix_break,
                render_drift=row.render_drift,
                chat_template=self.renderer.template_id,
                started_at=row.started_at,
                first_token_at=row.first_token_at,
            )
        )

    def _text(self, completion: list[int]) -> str:
        ids = completion[:-1] if completion and completion[-1] in self.eos_ids else completion
        return str(self.tokenizer.decode(ids, skip_special_tokens=False))

    def _finished(self, row: Row) -> FinishReason | None:
        if row.completion[-1] in self.eos_ids:
            return "stop"
        stops = row.request.sampling.stop
        if stops and any(stop in self._text(row.completion) for stop in stops):
            return "stop"
        if len(row.completion) >= row.budget:
            return "length"
        return None
