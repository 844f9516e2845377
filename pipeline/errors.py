"""One error root for everything Turnstile raises on purpose; messages say what was wrong and what to do."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # a type only: the learner imports these errors on GPU machines without pydantic
    from pydantic import ValidationError


class TurnstileError(Exception):
    """Root of Turnstile's own errors."""


class ConfigError(TurnstileError):
    """A setting is missing or wrong."""


class InvalidEvent(TurnstileError, ValueError):
    """An event was refused at the boundary; nothing of its append was recorded."""


class WrongExpectedVersion(TurnstileError):
    """The stream moved on (or does not exist yet) since the appender last read it."""

    def __init__(self, stream: str, expected: int, actual: int) -> None:
        self.stream, self.expected, self.actual = stream, expected, actual
        super().__init__(
            f"wrong expected version for stream {stream!r}: expected {expected}, actual {actual}; "
            "read the stream again and decide whether to append"
        )


class EpisodeExists(WrongExpectedVersion):
    """An episode was started with an id the log already holds: its stream, ``episode-<id>``, has events."""

    def __init__(self, episode_id: str, stream: str, actual: int) -> None:
        self.stream, self.expected, self.actual, self.episode_id = stream, 0, actual, episode_id
        TurnstileError.__init__(  # not WrongExpectedVersion's message: this one names the episode
            self,
            f"episode {episode_id!r} already exists: stream {stream!r} holds it ({actual} events); an "
            "episode id names one stream, so choose a new episode_id (or leave it out for a fresh one)",
        )


class DuplicateEventConflict(TurnstileError):
    """An event id is already recorded with other content (or in another stream)."""


class StoreUnavailable(TurnstileError):
    """PostgreSQL could not be reached for longer than the store is willing to retry."""


def field_path(location: tuple[int | str, ...]) -> str:
    """``messages.0.role`` for a pydantic error location (validator wrappers left out)."""
    return ".".join(str(part) for part in location if not str(part).startswith("function-"))


def describe_validation_error(error: ValidationError, limit: int = 5) -> str:
    """``field a.b.0: message; ...`` for the first few problems of a pydantic error."""
    parts = []
    for item in error.errors()[:limit]:
        parts.append(f"field {field_path(item['loc']) or '<root>'}: {item['msg']}")
    more = len(error.errors()) - limit
    if more > 0:
        parts.append(f"and {more} more")
    return "; ".join(parts)
