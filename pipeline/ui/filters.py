"""The episode list's filters, sort and page, parsed from a URL's query string (a deep link), and the
query they make over the ``episodes`` read model. Bad values raise ``BadRequest`` naming the parameter."""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from dataclasses import MISSING, dataclass, field, fields
from functools import cached_property
from typing import Any, Final
from urllib.parse import quote_plus

import sqlalchemy as sa

from pipeline.errors import ConfigError, TurnstileError
from pipeline.log import batches_table, episodes_table
from pipeline.log import trained_batches_table as trained_table
from pipeline.replay import parse_since

TERMINATIONS: Final = ("done", "max_turns", "truncated", "error", "cancelled", "timeout", "aborted")
STATUSES: Final = ("running", "finished")
# sort key -> column; every order ends with episode_id so pages never overlap or skip.
SORTS: Final = {
    "started": episodes_table.c.started_at,
    "finished": episodes_table.c.finished_at,
    "reward": episodes_table.c.reward,
    "turns": episodes_table.c.turns,
    "duration": episodes_table.c.duration_s,
    "tokens": episodes_table.c.completion_tokens,
    "version": episodes_table.c.max_policy_version,
}
PAGE_SIZES: Final = (10, 25, 50, 100, 200)
MAX_PAGE: Final = 10_000
COUNT_CAP: Final = 10_000  # "more than 10,000" rather than counting a million rows on every page
BATCH_PAGE: Final = 50


class BadRequest(TurnstileError):
    """A query parameter the page cannot use (named in the message)."""


@dataclass(frozen=True)
class EpisodeQuery:
    """What the episode list shows: every field is a query parameter of the same name."""

    policy: str | None = None
    agent: str | None = None
    task: str | None = None
    group: str | None = None
    status: str | None = None
    termination: str | None = None
    min_reward: float | None = None
    max_reward: float | None = None
    version: int | None = None
    since: str | None = None
    until: str | None = None
    tag: tuple[str, ...] = field(default_factory=tuple)
    prefix_break: bool = False
    render_drift: bool = False
    errors: bool = False
    sort: str = "started"
    order: str = "desc"
    page: int = 1
    per: int = 50

    def link(self, **changes: Any) -> str:
        """This query (with ``changes``) as a URL query string, defaults left out: a deep link. The list
        makes a few of these per row (sort, task, tags): the query's own parameters are encoded once."""
        unknown = changes.keys() - _FIELD_DEFAULTS.keys()
        if unknown:
            raise TypeError(f"EpisodeQuery has no field {sorted(unknown)[0]!r}")
        parts: list[str] = []
        for name in _FIELD_DEFAULTS:
            parts += _encoded(name, changes[name]) if name in changes else self._encoded[name]
        return "?" + "&".join(parts) if parts else "?"

    @cached_property
    def _encoded(self) -> dict[str, list[str]]:
        return {name: _encoded(name, getattr(self, name)) for name in _FIELD_DEFAULTS}

    @property
    def filtered(self) -> bool:
        return self.link(sort="started", order="desc", page=1, per=50) != "?"


_FIELD_DEFAULTS: Final = {
    f.name: () if f.default_factory is not MISSING else f.default for f in fields(EpisodeQuery)
}


def _encoded(name: str, value: Any) -> list[str]:
    """``name=value`` pairs as ``urlencode`` writes them; none for the default (or no tags)."""
    if value == _FIELD_DEFAULTS[name] or (isinstance(value, tuple) and not value):
        return []
    if isinstance(value, tuple):
        return [f"{name}={quote_plus(item)}" for item in value]
    if isinstance(value, bool):
        return [f"{name}=1"]
    return [f"{name}={quote_plus(str(value))}"]


def _one(params: Mapping[str, Sequence[str]], name: str) -> str | None:
    values = [value.strip() for value in params.get(name, []) if value.strip()]
    if len(values) > 1:
        raise BadRequest(f"{name}: given {len(values)} times ({', '.join(map(repr, values))}); give it once")
    return values[0] if values else None


def _number(params: Mapping[str, Sequence[str]], name: str) -> float | None:
    text = _one(params, name)
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        raise BadRequest(f"{name}: {text!r} is not a number") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise BadRequest(f"{name}: {text!r} is not a finite number")
    return value


def _integer(params: Mapping[str, Sequence[str]], name: str, least: int, most: int) -> int | None:
    text = _one(params, name)
    if text is None:
        return None
    try:
        value = int(text)
    except ValueError:
        raise BadRequest(f"{name}: {text!r} is not a whole number") from None
    if not least <= value <= most:
        raise BadRequest(f"{name}: {value} is out of range ({least} to {most})")
    return value


def _choice(params: Mapping[str, Sequence[str]], name: str, choices: Sequence[str]) -> str | None:
    text = _one(params, name)
    if text is not None and text not in choices:
        raise BadRequest(f"{name}: {text!r} is not one of {', '.join(choices)}")
    return text


def _flag(params: Mapping[str, Sequence[str]], name: str) -> bool:
    text = _one(params, name)
    if text is None:
        return False
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise BadRequest(f"{name}: {text!r} is not a yes/no value (1 or 0)")


def _moment(params: Mapping[str, Sequence[str]], name: str) -> str | None:
    text = _one(params, name)
    if text is not None:
        try:
            parse_since(text)
        except ConfigError:
            raise BadRequest(
                f"{name}: {text!r} is neither a duration ago (30m, 1h, 2d, 1w) nor a date or time "
                "(2026-11-23, 2026-11-23T10:30)"
            ) from None
    return text


def _tags(params: Mapping[str, Sequence[str]]) -> tuple[str, ...]:
    tags = tuple(value.strip() for value in params.get("tag", []) if value.strip())
    for tag in tags:
        key, equals, _ = tag.partition("=")
        if not equals or not key.strip():
            raise BadRequest(f"tag: {tag!r} is not key=value")
    return tags


def parse_query(params: Mapping[str, Sequence[str]]) -> EpisodeQuery:
    """The list's query from a URL's parameters (name -> values); unknown parameters are refused too, so a
    mistyped filter does not silently show everything."""
    known = {f.name for f in fields(EpisodeQuery)}
    unknown = sorted(name for name in params if name not in known)
    if unknown:
        raise BadRequest(f"unknown parameter {unknown[0]!r}: the list takes {', '.join(sorted(known))}")
    min_reward, max_reward = _number(params, "min_reward"), _number(params, "max_reward")
    if min_reward is not None and max_reward is not None and min_reward > max_reward:
        raise BadRequest(f"min_reward {min_reward:g} is more than max_reward {max_reward:g}")
    per = _integer(params, "per", 1, max(PAGE_SIZES))
    return EpisodeQuery(
        policy=_one(params, "policy"),
        agent=_one(params, "agent"),
        task=_one(params, "task"),
        group=_one(params, "group"),
        status=_choice(params, "status", STATUSES),
        termination=_choice(params, "termination", TERMINATIONS),
        min_reward=min_reward,
        max_reward=max_reward,
        version=_integer(params, "version", 0, 2**31 - 1),
        since=_moment(params, "since"),
        until=_moment(params, "until"),
        tag=_tags(params),
        prefix_break=_flag(params, "prefix_break"),
        render_drift=_flag(params, "render_drift"),
        errors=_flag(params, "errors"),
        sort=_choice(params, "sort", tuple(SORTS)) or "started",
        order=_choice(params, "order", ("asc", "desc")) or "desc",
        page=_integer(params, "page", 1, MAX_PAGE) or 1,
        per=per or 50,
    )


# The narrow table under the view ``turns`` (migration 0013): its ``episode`` is the episode's
# ``started_position``. The flags' partial indexes (migration 0012) are on it; going through the view would
# join every episode to find each turn's episode id.
TURN_ROWS: Final = sa.table(
    "turn_rows",
    sa.column("episode", sa.BigInteger),
    sa.column("prefix_break", sa.Boolean),
    sa.column("render_drift", sa.Boolean),
)
# The "errors" filter as migration 0025's partial index ``episodes_errors`` spells it: a literal, not a
# bound parameter, so that the planner can match the index's predicate in every plan.
FAILED: Final = sa.or_(
    episodes_table.c.termination == sa.literal_column("'error'"), episodes_table.c.error.is_not(None)
)


def conditions(query: EpisodeQuery, now: dt.datetime | None = None) -> list[sa.ColumnElement[bool]]:
    e, t = episodes_table, TURN_ROWS
    where: list[sa.ColumnElement[bool]] = []
    for column, value in (
        (e.c.policy, query.policy),
        (e.c.agent, query.agent),
        (e.c.task_id, query.task),
        (e.c.group_id, query.group),
        (e.c.status, query.status),
        (e.c.termination, query.termination),
    ):
        if value is not None:
            where.append(column == value)
    if query.min_reward is not None:
        where.append(e.c.reward >= query.min_reward)
    if query.max_reward is not None:
        where.append(e.c.reward <= query.max_reward)
    if query.version is not None:
        where.append(
            sa.and_(e.c.min_policy_version <= query.version, e.c.max_policy_version >= query.version)
        )
    if query.since is not None:
        where.append(e.c.started_at >= parse_since(query.since, now))
    if query.until is not None:
        where.append(e.c.started_at < parse_since(query.until, now))
    if query.tag:
        tags = dict(tag.partition("=")[::2] for tag in query.tag)
        where.append(e.c.tags.contains(tags))
    # Partial indexes (migration 0012) hold only the turns that broke or drifted: a semi-join over them.
    if query.prefix_break:
        where.append(e.c.started_position.in_(sa.select(t.c.episode).where(t.c.prefix_break)))
    if query.render_drift:
        where.append(e.c.started_position.in_(sa.select(t.c.episode).where(t.c.render_drift)))
    if query.errors:
        where.append(FAILED)
    return where


LIST_COLUMNS: Final = (
    "episode_id",
    "policy",
    "agent",
    "task_id",
    "group_id",
    "tags",
    "status",
    "termination",
    "error",
    "reward",
    "turns",
    "prompt_tokens",
    "completion_tokens",
    "min_policy_version",
    "max_policy_version",
    "started_at",
    "finished_at",
    "duration_s",
)


def page_query(query: EpisodeQuery, now: dt.datetime | None = None) -> sa.Select[Any]:
    """One page of episodes (one row more than a page: whether there is a next one)."""
    e = episodes_table
    column = SORTS[query.sort]
    # Episodes without a value (running, failed) come last largest-first and first smallest-first: either
    # way the order is one index of migration 0012 (col DESC NULLS LAST, episode_id DESC) read forward or
    # backward, never a sort of every matching row.
    ordered = column.asc().nulls_first() if query.order == "asc" else column.desc().nulls_last()
    tiebreak = e.c.episode_id.asc() if query.order == "asc" else e.c.episode_id.desc()
    return (
        sa.select(*(e.c[name] for name in LIST_COLUMNS))
        .where(*conditions(query, now))
        .order_by(ordered, tiebreak)
        .offset((query.page - 1) * query.per)
        .limit(query.per + 1)
    )


def count_query(query: EpisodeQuery, now: dt.datetime | None = None) -> sa.Select[Any]:
    """How many episodes match, counted up to ``COUNT_CAP + 1``."""
    matching = sa.select(sa.literal(1)).select_from(episodes_table).where(*conditions(query, now))
    capped = matching.limit(COUNT_CAP + 1).subquery()
    return sa.select(sa.func.count()).select_from(capped)


def batch_list_query(params: Mapping[str, Sequence[str]]) -> tuple[sa.Select[Any], int, str | None]:
    """The batch list's query (newest first, one row more than a page), its page number and policy, from
    a URL's parameters (``policy``, ``page``)."""
    unknown = sorted(set(params) - {"policy", "page"})
    if unknown:
        raise BadRequest(f"unknown parameter {unknown[0]!r}: the batch list takes policy, page")
    policy = _one(params, "policy")
    number = _integer(params, "page", 1, 100_000) or 1
    b, tb = batches_table, trained_table
    trained = (
        sa.select(
            sa.func.string_agg(
                tb.c.outcome + sa.literal(" → v") + sa.cast(tb.c.policy_version, sa.Text),
                sa.literal(", "),
            )
        )
        .where(tb.c.batch_id == b.c.batch_id)
        .scalar_subquery()
    )
    listing = sa.select(b, trained.label("trained")).order_by(b.c.position.desc(), b.c.batch_id)
    if policy is not None:
        listing = listing.where(b.c.policy == policy)
    return listing.offset((number - 1) * BATCH_PAGE).limit(BATCH_PAGE + 1), number, policy
