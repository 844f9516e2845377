"""The episode browser's pages over real PostgreSQL (the app in process over httpx; the browser tests drive
``turnstile ui`` in Chromium: tests/e2e/test_ui_browser.py): lists with filters, sorts and pages, an episode
with its tree and shaded tokens, a run, a batch, deep links, and a clear error page for every bad input."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid

import httpx
import psycopg
import pytest
import sqlalchemy as sa
import sqlalchemy.exc

from consumers.gateway import mount_browser
from pipeline.gateway import create_gateway
from pipeline.log import EventStore
from pipeline.ui import create_app, parse_query, reader_engine, svg
from pipeline.ui.filters import BadRequest
from schemas import ChatMessage, EpisodeStarted
from tests.conftest import login_url
from tests.support.ui_episodes import Browsing, make_turn, record_counting_episode, record_episodes


def listed(html: str) -> list[str]:
    return re.findall(r'<tr data-episode="([^"]+)">', html)


async def test_the_list_filters_sorts_and_pages_on_the_server(browsing: Browsing) -> None:
    client, recorded = browsing.client, browsing.recorded
    everything = listed((await client.get("/episodes")).text)
    assert len(everything) == 8  # 4 in the group, branching, failed, broken, running
    by_reward = listed((await client.get("/episodes?policy=main&sort=reward&order=desc")).text)
    assert by_reward[-1] == recorded.broken  # no reward: last whichever way
    assert set(by_reward[:2]) == {recorded.group[2], recorded.group[3]} or recorded.branching in by_reward[:3]
    assert listed((await client.get("/episodes?min_reward=0.4&max_reward=0.6")).text) == [recorded.group[1]]
    assert listed((await client.get("/episodes?termination=error")).text) == [recorded.failed]
    assert listed((await client.get("/episodes?errors=1")).text) == [recorded.failed]
    assert listed((await client.get("/episodes?status=running")).text) == [recorded.running]
    assert listed((await client.get("/episodes?policy=other")).text) == [recorded.running]
    assert listed((await client.get("/episodes?prefix_break=1")).text) == [recorded.broken]
    assert sorted(listed((await client.get("/episodes?tag=split%3Dtrain")).text)) == sorted(
        recorded.group[:3]
    )
    assert sorted(listed((await client.get("/episodes?version=1")).text)) == sorted(recorded.group[2:])
    assert listed((await client.get("/episodes?agent=tests.ui:GreetAgent")).text) == [recorded.broken]
    assert len(listed((await client.get("/episodes?group=g-arith&task=arith-1")).text)) == 4
    assert listed((await client.get("/episodes?since=2000-01-01&until=2000-01-02")).text) == []
    first = await client.get("/episodes?per=3&sort=started&order=asc")
    second = await client.get("/episodes?per=3&sort=started&order=asc&page=2")
    pages = listed(first.text) + listed(second.text)
    assert len(pages) == 6
    assert len(set(pages)) == 6
    assert 'id="next"' in first.text
    assert "page=2" in first.text
    assert "8 episodes" in (await client.get("/episodes")).text


@pytest.mark.parametrize(
    ("query", "said"),
    [
        ("min_reward=lots", "min_reward: 'lots' is not a number"),
        ("min_reward=2&max_reward=1", "min_reward 2 is more than max_reward 1"),
        ("status=sleeping", "status: 'sleeping' is not one of running, finished"),
        ("termination=exploded", "termination: 'exploded' is not one of"),
        ("version=-1", "version: -1 is out of range"),
        ("page=0", "page: 0 is out of range"),
        ("sort=colour", "sort: 'colour' is not one of"),
        ("since=yesterday-ish", "since: 'yesterday-ish' is neither a duration ago"),
        ("tag=nokey", "tag: 'nokey' is not key=value"),
        ("prefix_break=maybe", "prefix_break: 'maybe' is not a yes/no value"),
        ("polcy=main", "unknown parameter 'polcy'"),
        ("policy=a&policy=b", "policy: given 2 times"),
    ],
)
async def test_a_bad_filter_gets_a_400_page_naming_it(browsing: Browsing, query: str, said: str) -> None:
    response = await browsing.client.get(f"/episodes?{query}")
    assert response.status_code == 400
    assert "text/html" in response.headers["content-type"]
    assert said.replace("'", "&#39;") in response.text


async def test_unknown_ambiguous_and_malformed_ids_get_clear_pages(browsing: Browsing) -> None:
    client, recorded = browsing.client, browsing.recorded
    missing = await client.get("/episodes/nosuchepisode")
    assert missing.status_code == 404
    assert "no episode &#39;nosuchepisode&#39; in the log" in missing.text
    ambiguous = await client.get("/episodes/group")
    assert ambiguous.status_code == 400
    assert "begins several episode ids" in ambiguous.text
    assert all(f"/episodes/{episode}" in ambiguous.text for episode in recorded.group)
    malformed = await client.get("/episodes/bad%20id%3B")
    assert malformed.status_code == 400
    assert "is not an episode id" in malformed.text
    turn = await client.get("/turns/not-a-uuid")
    assert turn.status_code == 400
    assert "is not a UUID" in turn.text
    unknown_turn = await client.get("/turns/00000000-0000-0000-0000-000000000000")
    assert unknown_turn.status_code == 404
    assert "no turn" in unknown_turn.text
    assert (await client.get("/batches/nosuchbatch")).status_code == 404
    assert (await client.get("/runs/nosuchpolicy")).status_code == 404
    assert (await client.get("/batches?page=x")).status_code == 400
    assert (await client.get("/nowhere")).status_code == 404


async def test_nothing_can_write(browsing: Browsing) -> None:
    for method in ("POST", "PUT", "DELETE", "PATCH"):
        response = await browsing.client.request(method, "/episodes")
        assert response.status_code == 405
        assert "read-only" in response.text


async def test_an_episode_page_shows_its_tree_messages_numbers_and_shaded_tokens(browsing: Browsing) -> None:
    client, recorded = browsing.client, browsing.recorded
    page = (await client.get(f"/episodes/{recorded.branching}")).text
    a, b, c, d = recorded.branching_turns
    assert "2 lineages, branching" in page
    assert "<b>2 branches</b>" in page
    for turn in (a, b, c, d):
        assert f'id="turn-{turn.turn_id}"' in page
    assert page.count('class="tok"') == 4 * 5
    # by hand: p = e^-0.01 = 0.990 -> red 255 * 2 * 0.010 = 5, green 200; p = e^-4 = 0.018 -> 255, 7
    assert "background:rgb(5,200,0)" in page  # a likely token: green
    assert "background:rgb(255,7,0)" in page  # an unlikely one: red
    assert 'title="token ' in page
    assert "logprob -4.0000" in page
    assert "I should use the calculator tool." in page
    assert 'class="reasoning"' in page
    assert "calculate({&#34;expression&#34;: &#34;17 * 3&#34;})" in page
    assert "The answer is 51." in page
    assert "17 * 3 = 51, so 51." in page
    assert "advantage" in page
    assert "policy version <b>v0</b>" in page
    failed = (await client.get(f"/episodes/{recorded.failed}")).text
    assert 'id="traceback"' in failed
    assert "ZeroDivisionError: division by zero" in failed
    prefix = await client.get(f"/episodes/{recorded.branching[:12]}", follow_redirects=False)
    assert prefix.status_code == 307
    assert prefix.headers["location"] == f"/episodes/{recorded.branching}"
    deep = await client.get(f"/turns/{b.turn_id}", follow_redirects=False)
    assert deep.headers["location"] == f"/episodes/{recorded.branching}#turn-{b.turn_id}"


async def test_an_episode_page_marks_turns_not_for_training_and_never_delivered(
    browsing: Browsing, store: EventStore
) -> None:
    episode_id = f"marked-{uuid.uuid4().hex[:20]}"
    question = [ChatMessage(role="user", content="Name this chat")]
    side = make_turn(question, text="A title.", seed=61).model_copy(update={"train": False})
    lost = make_turn(question, text="Gone.", seed=62).model_copy(update={"delivered": False})
    plain = make_turn(question, text="Kept.", seed=63)
    started = EpisodeStarted(episode_id=episode_id, task_id="t", agent="tests.ui:Agent", policy="main")
    await store.append(f"episode-{episode_id}", [started, side, lost, plain], expected_version=0)
    page = (await browsing.client.get(f"/episodes/{episode_id}")).text
    sections = page.split('<section class="turn')[1:]
    assert [section.split("</section>")[0].count(">not for training<") for section in sections] == [1, 0, 0]
    assert [section.split("</section>")[0].count(">never delivered<") for section in sections] == [0, 1, 0]


async def test_a_run_and_a_batch_lead_to_their_samples_and_episodes(browsing: Browsing) -> None:
    client, recorded = browsing.client, browsing.recorded
    run = (await client.get("/runs/main")).text
    assert "95% confidence band" in run
    assert "<polygon" in run
    assert "turns/s" in run
    assert "done" in run
    assert "error" in run
    live = (await client.get("/runs/main?refresh=30")).text
    assert '<meta http-equiv="refresh" content="30">' in live
    assert (await client.get("/runs/main?refresh=1")).status_code == 400
    assert (await client.get("/runs/main?colour=red")).status_code == 400
    running = await client.get(f"/episodes/{recorded.running}")
    assert running.status_code == 200
    assert '<span class="badge running">running</span>' in running.text
    batches = (await client.get("/batches")).text
    batch_ids = re.findall(r'href="/batches/([0-9a-zA-Z_-]+)"', batches)
    assert batch_ids
    shown = ""
    for batch_id in batch_ids:
        shown += (await client.get(f"/batches/{batch_id}")).text
    for episode_id in recorded.group:
        assert f"/episodes/{episode_id}" in shown
    assert "/turns/" in shown


def test_a_filter_is_a_deep_link_that_parses_back() -> None:
    query = parse_query({"policy": ["main"], "tag": ["a=b", "c=d"], "errors": ["1"], "page": ["3"]})
    link = query.link()
    assert link == "?policy=main&tag=a%3Db&tag=c%3Dd&errors=1&page=3"
    assert query.link(page=1) == "?policy=main&tag=a%3Db&tag=c%3Dd&errors=1"
    # Each change replaces the query's own value (encoded once per query), in the fields' order.
    assert (
        query.link(tag=("k=v w",), task="t/1 & 2", page=1)
        == "?policy=main&task=t%2F1+%26+2&tag=k%3Dv+w&errors=1"
    )
    assert query.link(policy=None, tag=(), errors=False, sort="reward", page=1) == "?sort=reward"
    assert parse_query({}).link() == "?"
    assert query.link() == link  # the first encoding is not changed by the links made from it
    with pytest.raises(TypeError, match="no field 'pages'"):
        query.link(pages=2)
    with pytest.raises(BadRequest, match="per: 500 is out of range"):
        parse_query({"per": ["500"]})


async def test_a_superuser_login_is_refused_unless_allowed(store: EventStore, database_url: str) -> None:
    app = create_app(database_url)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://ui") as client:
        response = await client.get("/episodes")
    assert response.status_code == 503
    assert "superuser" in response.text
    allowed = create_app(database_url, allow_superuser=True)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=allowed), base_url="http://ui") as client:
        response = await client.get("/episodes")
    assert response.status_code == 200
    assert "no episodes in the episodes read model yet" in response.text
    await allowed.state.browser.close()


async def test_mounted_in_the_gateway_it_asks_for_the_admin_key_and_links_under_its_path(
    store: EventStore, database_url: str, logins: dict[str, tuple[str, str]]
) -> None:
    recorded = await record_episodes(store)
    gateway = create_gateway(None, None, admin_key="the-admin-key")
    browser = mount_browser(gateway, login_url(database_url, logins["turnstile_reader"]), "the-admin-key")
    transport = httpx.ASGITransport(app=gateway)
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
        refused = await client.get("/ui/episodes")
        assert refused.status_code == 401
        assert refused.headers["www-authenticate"].startswith("Basic ")
        wrong = await client.get("/ui/episodes", auth=("me", "not-the-key"))
        assert wrong.status_code == 401
        page = await client.get("/ui/episodes", auth=("me", "the-admin-key"))
        assert page.status_code == 200
        assert f'href="/ui/episodes/{recorded.branching}"' in page.text
        bearer = await client.get(
            f"/ui/episodes/{recorded.branching}", headers={"Authorization": "Bearer the-admin-key"}
        )
        assert bearer.status_code == 200
        assert "2 lineages, branching" in bearer.text
    await browser.state.browser.close()


def test_charts_place_points_bands_and_bars_by_hand() -> None:
    drawn = svg.line_chart(
        [0.0, 1.0, 2.0], [0.0, 0.5, 1.0], low=[-1.0, 0.0, 0.5], high=[1.0, 1.0, 2.0],
        xlabel="version", ylabel="reward", title="t <b>",
    )  # fmt: skip
    # y spans -1..2 over pixels 166..12: 0.5 sits at 166 - 1.5/3 * 154 = 89; x 1 at (58 + 622) / 2 = 340
    assert '<circle class="dot" cx="340.0" cy="89.0"' in drawn
    assert drawn.count("<polygon") == 1
    assert "t &lt;b&gt;" in drawn
    assert "<b>" not in drawn
    bars = svg.bar_chart([(0, 2.0), (3, 4.0)], slots=4, x_low=0, x_high=40, xlabel="s", ylabel="n", title="b")
    assert bars.count('<rect class="bar"') == 2
    # slot 3 of 4 over 640 - 52 - 12 - 4 = 572 pixels from 54: x = 54 + 3 * 143 + 0.5; 4 of 4 reaches the top
    assert '<rect class="bar" x="483.5" y="12.0"' in bars
    assert (
        svg.line_chart([], [], xlabel="", ylabel="", title="") == '<p class="empty">nothing to plot yet</p>'
    )


async def test_the_reader_engine_cannot_write_even_what_its_login_could(
    store: EventStore, database_url: str
) -> None:
    engine = reader_engine(
        database_url
    )  # the owner's login: the connection is still read-only, as the reader
    try:
        async with engine.connect() as connection:
            role = await connection.scalar(sa.text("SELECT current_user"))
            assert role == "turnstile_reader"
            assert await connection.scalar(sa.text("SHOW transaction_read_only")) == "on"
        async with engine.connect() as connection:
            with pytest.raises(sqlalchemy.exc.DBAPIError, match="read-only transaction"):
                await connection.execute(sa.text("DELETE FROM episodes"))
    finally:
        await engine.dispose()


async def test_several_tags_stay_in_the_form(browsing: Browsing) -> None:
    page = (await browsing.client.get("/episodes?tag=split%3Dtrain&tag=suite%3Da")).text
    assert 'name="tag" value="split=train"' in page
    assert 'name="tag" value="suite=a"' in page
    assert listed(page) == []  # no episode has both


async def test_a_rerun_shows_the_divergence_beside_the_recorded_turn(
    store: EventStore, database_url: str, logins: dict[str, tuple[str, str]]
) -> None:
    """CountingAgent's three turns recorded by hand; RewordedCountingAgent asks otherwise at turn 2."""
    turns = await record_counting_episode(store)
    before = await store.head()
    reader = login_url(database_url, logins["turnstile_reader"])
    apps = {
        "off": create_app(reader),
        "same": create_app(reader, reruns=True),
        "changed": create_app(
            reader, reruns=True, rerun_agent="tests.support.replay_agents:RewordedCountingAgent"
        ),
    }
    pages = {}
    for name, app in apps.items():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://ui") as client:
            pages[name] = await client.get("/episodes/counting-1/rerun")
        await app.state.browser.close()
    assert pages["off"].status_code == 404
    assert "turnstile ui --rerun" in pages["off"].text
    assert pages["same"].status_code == 200
    assert "identical" in pages["same"].text
    assert "3 of 3 recorded turns replayed" in pages["same"].text
    changed = pages["changed"].text
    assert "diverged at" in changed
    assert f'id="turn-{turns[1].turn_id}"' in changed
    assert "the rerun diverged here" in changed
    assert '<span class="del">-  now say 2</span>' in changed
    assert '<span class="add">+  now please say 2</span>' in changed
    assert await store.head() == before  # nothing written


async def test_a_gateway_episode_offers_no_rerun_link_and_its_rerun_says_why(
    store: EventStore, database_url: str, logins: dict[str, tuple[str, str]]
) -> None:
    """A gateway session records the name its client gave, not code: its agent ran outside Turnstile."""
    await record_counting_episode(store)
    await record_counting_episode(store, "gateway-1", agent="gateway")
    app = create_app(login_url(database_url, logins["turnstile_reader"]), reruns=True)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://ui") as client:
        runner_page = await client.get("/episodes/counting-1")
        gateway_page = await client.get("/episodes/gateway-1")
        rerun = await client.get("/episodes/gateway-1/rerun")
    await app.state.browser.close()
    assert 'id="rerun-link"' in runner_page.text
    assert gateway_page.status_code == 200
    assert 'id="rerun-link"' not in gateway_page.text
    assert rerun.status_code == 400
    assert "recorded through the gateway" in rerun.text


def test_turnstile_ui_refuses_to_start_on_a_superuser_login_or_a_bad_option(database_url: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TURNSTILE_")}
    env["TURNSTILE_READER_URL"] = database_url  # the tests' server login is a superuser
    done = subprocess.run(
        [sys.executable, "-m", "consumers.cli", "ui", "--port", "0"], env=env, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 2
    assert "superuser" in done.stderr
    assert "--allow-superuser" in done.stderr
    lone = subprocess.run(
        [sys.executable, "-m", "consumers.cli", "ui", "--rerun-agent", "a.b:C"], env=env, capture_output=True,
        text=True, timeout=120,
    )  # fmt: skip
    assert lone.returncode == 2
    assert "add --rerun" in lone.stderr


async def test_a_run_shows_staleness_at_training_time_and_the_batches_skipped(
    browsing: Browsing, database_url: str
) -> None:
    client = browsing.client
    before = (await client.get("/runs/main")).text
    assert "no trainer yet" in before
    batch_ids = sorted(
        set(re.findall(r'href="/batches/([0-9a-zA-Z_-]+)"', (await client.get("/batches")).text))
    )
    assert batch_ids
    with psycopg.connect(
        database_url
    ) as connection:  # one batch trained into v3 (stepped on v2), one skipped
        for batch_id, version, outcome in zip(batch_ids, (3, 5), ("trained", "stale"), strict=False):
            connection.execute(
                "INSERT INTO trained_batches (trainer, batch_id, policy, policy_version, outcome) "
                "VALUES ('t', %s, 'main', %s, %s)",
                (batch_id, version, outcome),
            )
    run = (await client.get("/runs/main")).text
    card = run.split('id="skipped"')[1].split("</div></div>")[0]
    skipped, taken = (1, 2) if len(batch_ids) > 1 else (0, 1)
    assert f'<div class="big">{skipped} / {taken}</div>' in card
    assert f"{round(100 * skipped / taken, 1)}% of those a trainer took" in card
    section = run.split('id="staleness-trained"')[1].split("</section>")[0]
    assert "staleness at training time" in section
    assert "nothing to plot yet" not in section
