"""``turnstile ui``: the episode browser, a read-only web app over the log and the read models.

Server-rendered HTML (Jinja2, autoescaped), CSS inline, charts as inline SVG: no script, no build step,
nothing fetched from elsewhere. Every route is a GET; every query runs as the reader role in a read-only
transaction (``pipeline.ui.reader``). Episodes are read through ``pipeline.replay`` (the fold of their
events); lists and numbers come from the read models. The app is made by ``create_app`` and can be served
alone (``turnstile ui``) or mounted under a path of another app (the gateway's ``--ui``): links are made from
the request's ``root_path``, and the database is opened on the first request (mounted apps get no lifespan).

Here: the episodes, one episode (and a turn's whole prompt), the batches, the error pages. Elsewhere: the runs
(``runs``), search (``search``), two episodes side by side (``compare``), the same as JSON (``api``).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import logging
import math
import uuid
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Final
from urllib.parse import quote

import psycopg
import sqlalchemy as sa
import sqlalchemy.exc
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import HTMLResponse, PlainTextResponse, RedirectResponse, Response
from jinja2 import Environment, PackageLoader, StrictUndefined, select_autoescape
from sqlalchemy.ext.asyncio import AsyncEngine
from starlette.exceptions import HTTPException as StarletteHTTPException

from pipeline.errors import ConfigError, TurnstileError
from pipeline.log import batches_table, episodes_table, samples_table, turns_table
from pipeline.log import trained_batches_table as trained_table
from pipeline.replay import (
    AmbiguousEpisodeId,
    EpisodeNotFound,
    UnreadableEpisode,
    load_episode,
    names_agent_code,
    rerun_by_id,
    resolve_episode_id,
)
from pipeline.ui.api import api_router, json_response
from pipeline.ui.browser import Browser, Page, base_path, query_params
from pipeline.ui.compare import compare_router
from pipeline.ui.episode_view import episode_view, shade
from pipeline.ui.filters import (
    BATCH_PAGE,
    COUNT_CAP,
    PAGE_SIZES,
    SORTS,
    STATUSES,
    TERMINATIONS,
    BadRequest,
    EpisodeQuery,
    batch_list_query,
    count_query,
    page_query,
    parse_query,
)
from pipeline.ui.reader import DatabaseUnavailable
from pipeline.ui.runs import runs_router
from pipeline.ui.search import search_router

log = logging.getLogger(__name__)

COUNT_TIMEOUT_MS: Final = 100
# The policies for the filter's menu: a skip scan over the index on (policy, started_at), one probe per
# policy, where SELECT DISTINCT would read every episode.
POLICIES_QUERY: Final = """
    WITH RECURSIVE policies AS (
        SELECT min(policy) AS policy FROM episodes
        UNION ALL
        SELECT (SELECT min(policy) FROM episodes WHERE policy > policies.policy)
        FROM policies WHERE policies.policy IS NOT NULL
    )
    SELECT policy FROM policies WHERE policy IS NOT NULL LIMIT 200
"""
SAMPLE_LIMIT: Final = 2_000


def _templates() -> Environment:
    environment = Environment(
        loader=PackageLoader("pipeline.ui", "templates"),
        autoescape=select_autoescape(default=True),
        undefined=StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    environment.filters["num"] = _number
    environment.filters["when"] = _when
    environment.filters["seconds"] = _seconds
    environment.filters["url"] = lambda text: quote(str(text), safe="")
    environment.filters["shade"] = shade
    environment.filters["pretty_json"] = lambda value: json.dumps(value, indent=2, ensure_ascii=False)
    return environment


def _number(value: Any, digits: int = 4) -> str:
    if value is None:
        return "\u2013"
    number = float(value)
    if math.isnan(number):
        return "NaN"
    if number.is_integer() and abs(number) < 1e15:
        return f"{int(number):,}"
    return f"{number:.{digits}g}"


def _when(moment: dt.datetime | None) -> str:
    return moment.astimezone(dt.UTC).strftime("%Y-%m-%d %H:%M:%S") if moment else "\u2013"


def _seconds(value: float | None) -> str:
    return "\u2013" if value is None else f"{value:.2f} s"


def create_app(
    reader_url: str,
    *,
    allow_superuser: bool = False,
    tokenizer_dirs: Mapping[str, Path] | None = None,
    reruns: bool = False,
    rerun_agent: str | None = None,
) -> FastAPI:
    """The episode browser as an ASGI app (serve it, or mount it under a path of another app).

    ``reruns``: serve ``/episodes/ID/rerun``, which runs the episode's agent (or ``rerun_agent``) in this
    process on the recorded replies (``turnstile replay --rerun``; nothing is written) and shows where it
    diverged beside the recorded turn. Off by default: it runs code.
    """
    browser = Browser(
        reader_url, allow_superuser, dict(tokenizer_dirs or {}), reruns=reruns, rerun_agent=rerun_agent
    )
    templates = _templates()

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await browser.close()

    app = FastAPI(
        title="Turnstile episode browser", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    app.state.browser = browser

    def page(request: Request, template: str, status: int = 200, **context: Any) -> HTMLResponse:
        base = base_path(request)
        html = templates.get_template(template).render(base=base, request_path=request.url.path, **context)
        return HTMLResponse(html, status_code=status)

    def error_page(request: Request, status: int, title: str, message: str, **extra: Any) -> HTMLResponse:
        shown = {"candidates": [], **extra}
        return page(request, "error.html", status, title=title, message=message, **shown)

    _add_error_pages(app, error_page)
    app.include_router(home_router(browser))
    app.include_router(episodes_router(browser, page, error_page))
    app.include_router(runs_router(browser, page, error_page))
    app.include_router(batches_router(browser, page, error_page))
    app.include_router(search_router(browser, page))
    app.include_router(compare_router(browser, page))
    app.include_router(api_router(browser))
    return app


def _add_error_pages(app: FastAPI, html_error_page: Page) -> None:
    """Each error the routes raise as its page (status, title, message), or as JSON under ``/api``."""

    def error_page(request: Request, status: int, title: str, message: str, **extra: Any) -> Response:
        if request.url.path.removeprefix(base_path(request)).startswith("/api/"):
            return json_response({"error": title, "message": message, **extra}, status)
        return html_error_page(request, status, title, message, **extra)

    @app.exception_handler(BadRequest)
    async def bad_request(request: Request, error: BadRequest) -> Response:
        return error_page(request, 400, "Bad filter", str(error))

    @app.exception_handler(AmbiguousEpisodeId)
    async def ambiguous(request: Request, error: AmbiguousEpisodeId) -> Response:
        return error_page(
            request,
            400,
            "Ambiguous episode id",
            f"episode id {error.prefix!r} begins several episode ids: give more of it",
            candidates=error.candidates,
        )

    @app.exception_handler(EpisodeNotFound)
    async def not_found(request: Request, error: EpisodeNotFound) -> Response:
        return error_page(request, 404, "No such episode", str(error))

    @app.exception_handler(DatabaseUnavailable)
    async def unavailable(request: Request, error: DatabaseUnavailable) -> Response:
        return error_page(request, 503, "Database unavailable", str(error))

    @app.exception_handler(UnreadableEpisode)
    async def unreadable(request: Request, error: UnreadableEpisode) -> Response:
        return error_page(request, 422, "Episode cannot be shown", str(error))

    @app.exception_handler(TurnstileError)
    async def refused(request: Request, error: TurnstileError) -> Response:
        status = 400 if isinstance(error, ConfigError) else 500
        return error_page(request, status, "Cannot show this", str(error))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> Response:
        if error.status_code == 404:
            message = f"no page at {request.url.path}: see the episodes, runs or batches"
        elif error.status_code == 405:
            message = f"the episode browser is read-only: {request.method} is not served (only GET)"
        else:
            message = str(error.detail)
        response = error_page(request, error.status_code, f"{error.status_code}", message)
        if error.headers:
            response.headers.update(error.headers)
        return response

    @app.exception_handler(sqlalchemy.exc.DBAPIError)
    async def database_error(request: Request, error: sqlalchemy.exc.DBAPIError) -> Response:
        if isinstance(error.orig, psycopg.errors.QueryCanceled):
            return error_page(
                request, 503, "Query too slow", "the query ran past the statement timeout; narrow the filters"
            )
        if isinstance(error.orig, psycopg.OperationalError):
            return error_page(request, 503, "Database unavailable", f"PostgreSQL: {error.orig}")
        log.exception("query failed")
        return error_page(request, 500, "Query failed", f"PostgreSQL refused a query: {error.orig}")


def home_router(browser: Browser) -> APIRouter:
    """The home page (to the episodes) and the health check."""
    router = APIRouter()

    @router.get("/", include_in_schema=False)
    async def home(request: Request) -> Response:
        base = base_path(request)
        return RedirectResponse(f"{base}/episodes", status_code=307)

    @router.get("/healthz", include_in_schema=False)
    async def health() -> PlainTextResponse:
        await browser.open()
        return PlainTextResponse("ok\n")

    return router


def episodes_router(browser: Browser, page: Page, error_page: Page) -> APIRouter:
    """The episodes: the list, one episode (and its rerun), a turn's episode."""
    router = APIRouter()

    @router.get("/episodes", response_class=HTMLResponse)
    async def episodes(request: Request) -> HTMLResponse:
        params = query_params(request)
        query = parse_query(params)
        engine, _ = await browser.open()
        now = dt.datetime.now(dt.UTC)
        # Three reads on three connections at once: the page waits for the slowest (often the count, up to
        # its timeout), not for their sum.
        rows, policies, total = await asyncio.gather(
            _page_rows(engine, query, now), _policies(engine), _count(engine, query, now)
        )
        return page(
            request,
            "episodes.html",
            query=query,
            rows=rows[: query.per],
            more=len(rows) > query.per,
            total=total,
            capped=total is not None and total > COUNT_CAP,
            sorts=list(SORTS),
            statuses=STATUSES,
            terminations=TERMINATIONS,
            page_sizes=PAGE_SIZES,
            policies=sorted(policies),
        )

    async def episode_page(request: Request, episode_id: str, rerun: bool) -> Response:
        engine, store = await browser.open()
        found = await resolve_episode_id(store, episode_id)
        if found != episode_id:
            base = base_path(request)
            tail = "/rerun" if rerun else ""
            return RedirectResponse(f"{base}/episodes/{quote(found, safe='')}{tail}", status_code=307)
        replayed = await load_episode(store, found)
        t, s, e = turns_table, samples_table, episodes_table
        async with engine.connect() as connection:
            turn_rows = (
                (await connection.execute(sa.select(t).where(t.c.episode_id == found))).mappings().all()
            )
            sample_rows = (
                (
                    await connection.execute(
                        sa.select(
                            s.c.sample_id, s.c.turn_ids, s.c.advantage, s.c.batch_id, s.c.reward, s.c.stale
                        )
                        .where(s.c.episode_id == found)
                        .order_by(s.c.slot)
                    )
                )
                .mappings()
                .all()
            )
            row = (await connection.execute(sa.select(e).where(e.c.episode_id == found))).mappings().first()
        advantages: dict[uuid.UUID, list[float]] = {}
        for sample in sample_rows:
            if sample["advantage"] is not None:
                for turn_id in sample["turn_ids"]:
                    advantages.setdefault(turn_id, []).append(float(sample["advantage"]))
        tokenizer, tokenizer_name = browser.tokenizer(replayed.episode.started.policy)
        view = episode_view(
            replayed,
            read_model_turns={r["turn_id"]: dict(r) for r in turn_rows},
            advantages=advantages,
            tokenizer=tokenizer,
            tokenizer_name=tokenizer_name,
        )
        result = None
        if rerun:
            result = await rerun_by_id(
                store, found, agent=browser.rerun_agent, timeout=browser.rerun_timeout, agents=browser.agents
            )
        return page(
            request, "episode.html", view=view, samples=sample_rows, read_model=row, rerun=result,
            # a gateway episode's agent ran outside Turnstile: no link to a rerun that cannot run it
            reruns=browser.reruns and names_agent_code(replayed.episode.started.agent),
            rerun_agent=browser.rerun_agent,
            show_tokens=request.query_params.get("tokens") == "1",
        )  # fmt: skip

    @router.get("/episodes/{episode_id}/turns/{index}", response_class=HTMLResponse)
    async def turn_prompt(request: Request, episode_id: str, index: int) -> Response:
        """One turn's whole rendered prompt (decoded with ``--model``'s tokenizer, else ids) and tokens."""
        _, store = await browser.open()
        replayed = await load_episode(store, await resolve_episode_id(store, episode_id))
        if not 1 <= index <= len(replayed.episode.turns):
            turns = len(replayed.episode.turns)
            return error_page(request, 404, "No such turn", f"episode {episode_id!r} has turns 1 to {turns}")
        tokenizer, tokenizer_name = browser.tokenizer(replayed.episode.started.policy)
        view = episode_view(
            replayed, read_model_turns={}, advantages={}, tokenizer=tokenizer, tokenizer_name=tokenizer_name
        )
        turn = view.turns[index - 1]
        prompt = turn.turn.prompt_token_ids
        return page(
            request, "turn.html", view=view, t=turn, prompt_ids=prompt,
            prompt_text=None if tokenizer is None else str(tokenizer.decode(prompt)),
        )  # fmt: skip

    @router.get("/episodes/{episode_id}", response_class=HTMLResponse)
    async def episode(request: Request, episode_id: str) -> Response:
        return await episode_page(request, episode_id, rerun=False)

    @router.get("/episodes/{episode_id}/rerun", response_class=HTMLResponse)
    async def rerun(request: Request, episode_id: str) -> Response:
        if not browser.reruns:
            return error_page(
                request, 404, "Reruns are off",
                "this browser runs no agent code: start it with `turnstile ui --rerun [--rerun-agent "
                "pkg.mod:Agent]` to rerun an episode's agent on its recorded replies (nothing is written), "
                f"or run `turnstile replay {episode_id} --rerun`",
            )  # fmt: skip
        return await episode_page(request, episode_id, rerun=True)

    @router.get("/turns/{turn_id}", include_in_schema=False)
    async def turn(request: Request, turn_id: str) -> Response:
        try:
            parsed = uuid.UUID(turn_id)
        except ValueError:
            raise BadRequest(f"turn id {turn_id!r} is not a UUID") from None
        engine, _ = await browser.open()
        async with engine.connect() as connection:
            found = await connection.scalar(
                sa.select(turns_table.c.episode_id).where(turns_table.c.turn_id == parsed)
            )
        if found is None:
            return error_page(
                request,
                404,
                "No such turn",
                f"no turn {turn_id} in the turns read model (a turn is found here once the materializer has "
                "folded it; an episode's own page reads the log)",
            )
        base = base_path(request)
        return RedirectResponse(f"{base}/episodes/{quote(found, safe='')}#turn-{parsed}", status_code=307)

    return router


def batches_router(browser: Browser, page: Page, error_page: Page) -> APIRouter:
    """The training batches: the list and one batch."""
    router = APIRouter()

    @router.get("/batches", response_class=HTMLResponse)
    async def batches(request: Request) -> HTMLResponse:
        listing, number, policy = batch_list_query(query_params(request))
        engine, _ = await browser.open()
        async with engine.connect() as connection:
            rows = (await connection.execute(listing)).mappings().all()
        return page(
            request,
            "batches.html",
            rows=rows[:BATCH_PAGE],
            more=len(rows) > BATCH_PAGE,
            page=number,
            policy=policy,
        )

    @router.get("/batches/{batch_id}", response_class=HTMLResponse)
    async def batch(request: Request, batch_id: str) -> HTMLResponse:
        engine, _ = await browser.open()
        b, s, e, tb = batches_table, samples_table, episodes_table, trained_table
        async with engine.connect() as connection:
            row = (await connection.execute(sa.select(b).where(b.c.batch_id == batch_id))).mappings().first()
            if row is None:
                return error_page(
                    request,
                    404,
                    "No such batch",
                    f"no batch {batch_id!r} in the batches read model: see the list of batches",
                )
            staleness = (
                (
                    await connection.execute(
                        sa.text("SELECT * FROM batch_staleness WHERE batch_id = :id"), {"id": batch_id}
                    )
                )
                .mappings()
                .first()
            )
            trained = (
                (await connection.execute(sa.select(tb).where(tb.c.batch_id == batch_id))).mappings().all()
            )
            sample_rows = (
                (
                    await connection.execute(
                        sa.select(
                            s.c.sample_id,
                            s.c.episode_id,
                            s.c.group_id,
                            s.c.slot,
                            s.c.turn_ids,
                            s.c.policy_version,
                            s.c.tokens,
                            s.c.model_tokens,
                            s.c.reward,
                            s.c.advantage,
                            s.c.stale,
                        )
                        .where(s.c.batch_id == batch_id)
                        .order_by(s.c.group_id, s.c.episode_id, s.c.slot)
                        .limit(SAMPLE_LIMIT)
                    )
                )
                .mappings()
                .all()
            )
            episode_rows = (
                (
                    await connection.execute(
                        sa.select(
                            e.c.episode_id,
                            e.c.task_id,
                            e.c.agent,
                            e.c.group_id,
                            e.c.termination,
                            e.c.reward,
                            e.c.turns,
                            e.c.max_policy_version,
                            e.c.started_at,
                        )
                        .where(e.c.episode_id.in_(sa.select(s.c.episode_id).where(s.c.batch_id == batch_id)))
                        .order_by(e.c.group_id, e.c.episode_id)
                    )
                )
                .mappings()
                .all()
            )
        return page(
            request,
            "batch.html",
            batch=row,
            staleness=staleness,
            trained=trained,
            samples=sample_rows,
            episodes=episode_rows,
            sample_limit=SAMPLE_LIMIT,
        )

    return router


async def _page_rows(engine: AsyncEngine, query: EpisodeQuery, now: dt.datetime) -> list[Any]:
    async with engine.connect() as connection:
        return list((await connection.execute(page_query(query, now))).mappings().all())


async def _policies(engine: AsyncEngine) -> list[str]:
    async with engine.connect() as connection:
        return list((await connection.scalars(sa.text(POLICIES_QUERY))).all())


async def _count(engine: AsyncEngine, query: EpisodeQuery, now: dt.datetime) -> int | None:
    """How many episodes match (up to COUNT_CAP + 1), or None when counting takes longer than
    COUNT_TIMEOUT_MS: a rare filter over a million episodes reads them all, and the page must not wait."""
    async with engine.connect() as connection:
        try:
            # SET LOCAL: this transaction only (it ends with the connection).
            await connection.execute(sa.text(f"SET LOCAL statement_timeout = {COUNT_TIMEOUT_MS}"))
            return int(await connection.scalar(count_query(query, now)) or 0)
        except sqlalchemy.exc.DBAPIError as error:
            if isinstance(error.orig, psycopg.errors.QueryCanceled):
                return None
            raise
