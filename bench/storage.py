"""What a turn costs as an episode grows: bytes in the log, bytes on the wire, CPU per turn.

One agent conversation of N turns (``--turns``, default 10,40,100) is recorded by a real ``EpisodeSession``
into PostgreSQL, its requests answered by the inference consumer's own request handling
(``InferenceService.handle``, in process: the bytes it receives and sends are the NATS payloads) over a
synthetic backend. Each turn adds a user message of ``--new-text`` bytes (one prompt id per 4 bytes, about
220 ids) and a reply of ``--reply-tokens`` ids, so the prompt reaches ~32k ids at turn 100.

Two writers, side by side in one run:
- ``delta`` (today): a turn records what it adds to its parent; a request continuing a turn names the
  tokens the consumer holds and carries only its new messages; the reply leaves out the prompt's prefix.
- ``whole`` (the baseline, the version-1 layout): the same turns expanded before they are appended, so each
  stores its whole history again, and the wire carries the whole conversation and prefix both ways.

Figures: stored bytes (``pg_column_size`` of ``data`` + ``tokens`` of the episode's events) ÷ the raw new
content (4 bytes per new prompt id, completion id and logprob, plus the new text's bytes); wire bytes per
continuation turn ÷ that turn's new content; CPU per turn (session + consumer handling, this process) at the
last tenth of the turns ÷ the first tenth.

    python bench/storage.py                  # about a minute on 2 cores
    python bench/storage.py --turns 10,40
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import random
import statistics
import string
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
from rich.console import Console
from rich.table import Table

from pipeline.episodes import EpisodeSession, expand_turn
from pipeline.inference import InferenceService, raise_for_error
from pipeline.inference.backends import Generation
from pipeline.inference.chain import Chain
from pipeline.log import EventStore, encode_event
from pipeline.materialize.config import MaterializerConfig
from pipeline.materialize.fold import Fold
from pipeline.materialize.records import LogRow
from pipeline.materialize.writer import Materializer
from schemas import ChatMessage, Event, LLMError, LLMRequest, LLMResponse, TurnCompleted, parse_wire

sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
from common import postgres_server, scratch_database  # bench/common.py


def words(rng: random.Random, size: int) -> str:
    """Text that compresses about as well as prose (PostgreSQL compresses what it stores)."""
    return "".join(rng.choices(string.ascii_letters + string.digits + "      .,", k=size))


class SyntheticBackend:
    """Prompt: the prefix's ids, then one id per 4 bytes of each new message; a fixed-size reply. ``cpu``:
    the seconds it spent (the engine's share, left out of the consumer's figure)."""

    def __init__(self, reply_tokens: int) -> None:
        self.reply_tokens = reply_tokens
        self.policy_version = 0
        self.cpu = 0.0

    async def generate(self, request: LLMRequest) -> Generation:
        began = time.process_time()
        try:
            return self._generate(request)
        finally:
            self.cpu += time.process_time() - began

    def _generate(self, request: LLMRequest) -> Generation:
        started = time.monotonic()
        skipped = request.prefix.message_count if request.prefix else 0
        new: list[int] = []
        for message in request.messages[skipped:]:
            text = (message.content or "").encode()
            new += [1, *(100 + (b * 7919 + i * 104729) % 150_000 for i, b in enumerate(text[::4])), 2]
        # the prefix's ids then the new ones, the prefix not copied (as the scripted backend builds it)
        prompt = Chain.of(request.prefix.ids).then(new) if request.prefix else new
        rng = random.Random(len(prompt))
        completion = [rng.randrange(100, 150_000) for _ in range(self.reply_tokens - 1)] + [2]
        return Generation(
            prompt_token_ids=prompt,
            completion_token_ids=completion,
            completion_logprobs=[-rng.random() * 5 for _ in completion],
            text=words(rng, self.reply_tokens * 4),
            finish_reason="stop",
            policy_version=0,
            extends_prefix=request.prefix is not None,  # as the engines' renderer builds prompts
            started_at=started,
            first_token_at=time.monotonic(),
        )

    async def load_version(self, version: int, checkpoint: str) -> None:
        pass

    async def close(self) -> None:
        pass


class Published:
    async def __call__(self, subject: str, body: bytes, headers: dict[str, str]) -> None:
        pass


@dataclass
class Wire:
    service: InferenceService
    whole: bool
    bytes_per_call: list[int] = field(default_factory=list)
    consumer_cpu: float = 0.0
    """Seconds the consumer's request handling took (``handle``), the engine's share left out."""
    handle_cpu: float = 0.0

    async def __call__(self, request: LLMRequest) -> LLMResponse:
        data = request.model_dump_json(exclude_none=True).encode()  # as NatsLLMClient sends it
        backend = self.service.backend
        assert isinstance(backend, SyntheticBackend)
        began, engine = time.process_time(), backend.cpu
        body = await self.service.handle(data, None)
        self.handle_cpu += time.process_time() - began
        self.consumer_cpu += time.process_time() - began - (backend.cpu - engine)
        reply = parse_wire(body)
        if isinstance(reply, LLMError):
            raise_for_error(reply)
        assert isinstance(reply, LLMResponse)
        if self.whole:  # the version-1 wire: the reply echoes the whole prompt; nothing is held
            prompt = [*(request.prefix.ids if request.prefix else [])][: reply.prompt_prefix_tokens]
            reply = reply.model_copy(
                update={"prompt_token_ids": [*prompt, *reply.prompt_token_ids], "prompt_prefix_tokens": 0,
                        "tokens_key": None}
            )  # fmt: skip
            body = reply.model_dump_json().encode()
        self.bytes_per_call.append(len(data) + len(body))
        return reply


class WholeTurns:
    """A store wrapper that appends each turn whole (the version-1 layout) instead of its delta."""

    def __init__(self, store: EventStore) -> None:
        self.store = store
        self.whole: dict[Any, TurnCompleted] = {}

    async def append(self, stream: str, events: Sequence[Event], expected_version: int | None = None,
                     **options: Any) -> Any:  # fmt: skip
        expanded: list[Event] = []
        for event in events:
            if isinstance(event, TurnCompleted):
                parent = self.whole.get(event.parent_turn_id)
                event = self.whole[event.turn_id] = expand_turn(event, parent)
            expanded.append(event)
        return await self.store.append(stream, expanded, expected_version, **options)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)


def episode_rows(schema: str, episode_id: str) -> dict[str, tuple[str, str, tuple[Any, ...]]]:
    """Per table: (relation, the WHERE that picks the episode's rows, its parameters)."""
    started = f"(SELECT started_position FROM {schema}.episodes WHERE episode_id = %s)"
    return {
        "events": ("events", "stream = %s", (f"episode-{episode_id}",)),
        "episodes": (f"{schema}.episodes", "episode_id = %s", (episode_id,)),
        "turn_rows": (f"{schema}.turn_rows", f"episode = {started}", (episode_id,)),
        "sample_rows": (
            f"{schema}.sample_rows",
            f"turn_id IN (SELECT turn_id FROM {schema}.turn_rows WHERE episode = {started})",
            (episode_id,),
        ),
    }


def index_bytes(
    connection: psycopg.Connection[Any], relation: str, where: str, params: tuple[Any, ...]
) -> int:
    """An estimate of the index entries that the picked rows hold in every index of ``relation`` (partial
    indexes: the rows their predicate takes): per entry an 8-byte index tuple header and its key, rounded
    up to 8 bytes, plus a 4-byte line pointer; B-tree pages' free space and inner pages left out."""
    indexes = connection.execute(
        "SELECT pg_get_expr(x.indpred, x.indrelid), "
        "array(SELECT pg_get_indexdef(x.indexrelid, k, true) FROM generate_series(1, x.indnkeyatts) k) "
        "FROM pg_index x WHERE x.indrelid = %s::regclass",
        (relation,),
    ).fetchall()
    total = 0
    for predicate, keys in indexes:
        key = (
            f"pg_column_size(ROW({', '.join(keys)})) - 24" if len(keys) > 1 else f"pg_column_size({keys[0]})"
        )
        row = connection.execute(
            f"SELECT coalesce(sum(((8 + {key} + 7) / 8) * 8 + 4), 0) FROM {relation} "
            f"WHERE ({where}) AND ({predicate or 'true'})",
            params,
        ).fetchone()
        total += int(row[0]) if row else 0
    return total


async def read_model_bytes(url: str, episode_id: str, name: str) -> tuple[int, int, int]:
    """Bytes of the episode's read-model rows (its ``episodes``, ``turn_rows`` and ``sample_rows`` rows:
    ``pg_column_size`` of each whole row, its 24-byte header and TOAST-compressed values included) once
    materialized and batched, with the published payloads gone from the outbox (a relay with
    ``--outbox-retention 0`` deletes them): what the episode leaves beside the log. Then the index entries of
    those rows (an estimate, ``index_bytes``), and the log's whole rows and index entries, for the figure
    that counts everything. A ``batches`` row (~150 bytes) is per batch of many episodes' samples, not
    counted here."""
    config = MaterializerConfig(name=name, batch_samples=1)
    materializer = Materializer(url, config)
    await materializer.open(create=True)
    await materializer.catch_up()
    await materializer.close()
    picks = episode_rows(config.schema, episode_id)
    rows = indexes = log_everything = 0
    with psycopg.connect(url) as connection:
        for table, (relation, where, params) in picks.items():
            row = connection.execute(
                f"SELECT coalesce(sum(pg_column_size(r.*)), 0) FROM {relation} r WHERE {where}", params
            ).fetchone()
            size, entries = (int(row[0]) if row else 0), index_bytes(connection, relation, where, params)
            if table == "events":
                log_everything = size + entries
            else:
                rows, indexes = rows + size, indexes + entries
    return rows, indexes, log_everything


@dataclass
class Result:
    stored: int
    models: int
    model_indexes: int
    everything: int
    new_content: int
    wire_ratio: float
    session_ratio: float
    consumer_ratio: float
    fold_ms: dict[str, float]
    prompt_tokens: int


def fold_ms_per_turn(stream: str, events: list[Event], turns: int) -> dict[str, float]:
    """The materializer's fold of the episode (as it reads the log), ms of CPU per turn, by sample style."""
    rows = []
    for position, event in enumerate(events, start=1):
        encoded = encode_event(event)
        at = datetime(2026, 1, 1, tzinfo=UTC) + timedelta(seconds=position)
        rows.append(LogRow(position, stream, event.type, json.loads(encoded.data), encoded.tokens, at))
    spent = {}
    for style in ("concat", "individual"):
        fold = Fold(MaterializerConfig(name="bench", style=style, batch_samples=10**6))  # type: ignore[arg-type]
        began = time.process_time()
        for row in rows:
            fold.apply(row)
        spent[style] = (time.process_time() - began) / turns * 1000
    return spent


async def episode(url: str, turns: int, args: argparse.Namespace, *, whole: bool) -> Result:
    gc.collect()
    store = await EventStore.connect(url)
    service = InferenceService(
        SyntheticBackend(args.reply_tokens), policy="p", consumer_id="c", publish=Published()
    )
    wire = Wire(service, whole)
    session = EpisodeSession(WholeTurns(store) if whole else store, wire, policy="p")  # type: ignore[arg-type]
    await session.start()
    rng = random.Random(turns)
    messages: list[ChatMessage] = [ChatMessage(role="user", content=words(rng, args.new_text))]
    session_cpu, consumer_cpu, new_content = [], [], 0
    for k in range(turns):
        began, handled, consumed = time.process_time(), wire.handle_cpu, wire.consumer_cpu
        reply = await session.chat(messages)
        session_cpu.append(time.process_time() - began - (wire.handle_cpu - handled))
        consumer_cpu.append(wire.consumer_cpu - consumed)
        new_text = len(messages[-1].content or "") + len(reply.text)
        new_ids = len(reply.completion_token_ids) * 2 + (len(messages[-1].content or "") + 3) // 4 + 2
        new_content += new_text + 4 * new_ids
        if k == 0:
            first_new = new_text + 4 * new_ids
        messages = [*messages, reply.message, ChatMessage(role="user", content=words(rng, args.new_text))]
    prompt_tokens = len(session.turns[-1].prompt_token_ids)
    await session.finish("done")
    with psycopg.connect(url) as connection:
        row = connection.execute(
            "SELECT sum(pg_column_size(data) + coalesce(pg_column_size(tokens), 0)) FROM events "
            "WHERE stream = %s",
            (session.stream,),
        ).fetchone()
    await store.close()
    models, model_indexes, log_everything = await read_model_bytes(
        url, session.episode_id, f"b{turns}{'w' if whole else 'd'}"
    )
    tenth = max(1, turns // 10)
    continued = wire.bytes_per_call[1:] or wire.bytes_per_call

    def growth(cpu: list[float]) -> float:
        """Median CPU of the last tenth of the turns ÷ the first tenth (turn 1, the root, left out): the
        median, so a garbage collection or a scheduler hiccup in one turn does not decide it."""
        return statistics.median(cpu[-tenth:]) / statistics.median(cpu[1 : 1 + tenth] or cpu)

    return Result(
        stored=int(row[0]) if row else 0,
        models=models,
        model_indexes=model_indexes,
        everything=log_everything + models + model_indexes,
        new_content=new_content,
        wire_ratio=statistics.median(continued) / first_new,
        session_ratio=growth(session_cpu),
        consumer_ratio=growth(consumer_cpu),
        fold_ms=fold_ms_per_turn(session.stream, session.events, turns),
        prompt_tokens=prompt_tokens,
    )


async def run(url: str, args: argparse.Namespace) -> Table:
    table = Table(title="bytes and CPU per episode: turns recorded as deltas vs whole (version 1)")
    columns = ("turns", "prompt ids at the end", "writer", "log ÷ new content",
               "log + read models ÷ new content", "read models B/turn (+ index entries)",
               "everything ÷ new content", "wire ÷ new content",
               "session CPU/turn last ÷ first tenth", "consumer CPU/turn last ÷ first tenth",
               "fold ms/turn concat | individual", "stored, delta ÷ whole")  # fmt: skip
    for column in columns:
        table.add_column(column, justify="right")
    for turns in args.turns:
        whole = await episode(url, turns, args, whole=True)
        delta = await episode(url, turns, args, whole=False)
        for name, result in (("whole (v1)", whole), ("delta", delta)):
            table.add_row(
                str(turns), f"{result.prompt_tokens:,}", name, f"{result.stored / result.new_content:.2f}",
                f"{(result.stored + result.models) / result.new_content:.3f}",
                f"{result.models / turns:,.0f} (+{result.model_indexes / turns:,.0f})",
                f"{result.everything / result.new_content:.2f}",
                f"{result.wire_ratio:.2f}", f"{result.session_ratio:.2f}", f"{result.consumer_ratio:.2f}",
                f"{result.fold_ms['concat']:.2f} | {result.fold_ms['individual']:.2f}",
                f"{delta.stored / whole.stored:.3f}" if name == "delta" else "",
            )  # fmt: skip
    return table


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--turns", type=lambda s: [int(x) for x in s.split(",")], default=[10, 40, 100])
    parser.add_argument("--new-text", type=int, default=880, help="bytes of the user message each turn adds")
    parser.add_argument("--reply-tokens", type=int, default=100)
    parser.add_argument(
        "--compression",
        choices=("pglz", "lz4"),
        default="pglz",
        help="PostgreSQL's TOAST compression (>= 14)",
    )
    args = parser.parse_args(argv)
    with postgres_server(None) as (server_url, _), scratch_database(server_url) as url:
        if args.compression != "pglz":
            with psycopg.connect(url, autocommit=True) as connection:
                connection.execute(f"ALTER TABLE events ALTER COLUMN data SET COMPRESSION {args.compression}")
        table = asyncio.run(run(url, args))
        table.caption = (
            f"TOAST compression of events.data: {args.compression}; events.tokens is stored uncompressed "
            "(migration 0015)"
        )
    Console(width=200).print(table)


if __name__ == "__main__":
    main()
