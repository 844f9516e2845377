"""``turnstile ui``: the episode browser, a read-only web app over the log and the read models.

Server-rendered HTML (Jinja2, autoescaped), CSS inline, charts as inline SVG: no script, no build step,
nothing fetched from elsewhere. Every route is a GET; every query runs as the reader role in a read-only
transaction (``pipeline.ui.reader``). Episodes are read through ``pipeline.replay`` (the fold of their
events); lists and numbers come from the read models. The app is made by ``create_app`` and can be served
alone (``turnstile ui``) or mounted under a path of another app (the gateway's ``--ui``): links are made from
the request's ``root_path``, and the database is opened on the first request (mounted apps get no lifespan).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import logging
import math
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
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
from pipeline.log import EventStore, batches_table, episodes_table, samples_table, turns_table
from pipeline.log import trained_batches_table as trained_table
from pipeline.replay import (
    AmbiguousEpisodeId,
    EpisodeNotFound,
    UnreadableEpisode,
    load_episode,
    load_tokenizer,
    names_agent_code,
    rerun_by_id,
    resolve_episode_id,
)
from pipeline.ui import svg
from pipeline.ui.episode_view import episode_view, shade
from pipeline.ui.filters import (
    COUNT_CAP,
    PAGE_SIZES,
    SORTS,
    STATUSES,
    TERMINATIONS,
    BadRequest,
    EpisodeQuery,
    count_query,
    page_query,
    parse_query,
)
from pipeline.ui.reader import DatabaseUnavailable, check_login, reader_engine

log = logging.getLogger(__name__)

BATCH_PAGE: Final = 50
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


_Page = Callable[..., HTMLResponse]
"""``page(request, template, status=200, **context)`` or ``error_page(request, status, title, message)``."""


@dataclass
class Browser:
    """What the app holds: where to read, the tokenizers by policy, and the engine once opened."""

    reader_url: str
    allow_superuser: bool = False
    tokenizer_dirs: Mapping[str, Path] = field(default_factory=dict)  # policy -> directory; "*": any
    reruns: bool = False  # /episodes/ID/rerun runs agent code (the recorded agent, or rerun_agent)
    rerun_agent: str | None = None
    rerun_timeout: float = 60.0
    agents: dict[str, Any] = field(default_factory=dict)
    engine: AsyncEngine | None = None
    store: EventStore | None = None
    tokenizers: dict[Path, Any] = field(default_factory=dict)
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    async def open(self) -> tuple[AsyncEngine, EventStore]:
        async with self._lock:
            if self.engine is None or self.store is None:
                engine = reader_engine(self.reader_url)
                try:
                    await check_login(engine, allow_superuser=self.allow_superuser)
                except BaseException:
                    await engine.dispose()
                    raise
                # The store is used for reading only (load_episode, resolve_episode_id): it never appends.
                self.engine, self.store = engine, EventStore(engine)
            return self.engine, self.store

    async def close(self) -> None:
        if self.engine is not None:
            await self.engine.dispose()
        self.engine = self.store = None

    def tokenizer(self, policy: str) -> tuple[Any | None, str | None]:
        directory = self.tokenizer_dirs.get(policy) or self.tokenizer_dirs.get("*")
        if directory is None:
            return None, None
        if directory not in self.tokenizers:
            self.tokenizers[directory] = load_tokenizer(directory)
        return self.tokenizers[directory], str(directory)


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
        base = request.scope.get("root_path", "").rstrip("/")
        html = templates.get_template(template).render(base=base, request_path=request.url.path, **context)
        return HTMLResponse(html, status_code=status)

    def error_page(request: Request, status: int, title: str, message: str, **extra: Any) -> HTMLResponse:
        return page(request, "error.html", status, title=title, message=message, candidates=[], **extra)

    _add_error_pages(app, page, error_page)
    app.include_router(home_router(browser))
    app.include_router(episodes_router(browser, page, error_page))
    app.include_router(runs_router(browser, page, error_page))
    app.include_router(batches_router(browser, page, error_page))
    return app


def _add_error_pages(app: FastAPI, page: _Page, error_page: _Page) -> None:
    """Each error the routes raise as its page (status, title, message)."""

    @app.exception_handler(BadRequest)
    async def bad_request(request: Request, error: BadRequest) -> HTMLResponse:
        return error_page(request, 400, "Bad filter", str(error))

    @app.exception_handler(AmbiguousEpisodeId)
    async def ambiguous(request: Request, error: AmbiguousEpisodeId) -> HTMLResponse:
        return page(
            request,
            "error.html",
            400,
            title="Ambiguous episode id",
            message=f"episode id {error.prefix!r} begins several episode ids: give more of it",
            candidates=error.candidates,
        )

    @app.exception_handler(EpisodeNotFound)
    async def not_found(request: Request, error: EpisodeNotFound) -> HTMLResponse:
        return error_page(request, 404, "No such episode", str(error))

    @app.exception_handler(DatabaseUnavailable)
    async def unavailable(request: Request, error: DatabaseUnavailable) -> HTMLResponse:
        return error_page(request, 503, "Database unavailable", str(error))

    @app.exception_handler(UnreadableEpisode)
    async def unreadable(request: Request, error: UnreadableEpisode) -> HTMLResponse:
        return error_page(request, 422, "Episode cannot be shown", str(error))

    @app.exception_handler(TurnstileError)
    async def refused(request: Request, error: TurnstileError) -> HTMLResponse:
        status = 400 if isinstance(error, ConfigError) else 500
        return error_page(request, status, "Cannot show this", str(error))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> HTMLResponse:
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
    async def database_error(request: Request, error: sqlalchemy.exc.DBAPIError) -> HTMLResponse:
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
        base = request.scope.get("root_path", "").rstrip("/")
        return RedirectResponse(f"{base}/episodes", status_code=307)

    @router.get("/healthz", include_in_schema=False)
    async def health() -> PlainTextResponse:
        await browser.open()
        return PlainTextResponse("ok\n")

    return router


def episodes_router(browser: Browser, page: _Page, error_page: _Page) -> APIRouter:
    """The episodes: the list, one episode (and its rerun), a turn's episode."""
    router = APIRouter()

    @router.get("/episodes", response_class=HTMLResponse)
    async def episodes(request: Request) -> HTMLResponse:
        params: dict[str, list[str]] = {}
        for name, value in request.query_params.multi_items():
            params.setdefault(name, []).append(value)
        query = parse_query(params)
        engine, _ = await browser.open()
        now = dt.datetime.now(dt.UTC)
        async with engine.connect() as connection:
            rows = (await connection.execute(page_query(query, now))).mappings().all()
            policies = list((await connection.scalars(sa.text(POLICIES_QUERY))).all())
            total = await _count(connection, query, now)
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
            base = request.scope.get("root_path", "").rstrip("/")
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
        base = request.scope.get("root_path", "").rstrip("/")
        return RedirectResponse(f"{base}/episodes/{quote(found, safe='')}#turn-{parsed}", status_code=307)

    return router


def runs_router(browser: Browser, page: _Page, error_page: _Page) -> APIRouter:
    """The runs: each policy's figures and charts."""
    router = APIRouter()

    @router.get("/runs", response_class=HTMLResponse)
    async def runs(request: Request) -> HTMLResponse:
        engine, _ = await browser.open()
        async with engine.connect() as connection:
            stats = (
                (await connection.execute(sa.text("SELECT * FROM episode_stats ORDER BY policy")))
                .mappings()
                .all()
            )
        return page(request, "runs.html", stats=stats)

    @router.get("/runs/{policy}", response_class=HTMLResponse)
    async def run(request: Request, policy: str) -> HTMLResponse:
        unknown = sorted(set(request.query_params) - {"refresh"})
        if unknown:
            raise BadRequest(f"unknown parameter {unknown[0]!r}: the run page takes refresh (seconds)")
        refresh_text = request.query_params.get("refresh")
        refresh = None
        if refresh_text is not None:
            if not refresh_text.isdigit() or not 5 <= int(refresh_text) <= 3600:
                raise BadRequest(f"refresh: {refresh_text!r} is not a number of seconds from 5 to 3600")
            refresh = int(refresh_text)
        engine, _ = await browser.open()
        async with engine.connect() as connection:
            figures = await _run_figures(connection, policy)
        if figures["stats"] is None:
            return error_page(
                request,
                404,
                "No such run",
                f"no episodes of policy {policy!r} in the episodes read model (is the materializer running?)",
            )
        return page(request, "run.html", policy=policy, refresh=refresh, **figures)

    return router


def batches_router(browser: Browser, page: _Page, error_page: _Page) -> APIRouter:
    """The training batches: the list and one batch."""
    router = APIRouter()

    @router.get("/batches", response_class=HTMLResponse)
    async def batches(request: Request) -> HTMLResponse:
        params: dict[str, list[str]] = {}
        for name, value in request.query_params.multi_items():
            params.setdefault(name, []).append(value)
        unknown = sorted(set(params) - {"policy", "page"})
        if unknown:
            raise BadRequest(f"unknown parameter {unknown[0]!r}: the batch list takes policy, page")
        policy = params.get("policy", [None])[0] or None
        page_text = params.get("page", ["1"])[0]
        if not page_text.isdigit() or not 1 <= int(page_text) <= 100_000:
            raise BadRequest(f"page: {page_text!r} is not a page number (1 or more)")
        number = int(page_text)
        engine, _ = await browser.open()
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
        listing = listing.offset((number - 1) * BATCH_PAGE).limit(BATCH_PAGE + 1)
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


async def _count(connection: Any, query: EpisodeQuery, now: dt.datetime) -> int | None:
    """How many episodes match (up to COUNT_CAP + 1), or None when counting takes longer than
    COUNT_TIMEOUT_MS: a rare filter over a million episodes reads them all, and the page must not wait."""
    try:
        # SET LOCAL: this transaction only (the page's queries ran before it; it ends with the connection).
        await connection.execute(sa.text(f"SET LOCAL statement_timeout = {COUNT_TIMEOUT_MS}"))
        return int(await connection.scalar(count_query(query, now)) or 0)
    except sqlalchemy.exc.DBAPIError as error:
        if isinstance(error.orig, psycopg.errors.QueryCanceled):
            return None
        raise


async def _run_figures(connection: Any, policy: str) -> dict[str, Any]:
    """The run page's numbers and charts for one policy, from the views over the read models."""

    async def rows(statement: str, **params: Any) -> list[Mapping[str, Any]]:
        return list((await connection.execute(sa.text(statement), {"policy": policy, **params})).mappings())

    stats = await rows("SELECT * FROM episode_stats WHERE policy = :policy")
    if not stats:
        return {"stats": None}
    by_version = await rows(
        "SELECT * FROM reward_by_policy_version WHERE policy = :policy AND rewarded > 0 "
        "ORDER BY policy_version"
    )
    xs, means, lows, highs = [], [], [], []
    for row in by_version:
        mean = float(row["mean_reward"])
        half = 1.96 * float(row["stddev_reward"] or 0.0) / math.sqrt(max(int(row["rewarded"]), 1))
        xs.append(float(row["policy_version"]))
        means.append(mean)
        lows.append(mean - half)
        highs.append(mean + half)
    reward_chart = svg.line_chart(
        xs,
        means,
        low=lows,
        high=highs,
        xlabel="policy version",
        ylabel="mean reward",
        title="mean reward per policy version, with its 95% confidence band",
    )
    span = (
        await rows(
            "SELECT min(finished_at) AS first, max(finished_at) AS last FROM episodes "
            "WHERE policy = :policy AND status = 'finished'"
        )
    )[0]
    throughput_chart, bucket_s = (
        svg.bar_chart([], slots=1, x_low=0, x_high=1, xlabel="", ylabel="", title=""),
        0.0,
    )
    if span["first"] is not None:
        bucket_s = max((span["last"] - span["first"]).total_seconds() / 40, 1.0)
        buckets = await rows(
            "SELECT floor(extract(epoch FROM finished_at - :first) / :width)::int AS bucket, "
            "count(*) AS episodes, coalesce(sum(turns), 0) AS turns FROM episodes "
            "WHERE policy = :policy AND status = 'finished' GROUP BY bucket ORDER BY bucket",
            first=span["first"],
            width=bucket_s,
        )
        throughput_chart = svg.bar_chart(
            [(int(row["bucket"]), float(row["turns"]) / bucket_s) for row in buckets],
            slots=int(buckets[-1]["bucket"]) + 1 if buckets else 1,
            x_low=0.0,
            x_high=(int(buckets[-1]["bucket"]) + 1 if buckets else 1) * bucket_s,
            xlabel=f"seconds since the first finished episode (buckets of {bucket_s:.0f} s)",
            ylabel="turns/s",
            title="turns per second of finished episodes",
        )
    staleness = await rows(
        "SELECT * FROM (SELECT * FROM batch_staleness WHERE policy = :policy ORDER BY created_at DESC "
        "LIMIT 500) recent ORDER BY created_at"
    )
    staleness_chart = svg.line_chart(
        [float(index) for index in range(len(staleness))],
        [float(row["mean_staleness"] or 0.0) for row in staleness],
        low=[float(row["min_staleness"]) for row in staleness],
        high=[float(row["max_staleness"]) for row in staleness],
        xlabel="batch (oldest to newest of the last 500)",
        ylabel="versions behind",
        title="staleness per batch: mean, with the band from the freshest to the stalest sample",
    )
    # staleness when a trainer took the batch: a batch trained into version v was stepped on v - 1; a
    # skipped one is recorded with the version it was measured against
    taken = await rows(
        "SELECT * FROM (SELECT t.outcome, t.trained_at, "
        "CASE t.outcome WHEN 'trained' THEN t.policy_version - 1 ELSE t.policy_version END "
        "- b.min_policy_version AS behind FROM trained_batches t "
        "JOIN batches b USING (batch_id) WHERE t.policy = :policy AND t.outcome IN ('trained', 'stale') "
        "ORDER BY t.trained_at DESC, t.batch_id LIMIT 500) recent ORDER BY trained_at"
    )
    training = (
        await rows(
            "SELECT count(*) AS taken, count(*) FILTER (WHERE outcome = 'stale') AS skipped "
            "FROM trained_batches WHERE policy = :policy AND outcome IN ('trained', 'stale')"
        )
    )[0]
    trained = [row for row in taken if row["outcome"] == "trained"]
    training_chart = svg.line_chart(
        [float(index) for index in range(len(trained))],
        [float(row["behind"]) for row in trained],
        xlabel="trained batch (oldest to newest of the last 500 taken)",
        ylabel="versions behind",
        title="staleness at training time: the batch's oldest sample against the version stepped on",
    )
    terminations = await rows(
        "SELECT termination, episodes, share FROM terminations WHERE policy = :policy ORDER BY episodes DESC"
    )
    spread = (
        await rows(
            "SELECT count(*) AS groups, count(*) FILTER (WHERE zero_spread) AS zero_spread, "
            "avg(stddev_reward) AS mean_stddev, max(stddev_reward) AS max_stddev FROM group_rewards "
            "WHERE policy = :policy AND finished = episodes AND episodes > 1"
        )
    )[0]
    histogram = await rows(
        "SELECT width_bucket(stddev_reward, 0, :top, 10) AS bucket, count(*) AS groups FROM group_rewards "
        "WHERE policy = :policy AND finished = episodes AND episodes > 1 AND stddev_reward IS NOT NULL "
        "GROUP BY bucket ORDER BY bucket",
        top=float(spread["max_stddev"] or 0.0) + 1e-9,
    )
    spread_chart = svg.bar_chart(
        [(min(int(row["bucket"]), 10) - 1, float(row["groups"])) for row in histogram],
        slots=10,
        x_low=0.0,
        x_high=float(spread["max_stddev"] or 0.0),
        xlabel=f"reward std within a group (10 buckets up to {_number(spread['max_stddev'])})",
        ylabel="groups",
        title="group reward spread",
    )
    return {
        "stats": stats[0],
        "by_version": by_version,
        "reward_chart": reward_chart,
        "throughput_chart": throughput_chart,
        "staleness": staleness,
        "staleness_chart": staleness_chart,
        "training": training,
        "training_chart": training_chart,
        "terminations": terminations,
        "spread": spread,
        "spread_chart": spread_chart,
    }
