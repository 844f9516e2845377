"""The browser's pages as JSON (``/api/...``), for scripts and notebooks: the same filters, pages and
errors as the HTML, read the same way (read-only, as the reader role).

- ``/api/episodes?FILTERS``: a page of the episode list (the list's parameters), and the next page's URL;
- ``/api/episodes/ID``: one episode whole, as ``turnstile replay --json`` gives it (every turn with its
  messages, reply, token ids and logprobs, reward, discounted return), plus its read-model row;
- ``/api/runs``, ``/api/runs/POLICY``: the runs' figures; ``/api/batches?policy=&page=``: a page of batches;
- ``/api/search?q=WORDS&before=POSITION``: a page of matching turns.
"""

from __future__ import annotations

import datetime as dt
import decimal
import json
import math
import uuid
from collections.abc import Mapping
from typing import Any

import sqlalchemy as sa
from fastapi import APIRouter, Request
from fastapi.responses import Response

from pipeline.log import episodes_table
from pipeline.replay import episode_json, load_episode, resolve_episode_id
from pipeline.ui.browser import Browser, base_path, query_params
from pipeline.ui.filters import BATCH_PAGE, batch_list_query, page_query, parse_query
from pipeline.ui.runs import RUN_STATS, run_figures
from pipeline.ui.search import SEARCH_PAGE, parse_search, search_turns

FIGURES = ("stats", "by_version", "terminations", "spread", "training")
"""What ``/api/runs/POLICY`` gives of the run page (its charts are drawn from these)."""


def _plain(value: Any) -> Any:
    if isinstance(value, dt.datetime):
        return value.isoformat()
    if isinstance(value, decimal.Decimal):
        return float(value)
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, Mapping):
        return dict(value)
    raise TypeError(f"{type(value).__name__} is not JSON")


def _finite(value: Any) -> Any:
    """NaN and infinities (a mean logprob of nothing) as null: JSON has no numbers for them."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_finite(item) for item in value]
    return value


def json_response(content: Any, status: int = 200) -> Response:
    """``content`` as JSON (datetimes as ISO 8601, numerics as numbers, ids as text)."""
    text = json.dumps(_finite(content), default=_plain, ensure_ascii=False, allow_nan=False)
    return Response(text, status_code=status, media_type="application/json")


def _rows(rows: Any) -> list[dict[str, Any]]:
    return [dict(row) for row in rows]


def api_router(browser: Browser) -> APIRouter:
    """The JSON routes, under ``/api``."""
    router = APIRouter(prefix="/api")

    @router.get("/episodes")
    async def episodes(request: Request) -> Response:
        query = parse_query(query_params(request))
        engine, _ = await browser.open()
        async with engine.connect() as connection:
            rows = _rows((await connection.execute(page_query(query))).mappings())
        more = len(rows) > query.per
        link = f"{base_path(request)}/api/episodes{query.link(page=query.page + 1)}" if more else None
        return json_response(
            {"page": query.page, "per": query.per, "episodes": rows[: query.per], "next": link}
        )

    @router.get("/episodes/{episode_id}")
    async def episode(episode_id: str) -> Response:
        engine, store = await browser.open()
        found = await resolve_episode_id(store, episode_id)
        replayed = await load_episode(store, found)
        e = episodes_table
        async with engine.connect() as connection:
            row = (await connection.execute(sa.select(e).where(e.c.episode_id == found))).mappings().first()
        return json_response(
            {**episode_json(replayed, 1.0), "read_model": None if row is None else dict(row)}
        )

    @router.get("/runs")
    async def runs() -> Response:
        engine, _ = await browser.open()
        async with engine.connect() as connection:
            stats = _rows((await connection.execute(sa.text(RUN_STATS.format(where="")))).mappings())
        return json_response({"runs": stats})

    @router.get("/runs/{policy}")
    async def run(policy: str) -> Response:
        engine, _ = await browser.open()
        async with engine.connect() as connection:
            figures = await run_figures(connection, policy)
        if figures["stats"] is None:
            return json_response(
                {"error": "No such run", "message": f"no episodes of policy {policy!r}"}, 404
            )
        return json_response({"policy": policy, **{name: figures[name] for name in FIGURES}})

    @router.get("/batches")
    async def batches(request: Request) -> Response:
        listing, number, policy = batch_list_query(query_params(request))
        engine, _ = await browser.open()
        async with engine.connect() as connection:
            rows = _rows((await connection.execute(listing)).mappings())
        return json_response(
            {"page": number, "policy": policy, "batches": rows[:BATCH_PAGE], "more": len(rows) > BATCH_PAGE}
        )

    @router.get("/search")
    async def search(request: Request) -> Response:
        words, before = parse_search(query_params(request))
        engine, _ = await browser.open()
        async with engine.connect() as connection:
            hits = await search_turns(connection, words, before) if words else []
        if hits is None:
            return json_response({"error": "Search too slow", "message": "add a rarer word or a phrase"}, 503)
        shown = hits[:SEARCH_PAGE]
        return json_response(
            {
                "q": words,
                "turns": [
                    {
                        "position": hit.position,
                        "episode_id": hit.episode_id,
                        "turn_id": hit.turn_id,
                        "recorded_at": hit.recorded_at,
                        "match": hit.match,
                        "snippet": hit.before + hit.match + hit.after,
                    }
                    for hit in shown
                ],
                "before": shown[-1].position if len(hits) > SEARCH_PAGE else None,
            }
        )

    return router
