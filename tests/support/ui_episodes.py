"""Episodes for the episode browser's tests, recorded through the event store and materialized: a group of
linear two-turn episodes, a branching episode with two lineages, reasoning and a tool call, a failed one
with a traceback, a running one of another policy, one with a prefix break."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

import httpx

from pipeline.log import EventStore
from pipeline.materialize.config import MaterializerConfig
from pipeline.materialize.writer import Materializer
from schemas import (
    ChatMessage,
    EpisodeFinished,
    EpisodeStarted,
    FunctionCall,
    RewardAssigned,
    SamplingParams,
    Timings,
    ToolCall,
    TurnCompleted,
    TurnReply,
    TurnRequest,
)

AGENT = "tests.ui:MathAgent"
# Likely to unlikely: the shading goes from green to red.
LOGPROBS = [-0.01, -0.2, -0.7, -1.6, -4.0]


@dataclass
class Recorded:
    group: list[str] = field(default_factory=list)
    branching: str = ""
    branching_turns: list[TurnCompleted] = field(default_factory=list)
    failed: str = ""
    running: str = ""
    broken: str = ""


@dataclass
class Browsing:
    """The browser app over httpx (in process, as the reader login) and the episodes recorded for it."""

    client: httpx.AsyncClient
    recorded: Recorded


def make_turn(
    messages: list[ChatMessage],
    *,
    text: str,
    parent: TurnCompleted | None = None,
    new_ids: int = 6,
    version: int = 0,
    reasoning: str | None = None,
    tool_calls: list[ToolCall] | None = None,
    prefix_break: bool = False,
    seed: int = 0,
) -> TurnCompleted:
    """A turn whose prompt extends its parent's exact tokens (the materializer's tree is by token prefix)."""
    base = [] if parent is None else [*parent.prompt_token_ids, *parent.completion_token_ids]
    prompt = [*base, *(100 + (seed * 7 + i) % 800 for i in range(new_ids))]
    completion = [10 + (seed * 3 + i) % 500 for i in range(len(LOGPROBS))]
    return TurnCompleted(
        parent_turn_id=None if parent is None else parent.turn_id,
        request=TurnRequest(messages=messages),
        reply=TurnReply(
            text=text,
            tool_calls=tool_calls or [],
            finish_reason="tool_calls" if tool_calls else "stop",
            reasoning=reasoning,
        ),
        prompt_token_ids=prompt,
        completion_token_ids=completion,
        completion_logprobs=LOGPROBS,
        policy_version=version,
        engine_id="engine-ui-test",
        timings=Timings(queued_ms=0.5, first_token_ms=2.0, total_ms=12.5),
        prefix_break=prefix_break,
    )


def _reply(turn: TurnCompleted) -> ChatMessage:
    return ChatMessage(role="assistant", content=turn.reply.text, tool_calls=turn.reply.tool_calls or None)


async def record_episodes(store: EventStore, *, batch_samples: int = 4) -> Recorded:
    """Records the episodes and runs the materializer over them (read models, samples and batches)."""
    recorded = Recorded()
    system = ChatMessage(role="system", content="You are a careful assistant.")
    for slot, reward in enumerate((0.0, 0.5, 1.0, 1.0)):
        episode_id = f"group{slot}-{uuid.uuid4().hex[:20]}"
        first_messages = [system, ChatMessage(role="user", content=f"What is {slot} + 2?")]
        first = make_turn(
            first_messages, text=f"Let me think about {slot} + 2.", version=slot // 2, seed=slot
        )
        second_messages = [
            *first_messages,
            _reply(first),
            ChatMessage(role="user", content="And the answer?"),
        ]
        second = make_turn(
            second_messages, text=str(slot + 2), parent=first, version=slot // 2, seed=slot + 9
        )
        events = [
            EpisodeStarted(
                episode_id=episode_id, task_id="arith-1", task={"question": f"{slot} + 2"},
                group_id="g-arith", group_size=4, agent=AGENT, policy="main",
                tags={"split": "train" if slot < 3 else "eval"},
            ),
            first,
            second,
            RewardAssigned(value=reward, source="test"),
            EpisodeFinished(termination="done", metrics={"duration_s": 0.25 + slot}),
        ]  # fmt: skip
        await store.append(f"episode-{episode_id}", events, expected_version=0)
        recorded.group.append(episode_id)

    # Branching: root A; B and C both continue A (two branches); D is a second root (a side call).
    episode_id = f"branchy-{uuid.uuid4().hex[:20]}"
    question = [system, ChatMessage(role="user", content="Compute 17 * 3 with the tool.")]
    call = ToolCall(
        id="call_ui_1", function=FunctionCall(name="calculate", arguments='{"expression": "17 * 3"}')
    )
    a = make_turn(
        question, text="", reasoning="I should use the calculator tool.", tool_calls=[call], seed=21
    )
    after_tool = [
        *question,
        _reply(a),
        ChatMessage(role="tool", name="calculate", tool_call_id="call_ui_1", content="51"),
    ]
    b = make_turn(after_tool, text="The answer is 51.", parent=a, seed=22)
    c = make_turn(after_tool, text="17 * 3 = 51, so 51.", parent=a, seed=23)
    d = make_turn(
        [ChatMessage(role="user", content="Summarize: the user asked for 17 * 3.")],
        text="A product.",
        seed=24,
    )
    recorded.branching_turns = [a, b, c, d]
    await store.append(
        f"episode-{episode_id}",
        [
            EpisodeStarted(episode_id=episode_id, task_id="tool-1", agent=AGENT, policy="main",
                           group_id="g-branch", group_size=1),
            a, b, c, d,
            RewardAssigned(value=1.0, source="test"),
            EpisodeFinished(termination="done"),
        ],
        expected_version=0,
    )  # fmt: skip
    recorded.branching = episode_id

    episode_id = f"failed-{uuid.uuid4().hex[:20]}"
    await store.append(
        f"episode-{episode_id}",
        [
            EpisodeStarted(episode_id=episode_id, task_id="arith-2", agent=AGENT, policy="main"),
            make_turn(
                [ChatMessage(role="user", content="What is 1 / 0?")], text="Division by zero.", seed=31
            ),
            EpisodeFinished(
                termination="error",
                error='Traceback (most recent call last):\n  File "agent.py", line 3, in run\n'
                "ZeroDivisionError: division by zero",
            ),
        ],
        expected_version=0,
    )
    recorded.failed = episode_id

    episode_id = f"broken-{uuid.uuid4().hex[:20]}"
    first = make_turn([ChatMessage(role="user", content="Hello")], text="Hi.", seed=41)
    again = [
        ChatMessage(role="user", content="Hello"),
        _reply(first),
        ChatMessage(role="user", content="Again"),
    ]
    second = make_turn(again, text="Hi again.", parent=first, prefix_break=True, seed=42)
    await store.append(
        f"episode-{episode_id}",
        [
            EpisodeStarted(
                episode_id=episode_id, task_id="greet-1", agent="tests.ui:GreetAgent", policy="main"
            ),
            first,
            second,
            EpisodeFinished(termination="done"),
        ],
        expected_version=0,
    )
    recorded.broken = episode_id

    episode_id = f"running-{uuid.uuid4().hex[:20]}"
    await store.append(
        f"episode-{episode_id}",
        [
            EpisodeStarted(episode_id=episode_id, task_id="arith-3", agent=AGENT, policy="other"),
            make_turn([ChatMessage(role="user", content="Still thinking")], text="...", seed=51),
        ],
        expected_version=0,
    )
    recorded.running = episode_id

    materializer = Materializer(store.libpq_url, MaterializerConfig(batch_samples=batch_samples))
    await materializer.open()
    try:
        await materializer.catch_up()
    finally:
        await materializer.close()
    return recorded


def _counting_turn(messages: list[ChatMessage], text: str) -> TurnCompleted:
    return TurnCompleted(
        request=TurnRequest(messages=messages, sampling=SamplingParams(max_tokens=8)),
        reply=TurnReply(text=text, finish_reason="stop"),
        prompt_token_ids=[1, 2],
        completion_token_ids=[3],
        completion_logprobs=[-0.5],
        policy_version=0,
        engine_id="e",
    )


async def record_counting_episode(
    store: EventStore,
    episode_id: str = "counting-1",
    agent: str = "tests.support.replay_agents:CountingAgent",
) -> list[TurnCompleted]:
    """``tests.support.replay_agents:CountingAgent``'s three turns as it asks for them (not materialized): a
    rerun of it is identical, and ``RewordedCountingAgent`` diverges at turn 2. ``agent``: the agent the
    episode records (``gateway``: as a gateway session records it)."""
    started = EpisodeStarted(episode_id=episode_id, task={"id": 7}, task_id="7", agent=agent, policy="p")
    turns = [_counting_turn([ChatMessage(role="user", content="task 7: count to three")], "one")]
    for n in (2, 3):
        previous = turns[-1]
        reply = ChatMessage(role="assistant", content=previous.reply.text)
        follow_up = ChatMessage(role="user", content=f"now say {n}")
        turns.append(_counting_turn([*previous.request.messages, reply, follow_up], f"say {n}"))
    events = [started, *turns, RewardAssigned(value=1.0), EpisodeFinished(termination="done")]
    await store.append(f"episode-{episode_id}", events, expected_version=0)
    return turns
