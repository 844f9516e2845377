"""The episodes of the version-1 fixture log, recorded through the public session API only.

``tests/support/legacy/v1_log.jsonl`` was written by this scenario on the code of commit bd0af96 (every turn
stored whole, ``TurnCompleted`` schema version 1), with ``tests/support/legacy/v1_expected.json`` (what that
code folded and sampled from it):

    git worktree add --detach /tmp/v1 bd0af96 && mkdir -p /tmp/v1/tests/support/legacy
    cp tests/support/legacy/scenario.py tests/support/legacy/__init__.py /tmp/v1/tests/support/legacy/
    cd /tmp/v1 && python -S -c "import sys; sys.path[:0] = ['/tmp/v1', '<venv>/lib/python3.11/site-packages']
    import asyncio, pathlib; from tests.support.legacy.scenario import write
    asyncio.run(write(pathlib.Path('<repo>/tests/support/legacy')))"

(``-S``: the virtualenv's editable install of today's code would otherwise shadow the old tree.)

The fixture stays in the tests for good: a log written by the old code must fold, replay, materialize and
answer SQL exactly as before. The tests run the same scenario on today's code (turns recorded as deltas) and
compare both logs.
"""

from __future__ import annotations

import asyncio
import base64
import json
import sys
from pathlib import Path
from typing import Any

from pipeline.episodes import EpisodeSession, fold_episode
from pipeline.log import InMemoryStore
from pipeline.log.appends import encode_event
from pipeline.materialize.trajectory import (
    Turn,
    concat_samples,
    discounted_rewards,
    individual_samples,
    parents,
)
from schemas import ChatMessage, LLMRequest, LLMResponse

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "calculate",
            "description": "evaluate an arithmetic expression",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "z": 1,
                "a": 2,
            },
        },
    }
]
DISCOUNT = 0.9


class Echo:
    """Prompt: the prefix's ids, then one id per new message; completion ids from the turn's number."""

    def __init__(self) -> None:
        self.calls = 0

    async def __call__(self, request: LLMRequest) -> LLMResponse:
        self.calls += 1
        prefix = list(request.prefix.token_ids or []) if request.prefix else []
        skipped = request.prefix.message_count if request.prefix else 0
        new = [100 + len(message.content or "") for message in request.messages[skipped:]]
        completion = [500 + self.calls, 7, 2]
        reasoning = "let me think" if self.calls % 2 else None
        return LLMResponse(
            request_id=request.request_id,
            text=f"reply {self.calls}",
            finish_reason="stop",
            reasoning=reasoning,
            prompt_token_ids=prefix + new,
            completion_token_ids=completion,
            completion_logprobs=[-0.25, -0.5, -0.125],
            policy_version=3,
            consumer_id="in-process",
        )


async def record(store: InMemoryStore) -> list[str]:
    """Three episodes of one group: a tool conversation, one that branches (an edited history starts a new
    root), one whose agent drops the reasoning it got back. Returns their ids."""
    ids = []
    for n in range(3):
        session = EpisodeSession(
            store, Echo(), policy="legacy", task={"n": n}, task_id=f"t{n}", agent="legacy",
            episode_id=f"legacy-{n}", group_id="legacy-group", group_size=3,
        )  # fmt: skip
        await session.start()
        messages: list[Any] = [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": f"go {n}"},
        ]
        for k in range(4):
            reply = await session.chat(messages, tools=TOOLS)
            sent = reply.message if n != 2 else reply.message.model_copy(update={"reasoning_content": None})
            messages = [*messages, sent, ChatMessage(role="tool", content=str(k * 7), tool_call_id=f"c{k}")]
            if n == 1 and k == 1:
                await session.chat([*messages[:2], {"role": "assistant", "content": "edited"}, messages[-1]])
        await session.reward(0.5 * n, reply.turn_id)
        await session.reward(1.0)
        await session.finish("done")
        ids.append(session.episode_id)
    return ids


def expected(store_events: dict[str, list[Any]]) -> dict[str, Any]:
    """What the code folds and samples from each episode (whole turns; samples with DISCOUNT)."""
    out: dict[str, Any] = {}
    for episode_id, events in store_events.items():
        episode = fold_episode(events)
        own = {t.turn_id: 0.0 for t in episode.turns}
        for reward in episode.rewards:
            own[reward.turn_id or episode.turns[-1].turn_id] += reward.value
        turns = [
            Turn.from_event(t, episode_id=episode_id, index=i, reward=own[t.turn_id])
            for i, t in enumerate(episode.turns)
        ]
        tree = parents(turns)
        values = discounted_rewards(turns, tree, DISCOUNT)
        index = {t.turn_id: i for i, t in enumerate(turns)}

        def arrays(samples: Any, index: dict[Any, int] = index) -> list[dict[str, Any]]:
            return [
                {
                    "turns": [index[t] for t in s.turn_ids],
                    "input_ids": list(s.input_ids),
                    "loss_mask": list(s.loss_mask),
                    "logprobs": list(s.logprobs),
                    "reward": s.reward,
                }
                for s in samples
            ]

        out[episode_id] = {
            "turns": [
                {
                    "parent": index.get(t.parent_turn_id) if t.parent_turn_id else None,
                    "messages": [m.model_dump(mode="json") for m in t.request.messages],
                    "tools": [tool.model_dump(mode="json") for tool in t.request.tools],
                    "prompt_token_ids": t.prompt_token_ids,
                    "completion_token_ids": t.completion_token_ids,
                    "reply": t.reply.model_dump(mode="json"),
                }
                for t in episode.turns
            ],
            "tree": [index[p] if p else None for p in (tree[t.turn_id] for t in turns)],
            "individual": arrays(individual_samples(turns, values)),
            "concat": arrays(concat_samples(turns, tree, values)),
        }
    return out


async def write(directory: Path) -> None:
    store = InMemoryStore()
    ids = await record(store)
    rows, by_episode = [], {}
    for episode_id in ids:
        recorded = await store.read_stream(f"episode-{episode_id}")
        by_episode[episode_id] = [r.event for r in recorded]
        for r in recorded:
            encoded = encode_event(r.event)  # type: ignore[arg-type]
            rows.append(
                {
                    "stream": r.stream,
                    "event_id": str(encoded.event_id),
                    "type": encoded.type,
                    "data": encoded.data,
                    "tokens": base64.b64encode(encoded.tokens).decode() if encoded.tokens else None,
                }
            )
    (directory / "v1_log.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (directory / "v1_expected.json").write_text(json.dumps(expected(by_episode), indent=1) + "\n")


if __name__ == "__main__":
    asyncio.run(write(Path(sys.argv[1])))
