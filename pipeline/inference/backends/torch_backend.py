"""A transformers causal LM served with torch (CPU or GPU), several requests batched together.

Requests that arrive while a batch runs wait and form the next batch (static batching). Each batch is a
left-padded prefill and a decode loop over the KV cache; every row samples with its own temperature,
top-p, top-k, seed, stop strings and max_tokens. Logprobs are ``log_softmax`` of the raw logits, before
temperature or truncation, as vLLM reports them.

A model whose every layer attends within a sliding window (``turnstile model init-long``) is run on the tail
of each prompt only: the logits at a position depend on at most ``layers * (window - 1)`` tokens before it
(``attention_reach``), so the prefill starts there, at the true positions, and gives the numbers of a forward
pass over the whole prompt at a cost that does not grow with the prompt.

With a ``Script`` (``--script FILE``) the backend does not sample: the first matching rule's reply text,
as the tokenizer's ids, is the completion, scored by one forward pass over prompt + completion (teacher
forcing) — what the engine would have returned had it sampled that text.

A new policy version goes in between batches. With ``in_flight="restart"`` (the default) the batch running
is cut short at its next decode step: its rows that had not finished start again from their prompts, first
in the next batch, on the new weights (their tokens of the old version are dropped); rows it had finished
keep their replies of the old version. With ``in_flight="drain"`` the batch running finishes on the old
weights and its replies carry the old version. Every later batch runs on the new ones. The weights are
copied into the model in place when the checkpoint is the same model with other values
(``weights.in_place_refusal``); otherwise (another shape or configuration) a whole new model is loaded from
the checkpoint, logged and counted in ``restarts``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pipeline.inference.backends import IN_FLIGHT_DEFAULT, Generation, InFlight
from pipeline.inference.backends.weights import in_place_refusal, read_weights, state_refusal
from pipeline.inference.chat import ChatRenderer, token_bytes
from pipeline.inference.client import RequestRejected
from pipeline.inference.script import Script, describe
from schemas import FinishReason, LLMRequest, SamplingParams

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Row:
    request: LLMRequest
    prompt: list[int]
    prefix_break: bool
    render_drift: bool | None
    future: asyncio.Future[Generation]
    forced: tuple[list[int], FinishReason] | None = None
    """The scripted completion and how it ends (teacher forcing); None: sample."""
    completion: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    started_at: float = 0.0
    first_token_at: float = 0.0
    interrupted: bool = False
    """Cut short by a new policy version before it finished: to run again from its prompt."""
    restarted_seconds: float = 0.0

    def reset(self) -> None:
        """Forget what was generated: the row runs again from its prompt."""
        self.completion.clear()
        self.logprobs.clear()
        self.top.clear()
        self.finish_reason = None

    def restart(self) -> None:
        """After an interruption: the time it ran is counted as dropped, and it runs again."""
        self.restarted_seconds += time.monotonic() - self.started_at
        self.interrupted = False
        self.reset()


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
        max_batch: int = 16,
        policy_version: int = 0,
        script: Script | None = None,
        in_place: bool = True,
        in_flight: InFlight = IN_FLIGHT_DEFAULT,
    ) -> None:
        """``in_place=False``: every version loaded as a whole new model (the fallback; a baseline).
        ``in_flight``: the batch running at a swap is restarted on the new weights or finished on the old."""
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.dtype = dtype
        self.max_batch = max_batch
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.model = load_model(model_dir, self.device, dtype)
        self.policy_version = policy_version
        self.checkpoint = str(model_dir)
        """The directory of the weights served now."""
        self.in_place = in_place
        self.in_flight = in_flight
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
        self.pad_id = (
            self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos_ids[0]
        )
        self._queue: asyncio.Queue[_Row] = asyncio.Queue()
        self._swap = asyncio.Lock()  # held while a batch runs; a weight swap waits for it
        self._interrupt = threading.Event()  # set: the batch running (in its thread) stops at its next step
        self._resumed: list[_Row] = []  # rows cut short by a swap: they go first in the next batch
        self._worker: asyncio.Task[None] | None = None

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
        if len(prompt.token_ids) >= self.context_length:
            raise RequestRejected(
                "messages",
                f"the prompt is {len(prompt.token_ids)} tokens; the model's context is {self.context_length}",
            )
        future = asyncio.get_running_loop().create_future()
        row = _Row(request, prompt.token_ids, prompt.prefix_break, prompt.render_drift, future)
        if self.script is not None:
            row.forced = self._scripted(request, len(prompt.token_ids))
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
        """The checkpoint's weights, read from disk while batches run, then swapped in between two batches."""
        started = time.monotonic()
        refusal = (
            "in-place loading is off" if not self.in_place else in_place_refusal(self.checkpoint, checkpoint)
        )
        weights = None if refusal is not None else await asyncio.to_thread(read_weights, checkpoint)
        if weights is not None:
            async with self._between_batches():  # no batch runs while the values change
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
            async with self._between_batches():
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
    async def _between_batches(self) -> AsyncIterator[None]:
        """Hold the batches off while the weights change. The batch running is cut short (``in_flight`` is
        "restart") or ends on the old weights ("drain") before this enters."""
        if self.in_flight == "restart":
            self._interrupt.set()
        async with self._swap:
            self._interrupt.clear()  # the batch it was meant for has returned
            yield

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
        while True:
            batch, self._resumed = self._resumed, []
            if not batch:
                batch.append(await self._queue.get())
            while len(batch) < self.max_batch and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            async with self._swap:
                version = self.policy_version
                await self._generate_isolated(batch)
            for row in batch:
                if row.future.done():
                    continue
                if row.interrupted:  # by a new version: its tokens so far are the old one's, dropped
                    row.restart()
                    self._resumed.append(row)
                    continue
                row.future.set_result(
                    Generation(
                        prompt_token_ids=row.prompt,
                        completion_token_ids=row.completion,
                        completion_logprobs=row.logprobs,
                        top_logprobs=row.top if row.request.top_logprobs is not None else None,
                        text=self._text(row.completion),
                        finish_reason=row.finish_reason or "length",
                        policy_version=version,
                        prefix_break=row.prefix_break,
                        # the renderer continues as [*prefix ids, *new ids] unless it broke the prefix
                        extends_prefix=row.request.prefix is not None and not row.prefix_break,
                        render_drift=row.render_drift,
                        chat_template=self.renderer.template_id,
                        started_at=row.started_at,
                        first_token_at=row.first_token_at,
                        restarted_seconds=row.restarted_seconds,
                    )
                )

    async def _generate_isolated(self, batch: list[_Row]) -> None:
        """Generate a batch; if it fails, each row again alone, so one bad request fails alone."""
        try:
            await asyncio.to_thread(self._generate_batch, batch, self.model)
        except Exception as error:
            if len(batch) == 1:
                log.exception("request %s failed", batch[0].request.request_id)
                if not batch[0].future.done():
                    batch[0].future.set_exception(error)
                return
            log.warning("a batch of %d failed (%s); generating each request alone", len(batch), error)
            for row in batch:
                row.reset()
                await self._generate_isolated([row])

    def _text(self, completion: list[int]) -> str:
        ids = completion[:-1] if completion and completion[-1] in self.eos_ids else completion
        return str(self.tokenizer.decode(ids, skip_special_tokens=False))

    @torch.inference_mode()
    def _generate_batch(self, rows: list[_Row], model: Any) -> None:
        for row in rows:
            if row.forced is not None:
                self._teacher_force(row, model)
        rows = [row for row in rows if row.forced is None]
        if rows:
            self._sample_batch(rows, model)

    def _teacher_force(self, row: _Row, model: Any) -> None:
        """Score the scripted completion with one forward pass over the prompt's tail + the completion."""
        assert row.forced is not None
        row.started_at = time.monotonic()
        completion, finish_reason = row.forced
        start = self._tail_start(len(row.prompt))
        ids = [*row.prompt[start:], *completion]
        positions = torch.arange(start, start + len(ids), device=self.device)[None]
        logits = model(input_ids=torch.tensor([ids], device=self.device), position_ids=positions).logits[0]
        scored = torch.log_softmax(logits[len(row.prompt) - start - 1 : -1].float(), dim=-1)
        chosen = scored.gather(1, torch.tensor(completion, device=self.device)[:, None])[:, 0]
        row.completion, row.logprobs = list(completion), [float(v) for v in chosen]
        if row.request.top_logprobs is not None:
            row.top = [_top(position, row.request.top_logprobs) for position in scored]
        row.first_token_at = time.monotonic()
        row.finish_reason = finish_reason

    def _sample_batch(self, rows: list[_Row], model: Any) -> None:
        """Left-padded prefill of each prompt's tail at its true positions, then a decode loop."""
        started = time.monotonic()
        starts = [self._tail_start(len(row.prompt)) for row in rows]
        width = max(len(row.prompt) - start for row, start in zip(rows, starts, strict=True))
        input_ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        attention = torch.zeros((len(rows), width), dtype=torch.long)
        positions = torch.zeros((len(rows), width), dtype=torch.long)
        for i, (row, start) in enumerate(zip(rows, starts, strict=True)):
            row.started_at = started
            fed = len(row.prompt) - start
            input_ids[i, width - fed :] = torch.tensor(row.prompt[start:])
            attention[i, width - fed :] = 1
            positions[i, width - fed :] = torch.arange(start, len(row.prompt))
        generators = [_generator(row.request.sampling) for row in rows]
        budgets = [
            min(row.request.sampling.max_tokens, self.context_length - len(row.prompt)) for row in rows
        ]
        cache = None
        step_ids, step_positions = input_ids.to(self.device), positions.to(self.device)
        attention = attention.to(self.device)
        for _ in range(max(budgets)):
            if self._interrupt.is_set():  # a new version waits: the rows not finished run again on it
                for row in rows:
                    row.interrupted = row.finish_reason is None
                return
            output = model(
                input_ids=step_ids,
                attention_mask=attention,
                position_ids=step_positions,
                past_key_values=cache,
                use_cache=True,
            )
            cache = output.past_key_values
            logits = output.logits[:, -1, :].float()
            raw_logprobs = torch.log_softmax(logits, dim=-1)
            next_ids = []
            for i, row in enumerate(rows):
                if row.finish_reason is not None:
                    next_ids.append(self.pad_id)
                    continue
                token = _sample(logits[i], row.request.sampling, generators[i])
                row.completion.append(token)
                row.logprobs.append(float(raw_logprobs[i, token]))
                if row.request.top_logprobs is not None:
                    row.top.append(_top(raw_logprobs[i], row.request.top_logprobs))
                if len(row.completion) == 1:
                    row.first_token_at = time.monotonic()
                row.finish_reason = self._finished(row, budgets[i])
                next_ids.append(token)
            if all(row.finish_reason is not None for row in rows):
                break
            step_ids = torch.tensor(next_ids, device=self.device)[:, None]
            attention = torch.cat([attention, torch.ones_like(attention[:, :1])], dim=1)
            step_positions = step_positions[:, -1:] + 1

    def _finished(self, row: _Row, budget: int) -> FinishReason | None:
        if row.completion[-1] in self.eos_ids:
            return "stop"
        stops = row.request.sampling.stop
        if stops and any(stop in self._text(row.completion) for stop in stops):
            return "stop"
        if len(row.completion) >= budget:
            return "length"
        return None


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
