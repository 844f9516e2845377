"""Finding an episode in the log by its id (or a prefix of it) and folding it, whole or as of a turn
(time travel); per-turn values with the materializer's semantics; an episode as JSON."""

from __future__ import annotations

import datetime as dt
import re
import statistics
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final, cast

from rich.markup import escape

from pipeline.episodes import Episode, episode_stream, fold_episode
from pipeline.errors import ConfigError, TurnstileError
from pipeline.log import RecordedEvent, Store
from pipeline.materialize import Turn, discounted_rewards, parents
from schemas import (
    EpisodeFinished,
    Event,
    TurnCompleted,
    TurnDelivered,
)

EPISODE_ID_PATTERN: Final = re.compile(r"^[A-Za-z0-9._:-]{1,200}$")
MAX_CANDIDATES: Final = 10


class EpisodeNotFound(TurnstileError):
    """No episode in the log has that id (or an id beginning with it)."""


class UnreadableEpisode(TurnstileError):
    """The episode holds a recorded event that does not parse; a replay of it would not be the episode."""


class AmbiguousEpisodeId(TurnstileError):
    """Several episodes' ids begin with the given text."""

    def __init__(self, prefix: str, candidates: Sequence[str], more: bool) -> None:
        self.prefix, self.candidates = prefix, list(candidates)
        listed = "\n".join(f"  {candidate}" for candidate in candidates)
        super().__init__(
            f"episode id {prefix!r} is ambiguous: it begins {'more than ' if more else ''}"
            f"{len(candidates)} episode ids:\n{listed}{chr(10) + '  ...' if more else ''}\n"
            "give more of the id"
        )


# -- finding and folding episodes -----------------------------------------------------------------------


async def resolve_episode_id(store: Store, text: str) -> str:
    """The id of the one episode whose id is ``text`` or begins with it (EpisodeStarted rows of the log)."""
    if not EPISODE_ID_PATTERN.match(text):
        raise ConfigError(
            f"{escape(repr(text))} is not an episode id: ids are letters, digits and . _ : - "
            "(list episodes with `turnstile episodes`)"
        )
    ids = await store.find_episode_ids(text, MAX_CANDIDATES + 1)
    if not ids:
        raise EpisodeNotFound(
            f"no episode {text!r} in the log (no episode id is or begins with it); "
            "list episodes with `turnstile episodes`"
        )
    if len(ids) > 1:
        raise AmbiguousEpisodeId(text, ids[:MAX_CANDIDATES], more=len(ids) > MAX_CANDIDATES)
    return ids[0]


@dataclass(frozen=True)
class ReplayedEpisode:
    """An episode folded from the log, with the envelopes of its events; cut after turn ``until`` if set."""

    episode: Episode
    events: list[RecordedEvent]
    recorded_turns: int
    until: int | None = None

    @property
    def finished(self) -> EpisodeFinished | None:
        return self.episode.finished

    @property
    def delivered_later(self) -> set[uuid.UUID]:
        """Turns a ``TurnDelivered`` names: recorded before their reply was handed over, then handed."""
        return {
            turn_id
            for record in self.events
            if isinstance(record.event, TurnDelivered)
            for turn_id in record.event.turn_ids
        }

    @property
    def status(self) -> str:
        if self.until is not None:
            return f"running as of turn {self.until} ({self.recorded_turns} recorded)"
        if self.finished is None:
            return "running"
        return f"finished: {self.finished.termination}"

    def recorded_at(self, event: Event) -> dt.datetime | None:
        for recorded in self.events:
            if recorded.event_id == event.event_id:
                return recorded.recorded_at
        return None


async def load_episode(store: Store, episode_id: str, *, until: int | None = None) -> ReplayedEpisode:
    """The fold of the episode's events, or of those up to and including its turn ``until`` (1-based)."""
    everything = await store.read_stream(episode_stream(episode_id))
    unreadable = [r.problem for r in everything if r.problem is not None]
    if unreadable:
        raise UnreadableEpisode(
            f"episode {episode_id} cannot be replayed: {'; '.join(unreadable)} (the materializer skips such "
            "events too: SELECT * FROM skipped_events)"
        )
    recorded = [r for r in everything if r.event is not None]
    if not recorded:
        raise EpisodeNotFound(f"no episode {episode_id!r} in the log")
    turn_rows = [i for i, r in enumerate(recorded) if isinstance(r.event, TurnCompleted)]
    if until is not None:
        if until < 1:
            raise ConfigError(f"--until counts turns from 1, got {until}")
        if until > len(turn_rows):
            raise ConfigError(
                f"--until {until}: episode {episode_id} has {len(turn_rows)} recorded "
                f"turn{'' if len(turn_rows) == 1 else 's'}"
            )
        recorded = recorded[: turn_rows[until - 1] + 1]
    episode = fold_episode([cast(Event, r.event) for r in recorded])
    return ReplayedEpisode(episode, recorded, recorded_turns=len(turn_rows), until=until)


@dataclass(frozen=True)
class TurnValues:
    """Per turn (in order): its own reward and its discounted return (None when the tokens do not allow)."""

    rewards: list[float]
    returns: list[float] | None


def turn_values(episode: Episode, discount: float) -> TurnValues:
    """Each turn's reward (an episode reward goes to its last turn, as in the materializer) and its
    discounted return over the token-prefix tree of ``pipeline.materialize.trajectory``."""
    own = {turn.turn_id: 0.0 for turn in episode.turns}
    for reward in episode.rewards:
        target = reward.turn_id
        if target is None and episode.turns:
            target = episode.turns[-1].turn_id
        if target in own:
            own[target] += reward.value
    rewards = [own[turn.turn_id] for turn in episode.turns]
    try:
        turns = [
            Turn.from_event(turn, episode_id=episode.episode_id, index=index, reward=own[turn.turn_id])
            for index, turn in enumerate(episode.turns)
        ]
    except ValueError:  # a turn whose logprobs do not match its tokens; the materializer refuses it too
        return TurnValues(rewards, None)
    values = discounted_rewards(turns, parents(turns), discount)
    return TurnValues(rewards, [values[turn.turn_id] for turn in turns])


def mean_logprob(turn: TurnCompleted) -> float | None:
    return statistics.fmean(turn.completion_logprobs) if turn.completion_logprobs else None


def episode_json(replayed: ReplayedEpisode, discount: float) -> dict[str, Any]:
    """The whole folded episode as JSON: every event's fields, plus per-turn reward, return and times."""
    episode = replayed.episode
    values = turn_values(episode, discount)
    turns = []
    for index, turn in enumerate(episode.turns):
        recorded_at = replayed.recorded_at(turn)
        turns.append(
            {
                "index": index + 1,
                **turn.model_dump(mode="json"),
                "reward": values.rewards[index],
                "discounted_return": None if values.returns is None else values.returns[index],
                "mean_logprob": mean_logprob(turn),
                "recorded_at": recorded_at.isoformat() if recorded_at else None,
            }
        )
    started_at = replayed.recorded_at(episode.started)
    return {
        "episode_id": episode.episode_id,
        "status": "running" if episode.finished is None else "finished",
        "until": replayed.until,
        "recorded_turns": replayed.recorded_turns,
        "discount": discount,
        "started_at": started_at.isoformat() if started_at else None,
        "started": episode.started.model_dump(mode="json"),
        "turns": turns,
        "rewards": [reward.model_dump(mode="json") for reward in episode.rewards],
        "total_reward": episode.total_reward if episode.rewards else None,
        "finished": None if episode.finished is None else episode.finished.model_dump(mode="json"),
    }
