"""Free-text search over what turns say (``/search?q=...``): the messages a turn adds and its reply, through
the read model ``turn_search`` (migration 0023: each turn's ``turnstile_turn_text(data)``, GIN-indexed,
written by the live materializer, so appends to the log never pay for it), newest first, a page at a time by
log position (keyset: never an OFFSET over every match). A turn is found once the materializer's tail has
passed it (migration 0024): seconds behind the log, while its episode still runs.

The query is PostgreSQL's web search syntax (``websearch_to_tsquery``: words, "a phrase", ``or``,
``-word``) with the ``simple`` configuration: whole words, no stemming. A rare word is found through the
index; a common one by reading the log backwards until a page is full. A search that takes longer than
``SEARCH_TIMEOUT_MS`` stops with a page that says so.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import psycopg
import sqlalchemy as sa
import sqlalchemy.exc
from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse
from sqlalchemy.ext.asyncio import AsyncConnection

from pipeline.ui.browser import Browser, Page, query_params
from pipeline.ui.filters import BadRequest

SEARCH_PAGE: Final = 50
SEARCH_TIMEOUT_MS: Final = 5_000
MAX_QUERY: Final = 500
SNIPPET: Final = 90  # characters either side of the first match

# The words come from turn_search (its GIN index for a rare word, its key backwards for a common one); the
# event, for the snippet and the time, by its position.
SEARCH: Final = f"""
    SELECT s.position, s.episode_id, e.data, e.recorded_at
    FROM turn_search s JOIN events e ON e.position = s.position
    WHERE s.words @@ websearch_to_tsquery('simple', :q)
      AND s.position < :before
    ORDER BY s.position DESC
    LIMIT {SEARCH_PAGE + 1}
"""


@dataclass(frozen=True)
class Hit:
    """One turn that matched: where it is, and its first match in context."""

    position: int
    episode_id: str
    turn_id: str
    recorded_at: Any
    before: str
    match: str
    after: str


def parse_search(params: Mapping[str, Sequence[str]]) -> tuple[str, int | None]:
    """The search's words and the position to continue before (a page's last hit), from the URL."""
    unknown = sorted(set(params) - {"q", "before"})
    if unknown:
        raise BadRequest(f"unknown parameter {unknown[0]!r}: the search takes q (words) and before")
    words = " ".join(value.strip() for value in params.get("q", []) if value.strip())
    if len(words) > MAX_QUERY:
        raise BadRequest(f"q: {len(words)} characters; a search takes at most {MAX_QUERY}")
    before_text = (params.get("before") or [""])[0].strip()
    if before_text and not before_text.isdigit():
        raise BadRequest(f"before: {before_text!r} is not a log position (a whole number)")
    return words, int(before_text) if before_text else None


def turn_text(data: Mapping[str, Any]) -> str:
    """What turnstile_turn_text reads of a turn's event data, as one text (for the snippet)."""
    request, reply = data.get("request") or {}, data.get("reply") or {}
    parts = [str(m.get("content")) for m in request.get("messages") or [] if m.get("content")]
    parts += [str(reply[key]) for key in ("text", "reasoning") if reply.get(key)]
    calls = reply.get("tool_calls") or []
    parts += [str((call.get("function") or {}).get("arguments", "")) for call in calls]
    return "\n".join(parts)


def snippet(text: str, words: str) -> tuple[str, str, str]:
    """The text around the first whole-word match of any searched word: (before, match, after)."""
    terms = [term for term in re.findall(r"\w+", words.lower()) if term != "or"]
    found = None
    for term in terms:
        hit = re.search(rf"(?<!\w){re.escape(term)}(?!\w)", text, re.IGNORECASE)
        if hit and (found is None or hit.start() < found.start()):
            found = hit
    if found is None:
        return text[: 2 * SNIPPET], "", ""
    start, end = max(found.start() - SNIPPET, 0), found.end() + SNIPPET
    lead = "\u2026" if start > 0 else ""
    tail = "\u2026" if end < len(text) else ""
    return lead + text[start : found.start()], found.group(), text[found.end() : end] + tail


async def search_turns(connection: AsyncConnection, words: str, before: int | None) -> list[Hit] | None:
    """A page of matching turns, newest first, plus one (whether there is a next page); None when the
    search ran past ``SEARCH_TIMEOUT_MS``."""
    try:
        # SET LOCAL: this transaction only (the connection goes back to the pool when it ends).
        await connection.execute(sa.text(f"SET LOCAL statement_timeout = {SEARCH_TIMEOUT_MS}"))
        found = await connection.execute(sa.text(SEARCH), {"q": words, "before": before or 2**63 - 1})
        rows = found.mappings().all()
    except sqlalchemy.exc.DBAPIError as error:
        if isinstance(error.orig, psycopg.errors.QueryCanceled):
            return None
        raise
    hits = []
    for row in rows:
        data = row["data"]
        before_text, match, after = snippet(turn_text(data), words)
        hits.append(
            Hit(row["position"], row["episode_id"], str(data.get("turn_id")), row["recorded_at"],
                before_text, match, after)
        )  # fmt: skip
    return hits


def search_router(browser: Browser, page: Page) -> APIRouter:
    """The search page: a form, and a page of matching turns with links to them."""
    router = APIRouter()

    @router.get("/search", response_class=HTMLResponse)
    async def search(request: Request) -> HTMLResponse:
        words, before = parse_search(query_params(request))
        hits: list[Hit] | None = []
        if words:
            engine, _ = await browser.open()
            async with engine.connect() as connection:
                hits = await search_turns(connection, words, before)
        more = hits is not None and len(hits) > SEARCH_PAGE
        shown = None if hits is None else hits[:SEARCH_PAGE]
        return page(
            request, "search.html", words=words, hits=shown, more=more, timeout_ms=SEARCH_TIMEOUT_MS,
            next_before=shown[-1].position if more and shown else None, first_page=before is None,
        )  # fmt: skip

    return router
