"""The state of an episode as a pure fold of its events, and how it ended.

A recorded turn holds what it adds to its parent (``TurnCompleted.prefix_*``); the fold gives whole turns
back (``pipeline.log.turns``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pipeline.errors import TurnstileError
from pipeline.log import (
    UnfoldableTurn,
    conversation,
    expand_turn,
    expand_turns,
    reply_message,
    turn_delta,
    whole_events,
)
from schemas import (
    ChatMessage,
    EpisodeFinished,
    EpisodeStarted,
    Event,
    RewardAssigned,
    Termination,
    TurnCompleted,
)


@dataclass
class Episode:
    """An episode folded from its events (what a reward function and replay see); its turns are whole."""

    started: EpisodeStarted
    turns: list[TurnCompleted] = field(default_factory=list)
    rewards: list[RewardAssigned] = field(default_factory=list)
    finished: EpisodeFinished | None = None

    @property
    def episode_id(self) -> str:
        return self.started.episode_id

    @property
    def task(self) -> dict[str, Any]:
        return self.started.task

    @property
    def messages(self) -> list[ChatMessage]:
        """The last turn's conversation and its reply (the episode's final transcript)."""
        if not self.turns:
            return []
        last = self.turns[-1]
        reply = ChatMessage(
            role="assistant", content=last.reply.text, tool_calls=last.reply.tool_calls or None
        )
        return [*last.request.messages, reply]

    @property
    def total_reward(self) -> float:
        return sum(reward.value for reward in self.rewards)


def fold_episode(events: Sequence[Event]) -> Episode:
    """The state of one episode: a pure function of its events, in stream order."""
    if not events or not isinstance(events[0], EpisodeStarted):
        raise TurnstileError("an episode stream must begin with EpisodeStarted")
    episode = Episode(started=events[0])
    for event in whole_events(events[1:]):
        if isinstance(event, TurnCompleted):
            episode.turns.append(event)
        elif isinstance(event, RewardAssigned):
            episode.rewards.append(event)
        elif isinstance(event, EpisodeFinished):
            episode.finished = event
    return episode


@dataclass(frozen=True, slots=True)
class EpisodeOutcome:
    episode_id: str
    termination: Termination
    reward: float | None
    turns: int
    error: str | None = None
    retry_of: str | None = None

    @classmethod
    def of(cls, episode: Episode) -> EpisodeOutcome:
        """The outcome of a finished episode."""
        if episode.finished is None:
            raise TurnstileError(f"episode {episode.episode_id} is not finished")
        return cls(
            episode_id=episode.episode_id,
            termination=episode.finished.termination,
            reward=episode.total_reward if episode.rewards else None,
            turns=len(episode.turns),
            error=episode.finished.error,
            retry_of=episode.started.retry_of,
        )

    @classmethod
    def of_events(cls, events: Sequence[Event]) -> EpisodeOutcome:
        """The outcome of a finished episode from its events as recorded: no turn is made whole (the fold
        would rebuild every turn's prompt, work that grows with the square of a long episode's length),
        since an outcome needs only the turns' count, the rewards and the end."""
        if not events or not isinstance(events[0], EpisodeStarted):
            raise TurnstileError("an episode stream must begin with EpisodeStarted")
        started = events[0]
        finished = next((event for event in reversed(events) if isinstance(event, EpisodeFinished)), None)
        if finished is None:
            raise TurnstileError(f"episode {started.episode_id} is not finished")
        rewards = [event.value for event in events if isinstance(event, RewardAssigned)]
        return cls(
            episode_id=started.episode_id,
            termination=finished.termination,
            reward=sum(rewards) if rewards else None,
            turns=sum(isinstance(event, TurnCompleted) for event in events),
            error=finished.error,
            retry_of=started.retry_of,
        )


__all__ = [
    "Episode",
    "EpisodeOutcome",
    "UnfoldableTurn",
    "conversation",
    "expand_turn",
    "expand_turns",
    "fold_episode",
    "reply_message",
    "turn_delta",
    "whole_events",
]
