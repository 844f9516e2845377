"""Two episodes side by side (``/compare?a=ID&b=ID``), aligned by turn: turn n of one beside turn n of the
other (in recorded order), each with its new messages, reply and numbers, and whether the two differ there.
Ids may be prefixes (they redirect to the whole ids); each side is the fold of its events, as on its page."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import zip_longest
from urllib.parse import urlencode

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response

from pipeline.replay import load_episode, resolve_episode_id
from pipeline.ui.browser import Browser, Page, base_path, query_params
from pipeline.ui.episode_view import EpisodeView, TurnView, episode_view
from pipeline.ui.filters import BadRequest


@dataclass(frozen=True)
class Row:
    """Turn ``index`` of each episode (None where one has fewer turns), and whether they differ."""

    index: int
    a: TurnView | None
    b: TurnView | None

    @property
    def same_messages(self) -> bool:
        return self.a is not None and self.b is not None and self.a.messages == self.b.messages

    @property
    def same_reply(self) -> bool:
        return self.a is not None and self.b is not None and self.a.reply == self.b.reply


def aligned(a: EpisodeView, b: EpisodeView) -> list[Row]:
    return [Row(index + 1, x, y) for index, (x, y) in enumerate(zip_longest(a.turns, b.turns))]


def _ids(request: Request) -> tuple[str, str] | None:
    params = query_params(request)
    unknown = sorted(set(params) - {"a", "b"})
    if unknown:
        raise BadRequest(f"unknown parameter {unknown[0]!r}: the comparison takes a and b (episode ids)")
    a, b = ((params.get(name) or [""])[0].strip() for name in ("a", "b"))
    if not a and not b:
        return None
    if not a or not b:
        raise BadRequest(f"give two episode ids to compare: {'b' if a else 'a'} is missing")
    return a, b


def compare_router(browser: Browser, page: Page) -> APIRouter:
    router = APIRouter()

    @router.get("/compare", response_class=HTMLResponse)
    async def compare(request: Request) -> Response:
        ids = _ids(request)
        if ids is None:
            return page(request, "compare.html", a=None, b=None, rows=[], given=("", ""))
        _, store = await browser.open()
        found = (await resolve_episode_id(store, ids[0]), await resolve_episode_id(store, ids[1]))
        if found != ids:
            query = urlencode({"a": found[0], "b": found[1]})
            return RedirectResponse(f"{base_path(request)}/compare?{query}", status_code=307)
        views = []
        for episode_id in found:
            replayed = await load_episode(store, episode_id)
            tokenizer, name = browser.tokenizer(replayed.episode.started.policy)
            views.append(
                episode_view(
                    replayed, read_model_turns={}, advantages={}, tokenizer=tokenizer, tokenizer_name=name
                )
            )
        a, b = views
        return page(request, "compare.html", a=a, b=b, rows=aligned(a, b), given=found)

    return router
