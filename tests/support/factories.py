"""Small builders of valid events for tests."""

from __future__ import annotations

import random
import uuid

from schemas import (
    ChatMessage,
    EpisodeFinished,
    EpisodeStarted,
    Event,
    RewardAssigned,
    TurnCompleted,
    TurnReply,
    TurnRequest,
)


def new_stream() -> str:
    """A fresh episode stream; start it with ``started_in(stream)``."""
    return f"episode-{uuid.uuid4().hex}"


def started(episode_id: str | None = None, **overrides: object) -> EpisodeStarted:
    """The start of episode ``episode_id`` (a fresh id if none), which belongs in ``episode-<episode_id>``:
    the log refuses it in any other stream, so two streams never share an episode."""
    fields: dict[str, object] = {
        "episode_id": episode_id or uuid.uuid4().hex,
        "task_id": "t1",
        "agent": "tests:Agent",
        "policy": "main",
    }
    return EpisodeStarted.model_validate({**fields, **overrides})


def started_in(stream: str, **overrides: object) -> EpisodeStarted:
    """The start of the episode whose stream is ``stream`` (``episode-<id>``)."""
    return started(stream.removeprefix("episode-"), **overrides)


def opened(*more: Event, **overrides: object) -> tuple[str, list[Event]]:
    """A fresh episode stream and the events that open it (its start, then ``more``): the arguments of an
    append, ``store.append(*opened(turn()), 0)``."""
    stream = new_stream()
    return stream, [started_in(stream, **overrides), *more]


def turn(
    content: str = "What is 2+2?", *, seed: int = 0, prompt_len: int = 12, completion_len: int = 5
) -> TurnCompleted:
    rng = random.Random(seed)
    return TurnCompleted(
        request=TurnRequest(messages=[ChatMessage(role="user", content=content)]),
        reply=TurnReply(text="4", finish_reason="stop"),
        prompt_token_ids=[rng.randrange(1000) for _ in range(prompt_len)],
        completion_token_ids=[rng.randrange(1000) for _ in range(completion_len)],
        completion_logprobs=[-rng.random() * 5 for _ in range(completion_len)],
        policy_version=0,
        engine_id="test-engine",
    )


def reward(value: float = 1.0) -> RewardAssigned:
    return RewardAssigned(value=value, source="test")


def finished() -> EpisodeFinished:
    return EpisodeFinished(termination="done", metrics={"turns": 1.0})
