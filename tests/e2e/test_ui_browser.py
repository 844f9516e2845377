"""The episode browser in a real browser: headless Chromium (Debian's ``chromium``, driven by Playwright)
against ``turnstile ui`` in its own process, on a database holding episodes these tests recorded.

Marked ``browser`` and left out of the main run: ``.ci/run`` installs Chromium and runs them as a step of
their own (``pytest -m browser tests/e2e/test_ui_browser.py``). Screenshots go to ``build/ui-screenshots/``
(``TURNSTILE_UI_SCREENSHOTS`` to put them elsewhere).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from pipeline.log import EventStore
from schemas import TurnCompleted
from tests.conftest import login_url
from tests.support.ui_episodes import Recorded, record_counting_episode, record_episodes

pytestmark = pytest.mark.browser
playwright_api = pytest.importorskip("playwright.async_api", reason="pip install -e '.[browser]'")
CHROMIUM = os.environ.get("TURNSTILE_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
SCREENSHOTS = Path(
    os.environ.get("TURNSTILE_UI_SCREENSHOTS", Path(__file__).resolve().parents[2] / "build/ui-screenshots")
)
CHROMIUM_FOUND = Path(CHROMIUM).exists()
CHROMIUM_ARGS = [
    "--no-sandbox",  # as root, Chromium refuses to start with its sandbox
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


@dataclass
class Served:
    url: str
    recorded: Recorded
    counting: list[TurnCompleted]


async def _read_url(process: asyncio.subprocess.Process) -> str:
    """The URL ``turnstile ui`` prints once it listens (its first line naming one)."""
    assert process.stderr is not None
    seen = []
    while line := (await process.stderr.readline()).decode():
        seen.append(line)
        if found := re.search(r"episode browser on (http://\S+)/episodes", line):
            return found[1]
    raise AssertionError(f"turnstile ui exited without serving: {''.join(seen)}")


@pytest.fixture
async def served(
    store: EventStore, database_url: str, logins: dict[str, tuple[str, str]], tiny_model_dir: Path
) -> AsyncIterator[Served]:
    if not CHROMIUM_FOUND:
        missing = f"no Chromium at {CHROMIUM}: apt-get install chromium (or set TURNSTILE_CHROMIUM)"
        if os.environ.get("CI"):  # .ci/run installs it: missing there, the step must fail, not pass empty
            pytest.fail(missing)
        pytest.skip(missing)
    recorded = await record_episodes(store)
    recorded_counting = await record_counting_episode(store)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TURNSTILE_")}
    env["TURNSTILE_READER_URL"] = login_url(database_url, logins["turnstile_reader"])
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "consumers.cli", "ui", "--port", "0", "--model", f"main={tiny_model_dir}",
        "--rerun", "--rerun-agent", "tests.support.replay_agents:RewordedCountingAgent",
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        url = await asyncio.wait_for(_read_url(process), timeout=120)
        yield Served(url, recorded, recorded_counting)
    finally:
        process.terminate()
        await process.wait()


@pytest.fixture
def screenshots() -> Path:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    return SCREENSHOTS


@pytest.fixture
async def page(served: Served, screenshots: Path) -> AsyncIterator[Any]:
    profile = tempfile.mkdtemp(prefix="turnstile-chromium-")
    try:
        async with playwright_api.async_playwright() as playwright:
            context = await playwright.chromium.launch_persistent_context(
                profile,
                executable_path=CHROMIUM,
                headless=True,
                args=CHROMIUM_ARGS,
                viewport={"width": 1400, "height": 1000},
            )
            try:
                yield context.pages[0] if context.pages else await context.new_page()
            finally:
                await context.close()
    finally:
        shutil.rmtree(profile, ignore_errors=True)


async def shot(page: Any, name: str) -> None:
    await page.screenshot(path=str(SCREENSHOTS / f"{name}.png"), full_page=True)


async def test_find_filter_and_open_an_episode(served: Served, page: Any) -> None:
    recorded = served.recorded
    await page.goto(f"{served.url}/episodes")
    rows = page.locator("#episodes tbody tr[data-episode]")
    assert await rows.count() == 8
    await shot(page, "1-episode-list")

    await page.select_option("select[name=termination]", "error")
    await page.click("#apply")
    await page.wait_for_url(re.compile(r"termination=error"))
    assert await rows.count() == 1
    assert await rows.first.get_attribute("data-episode") == recorded.failed
    await shot(page, "2-filtered-errors")

    await rows.first.locator("a").first.click()
    await page.wait_for_url(re.compile(f"/episodes/{recorded.failed}$"))
    traceback = page.locator("#traceback")
    assert "ZeroDivisionError: division by zero" in await traceback.inner_text()
    await shot(page, "3-failed-episode")

    await page.goto(f"{served.url}/episodes")
    await page.fill("input[name=min_reward]", "lots")
    await page.click("#apply")
    assert "min_reward: 'lots' is not a number" in await page.locator("#error").inner_text()
    await shot(page, "4-bad-filter")


async def test_a_branching_episode_its_tree_and_shaded_tokens(served: Served, page: Any) -> None:
    recorded = served.recorded
    a, _b, c, _d = recorded.branching_turns
    await page.goto(f"{served.url}/episodes?agent=tests.ui:MathAgent&sort=turns&order=desc")
    await page.locator(f"tr[data-episode='{recorded.branching}'] a").first.click()
    await page.wait_for_url(re.compile(f"/episodes/{recorded.branching}$"))

    tree = page.locator("details#tree")
    branch_link = tree.locator(f"a[href='#turn-{c.turn_id}']")
    assert not await branch_link.is_visible()  # a branching tree starts folded
    await tree.locator("summary").click()
    assert await branch_link.is_visible()
    assert "2 lineages, branching" in await tree.locator("summary").inner_text()
    assert await tree.locator("ul.tree li").count() == 4
    await shot(page, "5-branching-episode")

    await branch_link.click()
    await page.wait_for_url(re.compile(f"#turn-{c.turn_id}$"))
    turn = page.locator(f"#turn-{c.turn_id}")
    assert "continues turn 1" in await turn.locator(".head").inner_text()

    reasoning = page.locator(f"#turn-{a.turn_id} details.reasoning")
    assert not await reasoning.locator("pre").is_visible()  # reasoning collapsed
    await reasoning.locator("summary").click()
    assert "calculator tool" in await reasoning.locator("pre").inner_text()

    tokens = page.locator(f"#turn-{a.turn_id} .tok")
    assert await tokens.count() == 5
    colours = [await tokens.nth(i).evaluate("t => getComputedStyle(t).backgroundColor") for i in range(5)]
    assert colours[0] == "rgb(5, 200, 0)"  # logprob -0.01
    assert colours[-1] == "rgb(255, 7, 0)"  # logprob -4
    await tokens.nth(4).hover()
    title = await tokens.nth(4).get_attribute("title")
    assert title is not None
    assert "logprob -4.0000" in title
    # Decoded with the policy's tokenizer (--model main=DIR): the title quotes the text shown.
    shown = await tokens.nth(4).text_content()
    assert shown
    assert not shown.isdigit()  # a decoded text, not an id
    assert json.dumps(shown, ensure_ascii=False) in title
    await turn.scroll_into_view_if_needed()
    await page.locator(f"#turn-{a.turn_id}").screenshot(path=str(SCREENSHOTS / "6-shaded-tokens.png"))


async def test_a_run_and_a_batch_down_to_its_episodes(served: Served, page: Any) -> None:
    await page.goto(f"{served.url}/runs/main")
    assert await page.locator("#reward svg polygon.band").count() == 1
    assert await page.locator("#throughput svg rect.bar").count() >= 1
    await shot(page, "7-run")
    await page.goto(f"{served.url}/batches")
    await page.locator("#batches tbody a").first.click()
    await page.wait_for_url(re.compile(r"/batches/[^/]+$"))
    episode_links = page.locator("#batch-episodes a[href*='/episodes/']")
    assert await episode_links.count() >= 1
    await shot(page, "8-batch")
    await episode_links.first.click()
    await page.wait_for_url(re.compile(r"/episodes/[^/?]+$"))
    assert await page.locator("section.turn").count() >= 1


async def test_a_rerun_beside_the_recording(served: Served, page: Any) -> None:
    await page.goto(f"{served.url}/episodes/counting-1")
    await page.click("#rerun-link")
    await page.wait_for_url(re.compile(r"/episodes/counting-1/rerun$"))
    assert "diverged" in await page.locator("#rerun").inner_text()
    diverged = page.locator(f"#turn-{served.counting[1].turn_id}")
    assert "now please say 2" in await diverged.locator("#divergence .add").inner_text()
    assert "now say 2" in await diverged.locator(".side > div").first.inner_text()
    await diverged.screenshot(path=str(SCREENSHOTS / "9-rerun-beside-the-recording.png"))


async def test_search_compare_and_tokens_without_hovering(served: Served, page: Any) -> None:
    recorded = served.recorded
    a, b, _c, _d = recorded.branching_turns
    await page.goto(f"{served.url}/episodes")
    await page.click("header.top a[href$='/search']")
    await page.fill("input[name=q]", "calculator")
    await page.click("#find")
    await page.wait_for_url(re.compile(r"/search\?q=calculator"))
    hits = page.locator("#hits tbody tr[data-turn]")
    assert await hits.count() == 1
    assert await page.locator("#hits mark").inner_text() == "calculator"
    await shot(page, "10-search")
    await hits.first.locator(f"a[href$='#turn-{a.turn_id}']").click()
    await page.wait_for_url(re.compile(f"/episodes/{recorded.branching}#turn-{a.turn_id}$"))

    # a turn's tokens: folded, opened by a click (no hovering), one row per completion token
    details = page.locator(f"#turn-{b.turn_id} details.token-table")
    rows = details.locator("table.tokens-list tbody tr")
    assert not await rows.first.is_visible()
    await details.locator("summary").click()
    assert await rows.count() == len(b.completion_token_ids)
    first = await rows.first.locator("td").all_inner_texts()
    assert first[1] == str(b.completion_token_ids[0])
    assert first[2] != "\u2013"  # decoded with the policy's tokenizer (--model main=DIR)
    await details.screenshot(path=str(SCREENSHOTS / "11-tokens-without-hovering.png"))
    await details.locator("summary a").click()  # the whole rendered prompt of that turn
    await page.wait_for_url(re.compile(f"/episodes/{recorded.branching}/turns/2$"))
    assert await page.locator("#rendered-prompt").inner_text()

    first_id, second_id = recorded.group[0], recorded.group[1]
    await page.goto(f"{served.url}/compare")
    await page.fill("input[name=a]", first_id[:12])
    await page.fill("input[name=b]", second_id[:12])
    await page.click("#compare")
    await page.wait_for_url(re.compile(f"/compare\\?a={first_id}&b={second_id}$"))
    assert await page.locator("#turns section.turn").count() == 4
    assert "first differ at turn 1" in await page.locator("#first-difference").inner_text()
    left, right = page.locator("#a-turn-1"), page.locator("#b-turn-1")
    assert (await left.bounding_box())["x"] < (await right.bounding_box())["x"]  # side by side
    assert (await left.bounding_box())["y"] == (await right.bounding_box())["y"]  # aligned by turn
    await shot(page, "12-compare")
