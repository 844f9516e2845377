"""Rebuilds of a varied log give, byte for byte, what the materializer gave before its fold was rewritten.

``tests/support/fixtures/rebuild_digests.json`` holds, per configuration, a sha256 of every read-model table
and of the batch payloads as the code at ``f37f26a`` (turns as tuples of ints, ids as ``uuid.UUID``) made them
from the log ``varied_log`` writes. The log is a pure function of its seed: episodes interleaved as a busy
runner records them, chains recorded whole or as deltas (whole and partial prefixes), branches, side calls,
turns marked not for training and never delivered, rewards for turns and for episodes, every termination,
groups whose members never come (the group timeout), two policies with published versions, and events no
reader can fold (skipped with their reason). ``recorded_at`` is a clock of the log's own, so every derived
timestamp is fixed too.

Regenerated once since, for lineage rule 2 (its version in every batch id's configuration hash, and
``turn_rows``' ``delivered``, ``trained``, ``lineage`` and ``root_reason``): the same row counts in every
table, the same episodes and skipped events. Regenerate the fixture only for a change that is meant to
change what a log folds to:
``python -m tests.integration.test_rebuild_equivalence DATABASE_URL`` prints it.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import sys
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from pipeline.log import encode_event
from pipeline.log.store import APPEND_LOCK, COPY_COLUMNS, COPY_TYPES, JsonText, JsonTextBinaryDumper
from pipeline.materialize.columns import BATCH_COLUMNS, EPISODE_COLUMNS, SAMPLE_COLUMNS, TURN_COLUMNS
from pipeline.materialize.config import MaterializerConfig
from pipeline.materialize.writer import Materializer
from pipeline.settings import libpq_url
from schemas import (
    ChatMessage,
    EpisodeFinished,
    EpisodeStarted,
    Event,
    PolicyVersionPublished,
    RewardAssigned,
    TurnCompleted,
    TurnReply,
    TurnRequest,
)

FIXTURE = Path(__file__).parents[1] / "support" / "fixtures" / "rebuild_digests.json"
EPOCH = datetime(2026, 1, 1, tzinfo=UTC)
CONFIGS: dict[str, dict[str, Any]] = {
    "individual": {"batch_samples": 8},
    "concat": {"style": "concat", "advantage": "mean", "discount": 0.9, "batch_tokens": 300},
    "slot_flag": {
        "advantage_peers": "slot", "advantage": "none", "max_staleness": 1, "stale": "flag",
        "group_timeout_s": 4.0, "batch_samples": 5, "step_events": 7,
    },
    "concat_drop": {
        "style": "concat", "max_staleness": 0, "discount": 0.5, "batch_samples": 3, "step_events": 50,
    },
}  # fmt: skip
TABLES: dict[str, tuple[str, tuple[str, ...]]] = {
    "episodes": ("started_position", EPISODE_COLUMNS),
    "turn_rows": ("turn_id", TURN_COLUMNS),
    "sample_rows": ("turn_id", SAMPLE_COLUMNS),
    "batches": ("batch_id", BATCH_COLUMNS),
    "batch_outbox": ("batch_id", ("batch_id", "subject", "payload", "created_at")),
    "skipped_events": ("position", ("position", "stream", "type", "episode_id", "reason")),
}


def _uuid(rng: random.Random) -> uuid.UUID:
    return uuid.UUID(int=rng.getrandbits(128), version=4)


def _ids(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(1, 500) for _ in range(count)]


def _turn(rng: random.Random, prompt: list[int], **fields: Any) -> TurnCompleted:
    completion = _ids(rng, rng.randint(0 if rng.random() < 0.05 else 1, 6))
    return TurnCompleted(
        turn_id=_uuid(rng),
        event_id=_uuid(rng),
        request=TurnRequest(messages=[ChatMessage(role="user", content="q")]),
        reply=TurnReply(text="a", finish_reason="stop"),
        prompt_token_ids=prompt,
        completion_token_ids=completion,
        completion_logprobs=[-rng.choice([0.0, 0.25, 0.5, 1.5, 3.0]) for _ in completion],
        policy_version=rng.choice([0, 0, 1, 2]),
        engine_id="engine-a",
        **fields,
    )


def _episode(rng: random.Random, name: str, group: str | None, size: int, policy: str) -> list[Event]:
    """One episode's events: a turn tree as an agent records it, rewards, and (mostly) an ending."""
    events: list[Event] = [
        EpisodeStarted(
            event_id=_uuid(rng), episode_id=name, task_id="t", agent=rng.choice(["x", "y"]), policy=policy,
            group_id=group, group_size=size, tags={"k": str(rng.randint(0, 2))},
        )
    ]  # fmt: skip
    made: list[tuple[TurnCompleted, list[int]]] = []  # each turn and its whole prompt + completion
    for _ in range(rng.choice([0, 1, 1, 2, 3, 4, 6])):
        kind = rng.random()
        fields: dict[str, Any] = {}
        if rng.random() < 0.1:
            fields["train"] = False
        if rng.random() < 0.08:
            fields["delivered"] = False
        if made and kind < 0.45:  # continue the latest (or, sometimes, an earlier) turn: a delta
            parent, whole = made[-1] if rng.random() < 0.8 else rng.choice(made)
            taken = len(whole) if rng.random() < 0.85 else rng.randint(1, len(whole))
            new = _ids(rng, rng.randint(1, 4))
            event = _turn(
                rng, new, parent_turn_id=parent.turn_id, prefix_tokens=taken, prefix_messages=1, **fields
            )
            prompt = whole[:taken] + new
        elif made and kind < 0.7:  # the same, recorded whole (version 1): the parent found by tokens
            parent, whole = rng.choice(made)
            prompt = whole + _ids(rng, rng.randint(0, 3))
            event = _turn(rng, prompt, **fields)
        else:  # a new root: the first call, a side call, a subagent
            prompt = _ids(rng, rng.randint(1, 6))
            event = _turn(rng, prompt, **fields)
        made.append((event, prompt + list(event.completion_token_ids)))
        events.append(event)
        if rng.random() < 0.3:
            events.append(
                RewardAssigned(event_id=_uuid(rng), turn_id=event.turn_id, value=rng.choice([0.5, 1.0]))
            )
    for _ in range(rng.choice([0, 1, 1, 1, 2])):
        events.append(RewardAssigned(event_id=_uuid(rng), value=rng.choice([0.0, 0.25, 1.0, -1.0])))
    if rng.random() < 0.95:
        termination = rng.choice(["done", "done", "done", "max_turns", "truncated", "error", "timeout"])
        events.append(EpisodeFinished(event_id=_uuid(rng), termination=termination))
    return events


def varied_log(seed: int = 7, episodes: int = 160) -> list[tuple[str, str, dict[str, Any], bytes | None]]:
    """(stream, type, data, tokens) in log order: episodes interleaved, a few events forged unfoldable."""
    rng = random.Random(seed)
    pending: list[tuple[str, list[Event]]] = []
    for index in range(episodes):
        group, size = (f"g{index // 3}", 3) if index % 5 else (None, 1)
        policy = "p" if index % 7 else "q"
        pending.append((f"episode-e{index}", _episode(rng, f"e{index}", group, size, policy)))
    log: list[tuple[str, str, dict[str, Any], bytes | None]] = []
    running: list[tuple[str, list[Event]]] = []
    while pending or running:
        while pending and len(running) < 12:
            running.append(pending.pop(0))
        slot = rng.randrange(len(running))
        stream, events = running[slot]
        encoded = encode_event(events.pop(0))
        data, tokens = json.loads(encoded.data), encoded.tokens
        if encoded.type == "TurnCompleted" and rng.random() < 0.02:  # forged: a positive logprob
            assert tokens is not None
            tokens = tokens[:-4] + b"\x00\x00\x80\x3f"
        if encoded.type == "RewardAssigned" and rng.random() < 0.03:  # forged: not a number
            data["value"] = "lots"
        log.append((stream, encoded.type, data, tokens))
        if not events:
            running.pop(slot)
        if rng.random() < 0.01:
            version = PolicyVersionPublished(
                event_id=_uuid(rng), policy="p", version=len(log) // 100, checkpoint="c"
            )
            log.append(("policy-p", version.type, json.loads(encode_event(version).data), None))
    first_turn = next(data for _, kind, data, _ in log if kind == "TurnCompleted")
    log.append(("episode-torn", "EpisodeStarted", {**log[0][2], "episode_id": "torn"}, None))
    log.append(("episode-torn", "TurnCompleted", first_turn, b"TSK1"))  # forged: torn token arrays
    log.append(("episode-torn", "EpisodeFinished", {"termination": "done"}, None))
    return log


def write_log(database_url: str, log: list[tuple[str, str, dict[str, Any], bytes | None]]) -> None:
    """The log written as its owner would (the append lock, positions 1..N), 1.5 s of log time an event."""
    versions: dict[str, int] = {}
    rng = random.Random(0)
    statement = f"COPY events ({', '.join(COPY_COLUMNS)}, recorded_at) FROM STDIN (FORMAT BINARY)"
    with psycopg.connect(libpq_url(database_url)) as connection:
        connection.adapters.register_dumper(JsonText, JsonTextBinaryDumper)
        connection.execute("SELECT pg_advisory_xact_lock(%s)", (APPEND_LOCK,))
        with connection.cursor().copy(statement) as copy:
            copy.set_types([*COPY_TYPES, "timestamptz"])
            for position, (stream, kind, data, tokens) in enumerate(log, start=1):
                versions[stream] = versions.get(stream, 0) + 1
                copy.write_row(
                    (position, stream, versions[stream], _uuid(rng), kind, JsonText(json.dumps(data)), tokens,
                     JsonText("{}"), b"\0", EPOCH + timedelta(seconds=1.5 * position))
                )  # fmt: skip


def _canonical(value: Any) -> Any:
    if isinstance(value, bytes | memoryview):
        return "sha256:" + hashlib.sha256(bytes(value)).hexdigest()
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, list):
        return [_canonical(item) for item in value]
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, uuid.UUID):
        return str(value)
    return value


def digests(database_url: str, schema: str) -> dict[str, str]:
    """A sha256 per read-model table of the rebuild in ``schema``: every column, every row, in key order."""
    found = {}
    with psycopg.connect(libpq_url(database_url)) as connection:
        for table, (key, columns) in TABLES.items():
            query = sql.SQL("SELECT {} FROM {}.{} ORDER BY {}").format(
                sql.SQL(", ").join(map(sql.Identifier, columns)),
                sql.Identifier(schema),
                sql.Identifier(table),
                sql.Identifier(key),
            )
            rows = [[_canonical(v) for v in row] for row in connection.execute(query).fetchall()]
            text = json.dumps(rows, sort_keys=True, separators=(",", ":"))
            found[table] = f"{len(rows)}:{hashlib.sha256(text.encode()).hexdigest()}"
    return found


async def rebuild_digests(database_url: str) -> dict[str, dict[str, str]]:
    found = {}
    for name, options in CONFIGS.items():
        materializer = Materializer(database_url, MaterializerConfig(name=name, **options))
        await materializer.open(create=True)
        await materializer.catch_up()
        await materializer.close()
        found[name] = digests(database_url, f"rm_{name}")
    return found


async def test_rebuilds_of_a_varied_log_are_what_the_earlier_fold_made(database_url: str) -> None:
    write_log(database_url, varied_log())
    expected = json.loads(FIXTURE.read_text())
    found = await rebuild_digests(database_url)
    for name in CONFIGS:
        # every table has rows (the log exercises each), and each is what the earlier code wrote
        assert all(
            not digest.startswith("0:") for table, digest in found[name].items() if table != "skipped_events"
        )
        assert found[name] == expected[name], name


if __name__ == "__main__":  # pragma: no cover - regenerates the fixture's content
    url = sys.argv[1]
    write_log(url, varied_log())
    print(json.dumps(asyncio.run(rebuild_digests(url)), indent=2, sort_keys=True))
