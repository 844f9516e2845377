"""The fold's checks of an event's fields: a value the read models cannot hold makes it ``Unfoldable``."""

from __future__ import annotations

import math
import re
import uuid
from typing import Any, Final

from pipeline.materialize.records import LogRow

INT4_MAX: Final = 2**31 - 1
_UUID_TEXT = re.compile(r"[0-9a-fA-F]{8}-(?:[0-9a-fA-F]{4}-){3}[0-9a-fA-F]{12}\Z")
"""A uuid as PostgreSQL's ``::uuid`` and Python's ``uuid.UUID`` both read it (the view ``turns`` casts it)."""


class Unfoldable(Exception):
    """A recorded event the fold cannot use (``row``), and why; the fold skips it and goes on."""

    def __init__(self, row: LogRow, reason: str) -> None:
        super().__init__(reason)
        self.row = row
        self.reason = reason


def culprit(error: BaseException, row: LogRow) -> tuple[LogRow, str]:
    """The event to skip for ``error`` (raised while folding ``row``), and why."""
    if isinstance(error, Unfoldable):
        return error.row, error.reason
    return row, f"{type(error).__name__}: {error}"


UNFOLDABLE: Final = (Unfoldable, KeyError, ValueError, TypeError, IndexError, AttributeError, OverflowError)
"""What reading a malformed event raises (a missing field, a wrong type, torn token arrays): the fold skips
that event, never stops on it. Every event is validated when appended, so this is for what slipped past."""


def check_event_fields(event: LogRow) -> None:
    """The fields the view ``turns`` reads from the event itself (``events.data``) must be what its casts
    take: a turn whose fields would break them is not folded (it never reaches ``turn_rows``)."""
    data = event.data
    recorded_parent = data.get("parent_turn_id")
    if recorded_parent is not None and (
        not isinstance(recorded_parent, str) or _UUID_TEXT.match(recorded_parent) is None
    ):
        raise ValueError(f"its parent_turn_id {recorded_parent!r} is not a uuid")
    timings = data.get("timings", {})
    for name in ("queued_ms", "first_token_ms", "total_ms", "restarted_ms"):
        value = timings.get(name, 0.0)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"its timings.{name} is {value!r}, not a number")
    tool_calls = data["reply"].get("tool_calls")
    if tool_calls is not None and not isinstance(tool_calls, list):
        raise ValueError(f"its reply.tool_calls is {tool_calls!r}, not a list")
    text_of(event, "chat_template", None)


def unless(value: Any, same: Any) -> Any:
    """``value``, or None where it equals ``same`` (a column the view then reads from elsewhere)."""
    return None if value == same else value


def to_uuid(value: Any) -> uuid.UUID:
    return value if isinstance(value, uuid.UUID) else uuid.UUID(str(value))


_REQUIRED: Final = object()


def text_of(row: LogRow, name: str, default: Any = _REQUIRED) -> Any:
    """The string field ``name`` of ``row`` (or ``default`` when absent or null), or ``Unfoldable``."""
    value = row.data.get(name)
    if value is None and default is not _REQUIRED:
        return default
    if not isinstance(value, str):
        raise Unfoldable(row, f"its {name} is {value!r}, not a string")
    return value


def count_of(row: LogRow, value: Any, name: str, *, least: int = 0) -> int:
    """An integer field that must fit the read models' integer columns, or ``Unfoldable``."""
    if isinstance(value, bool) or not isinstance(value, int) or not least <= value <= INT4_MAX:
        raise Unfoldable(row, f"its {name} is {value!r}, not an integer in [{least}, {INT4_MAX}]")
    return value


def reward_of(row: LogRow) -> float:
    value = row.data.get("value")
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise Unfoldable(row, f"its value is {value!r}, not a finite number")
    return float(value)
