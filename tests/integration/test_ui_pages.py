"""What researchers asked of the episode browser (issue 35), through the app over real PostgreSQL as the
reader login: free-text search over what turns say (and that it goes through its index at size), two
episodes side by side, the pages as JSON, and each turn's tokens and whole rendered prompt without
hovering."""

from __future__ import annotations

import hashlib
import re
import uuid
from typing import Any

import psycopg
import pytest
from alembic import command

from consumers.materializer import rematerialize
from pipeline.errors import ConfigError
from pipeline.log import EventStore
from pipeline.log.db import alembic_config
from pipeline.materialize.config import MaterializerConfig
from pipeline.materialize.rebuild import READ_MODEL_TABLES
from pipeline.materialize.writer import Materializer
from pipeline.settings import libpq_url
from pipeline.ui.search import SEARCH
from schemas import ChatMessage, EpisodeFinished, EpisodeStarted
from tests.conftest import login_url
from tests.integration.test_rebuild_equivalence import varied_log, write_log
from tests.support.ui_episodes import AGENT, Browsing, make_turn

APPEND_LOCK = 32780231638217836  # pipeline/log/store.py: the guard lets only its holder append


def hits(html: str) -> list[str]:
    return re.findall(r'<tr data-turn="([^"]+)">', html)


async def test_search_finds_turns_by_their_words_newest_first_a_page_at_a_time(browsing: Browsing) -> None:
    client, recorded = browsing.client, browsing.recorded
    a, b, c, _ = recorded.branching_turns
    reasoning = await client.get("/search?q=calculator")
    assert reasoning.status_code == 200
    assert hits(reasoning.text) == [str(a.turn_id)]  # "I should use the calculator tool." (its reasoning)
    assert "<mark>calculator</mark>" in reasoning.text
    assert f'href="/episodes/{recorded.branching}#turn-{a.turn_id}"' in reasoning.text
    # the tool's result "51" is a new message of b and c, and both replies say 51: newest first
    assert hits((await client.get("/search?q=51")).text) == [str(c.turn_id), str(b.turn_id)]
    assert hits((await client.get('/search?q="so 51"')).text) == [str(c.turn_id)]
    assert hits((await client.get("/search?q=51 -answer")).text) == [str(c.turn_id)]
    assert 'id="no-hits"' in (await client.get("/search?q=zanzibar")).text
    # the system prompt, in every turn recorded with it (these are recorded whole): 4 x 2 of the group, 3
    everything = (await client.get("/api/search?q=careful")).json()
    positions = [turn["position"] for turn in everything["turns"]]
    assert len(positions) == 11
    assert positions == sorted(positions, reverse=True)
    assert everything["before"] is None  # one page
    older = (await client.get(f"/api/search?q=careful&before={positions[1]}")).json()
    assert [turn["position"] for turn in older["turns"]] == positions[2:]
    assert "careful" in older["turns"][0]["snippet"]


async def test_a_bad_search_gets_a_400_naming_what_was_wrong(browsing: Browsing) -> None:
    client = browsing.client
    for query, said in (
        (f"q={'x' * 501}", "a search takes at most 500"),
        ("q=a&before=soon", "before: &#39;soon&#39; is not a log position"),
        ("q=a&colour=red", "unknown parameter &#39;colour&#39;"),
    ):
        response = await client.get(f"/search?{query}")
        assert response.status_code == 400
        assert said in response.text
    as_json = await client.get("/api/search?q=a&before=soon")
    assert as_json.status_code == 400
    assert as_json.json()["message"] == "before: 'soon' is not a log position (a whole number)"


def _fill_log(database_url: str, turns: int) -> None:
    """``turns`` TurnCompleted events of a word each, a common one and two of a long tail (as text has: the
    planner's statistics of ``words`` then know a word outside its most common ones is rare), appended as
    the store appends (holding its lock, at the positions after the head) and folded as the materializer
    folds them (a ``turn_rows`` row each, whose trigger writes their words into ``turn_search``), then
    ANALYZE: a log the planner sees as big."""
    with psycopg.connect(libpq_url(database_url)) as connection:
        connection.execute("SELECT pg_advisory_xact_lock(%s)", (APPEND_LOCK,))
        connection.execute(
            """
            WITH appended AS (
                INSERT INTO events (position, stream, version, event_id, type, data, content_hash)
                SELECT head + i, 'episode-filler-' || i, 1, gen_random_uuid(), 'TurnCompleted',
                       jsonb_build_object(
                           'request', jsonb_build_object('messages', jsonb_build_array(
                               jsonb_build_object('role', 'user', 'content',
                               'common word' || i || ' topic' || mod(i, 1000) || ' detail' || mod(i, 7919)))),
                           'reply', jsonb_build_object('text', 'reply number ' || i)),
                       '\\x00'
                FROM (SELECT coalesce(max(position), 0) AS head FROM events) h, generate_series(1, %s) i
                RETURNING position
            )
            INSERT INTO turn_rows (turn_id, episode, position, reward, discounted_return, turn_index,
                                   prompt_tokens, completion_tokens, policy_version, prefix_break)
            SELECT gen_random_uuid(), position, position, 0, 0, 0, 1, 1, 0, false FROM appended
            """,
            (turns,),
        )
        connection.commit()
    with psycopg.connect(libpq_url(database_url), autocommit=True) as connection:
        connection.execute("ANALYZE events, turn_search")


def _plan(database_url: str, words: str) -> str:
    statement = SEARCH.replace(":q", "%(q)s").replace(":before", "%(before)s")
    with psycopg.connect(libpq_url(database_url)) as connection:
        rows = connection.execute(f"EXPLAIN {statement}", {"q": words, "before": 2**63 - 1}).fetchall()
    return "\n".join(row[0] for row in rows)


async def test_a_search_reads_the_index_or_the_newest_turns_never_the_whole_log(
    store: EventStore, database_url: str
) -> None:
    _fill_log(database_url, 30_000)
    rare = _plan(database_url, "word12345")
    assert "turn_search_words" in rare, rare
    assert "Seq Scan" not in rare, rare
    common = _plan(database_url, "common")  # every turn says it: the newest 51, backwards by position
    assert "Seq Scan" not in common, common
    assert "Limit" in common, common


async def _fold(database_url: str) -> None:
    """The live materializer catches up, logged in as its own role."""
    materializer = Materializer(database_url, MaterializerConfig(batch_samples=4))
    await materializer.open()
    try:
        await materializer.catch_up()
    finally:
        await materializer.close()


async def test_search_finds_a_running_episodes_turns_once_the_materializer_login_has_passed_them(
    browsing: Browsing, store: EventStore, database_url: str, logins: dict[str, tuple[str, str]]
) -> None:
    """Appends do not index words (migration 0023): the live materializer does, in its own transaction, as
    it tails the log (migration 0024), for its own login, which may not write ``turn_search`` itself. A
    running episode's turns are found before it finishes, and once each after it has (its turns reaching
    ``turn_rows`` add no second row)."""
    materializer = libpq_url(login_url(database_url, logins["turnstile_materializer"]))
    episode_id = f"late-{uuid.uuid4().hex[:20]}"
    question = [ChatMessage(role="user", content="Where is Zanzibar?")]
    first = make_turn(question, text="Off Tanzania.", seed=61)
    follow_up = [*question, ChatMessage(role="assistant", content="Off Tanzania."),
                 ChatMessage(role="user", content="And Zanzibar's capital?")]  # fmt: skip
    second = make_turn(follow_up, text="Stone Town.", parent=first, seed=62)
    started = EpisodeStarted(episode_id=episode_id, task_id="geo-1", agent=AGENT, policy="main")
    await store.append(f"episode-{episode_id}", [started, first, second], expected_version=0)

    async def found(words: str) -> list[tuple[str, str]]:
        turns = (await browsing.client.get(f"/api/search?q={words}")).json()["turns"]
        return [(hit["episode_id"], hit["turn_id"]) for hit in turns]

    assert await found("zanzibar") == []  # appended, not folded yet
    await _fold(materializer)
    assert await found("zanzibar") == [(episode_id, str(second.turn_id)), (episode_id, str(first.turn_id))]
    assert await found('"stone town"') == [(episode_id, str(second.turn_id))]
    page = await browsing.client.get("/search?q=zanzibar")
    assert hits(page.text) == [str(second.turn_id), str(first.turn_id)]
    await store.append(f"episode-{episode_id}", [EpisodeFinished(termination="done")], expected_version=3)
    await _fold(materializer)
    assert await found("zanzibar") == [(episode_id, str(second.turn_id)), (episode_id, str(first.turn_id))]
    with psycopg.connect(libpq_url(database_url)) as connection:
        rows = connection.execute(
            "SELECT count(*), count(DISTINCT t.position) FROM turn_search s "
            "JOIN turn_rows t ON t.position = s.position JOIN episodes e ON e.started_position = t.episode "
            "WHERE e.episode_id = %s",
            (episode_id,),
        ).fetchone()
    assert rows == (2, 2)  # both turns folded into turn_rows, each indexed once
    for role in ("turnstile_materializer", "turnstile_reader"):
        login = libpq_url(login_url(database_url, logins[role]))
        with psycopg.connect(login) as connection, pytest.raises(psycopg.errors.InsufficientPrivilege):
            connection.execute("DELETE FROM turn_search")


async def test_a_turn_with_more_words_than_a_tsvector_holds_is_found_by_its_start_and_stops_nothing(
    browsing: Browsing, store: EventStore, database_url: str, logins: dict[str, tuple[str, str]]
) -> None:
    """A tool result of 40,000 different hashes is more different words than a tsvector holds (1 MB):
    ``turnstile_turn_text`` fails on it. The materializer's step goes on, and the turn is found by the words
    of its first 250,000 characters, whether the tail indexes it or the trigger on ``turn_rows`` does."""
    materializer = libpq_url(login_url(database_url, logins["turnstile_materializer"]))
    hashes = " ".join(hashlib.md5(str(i).encode()).hexdigest() for i in range(40_000))
    said = f"Zanzibar inventory: {hashes} endofdump"
    turn = make_turn([ChatMessage(role="user", content=said)], text="Noted.", seed=71)
    episode_id = f"dump-{uuid.uuid4().hex[:20]}"
    started = EpisodeStarted(episode_id=episode_id, task_id="dump-1", agent=AGENT, policy="main")
    await store.append(f"episode-{episode_id}", [started, turn], expected_version=0)
    with (
        psycopg.connect(libpq_url(database_url)) as connection,
        pytest.raises(psycopg.errors.ProgramLimitExceeded, match="too long for tsvector"),
    ):
        connection.execute(
            "SELECT turnstile_turn_text(data) FROM events WHERE type = 'TurnCompleted' AND stream = %s",
            (f"episode-{episode_id}",),
        )

    async def found(words: str) -> list[str]:
        turns = (await browsing.client.get(f"/api/search?q={words}")).json()["turns"]
        return [hit["turn_id"] for hit in turns]

    await _fold(materializer)  # the tail: turnstile_index_turns
    assert await found("zanzibar inventory") == [str(turn.turn_id)]
    assert await found(hashlib.md5(b"100").hexdigest()) == [str(turn.turn_id)]
    assert await found("endofdump") == []  # past the first 250,000 characters
    with psycopg.connect(libpq_url(database_url)) as connection:  # as if a materializer before 0024 ran
        connection.execute("DELETE FROM turn_search WHERE episode_id = %s", (episode_id,))
    await store.append(f"episode-{episode_id}", [EpisodeFinished(termination="done")], expected_version=2)
    await _fold(materializer)  # the trigger on turn_rows
    assert await found("zanzibar inventory") == [str(turn.turn_id)]


def _indexed_words(database_url: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(libpq_url(database_url)) as connection:
        return connection.execute(
            "SELECT position, episode_id, words::text FROM turn_search ORDER BY position"
        ).fetchall()


async def test_a_rebuild_and_its_replace_leave_search_as_it_was(
    browsing: Browsing, database_url: str
) -> None:
    """A rebuild's ``turn_rows`` (schema ``rm_<name>``) has no trigger: ``rematerialize`` and ``--replace``
    neither fail on it nor touch the words the live read models indexed."""
    indexed = _indexed_words(database_url)
    assert len(indexed) > 10
    with psycopg.connect(libpq_url(database_url)) as connection:
        live_turns = connection.execute("SELECT count(*) FROM turn_rows").fetchone()
    assert live_turns is not None
    assert live_turns[0] == len(indexed) - 1  # and the running episode's turn, which is in no turn_rows yet
    for replace in (False, True):
        rebuilt = await rematerialize(database_url, MaterializerConfig(name="searched"), replace=replace)
        await rebuilt.close()
    with psycopg.connect(libpq_url(database_url)) as connection:
        rebuilt_turns = connection.execute("SELECT count(*) FROM rm_searched.turn_rows").fetchone()
        assert rebuilt_turns is not None
        assert rebuilt_turns == live_turns
        elsewhere = connection.execute(
            "SELECT count(*) FROM pg_trigger g JOIN pg_class c ON c.oid = g.tgrelid "
            "JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname = 'rm_searched' AND NOT g.tgisinternal"
        ).fetchone()
        assert elsewhere == (0,)
    assert _indexed_words(database_url) == indexed
    assert hits((await browsing.client.get("/search?q=calculator")).text) == [
        str(browsing.recorded.branching_turns[0].turn_id)
    ]


async def test_the_live_search_index_refolded_from_the_log_is_what_the_tail_wrote(database_url: str) -> None:
    """The read models' invariant, for ``turn_search``: the live materializer tailing a varied log a few
    events a step (episodes running across steps, finished, never finished, skipped) indexes what a refold of
    the whole log in one catch-up gives, in one process or with the fold's worker processes. What it holds:
    the turns in ``turn_rows``, and those of episodes running at the end or whose fold was skipped."""
    log = varied_log()
    write_log(database_url, log)
    tailed = await _fold_main(database_url, step_events=7)
    assert tailed.position == len(log)
    indexed = _indexed_words(database_url)
    with psycopg.connect(libpq_url(database_url)) as connection:
        in_turn_rows = {p for (p,) in connection.execute("SELECT position FROM turn_rows").fetchall()}
        unfinished = {p for (p,) in connection.execute(
            "SELECT e.position FROM events e JOIN episodes ep ON ep.stream = e.stream "
            "WHERE e.type = 'TurnCompleted' AND (ep.status = 'running' OR ep.error LIKE 'not materialized%%')"
        ).fetchall()}  # fmt: skip
    assert unfinished
    assert in_turn_rows.isdisjoint(unfinished)
    assert {position for position, _, _ in indexed} == in_turn_rows | unfinished
    for worker in (False, True):
        _forget_live_read_models(database_url)
        assert _indexed_words(database_url) == []
        refolded = await _fold_main(database_url, fold_worker=worker)
        assert refolded.position == len(log)
        assert _indexed_words(database_url) == indexed, f"fold worker {worker}"


async def _fold_main(database_url: str, **options: Any) -> Materializer:
    """The live materializer ``main`` caught up (``options``: of its config, and ``fold_worker``)."""
    materializer = Materializer(database_url, MaterializerConfig(batch_samples=8, **{
        key: value for key, value in options.items() if key != "fold_worker"
    }))  # fmt: skip
    materializer.fold_worker = options.get("fold_worker")
    await materializer.open()
    try:
        await materializer.catch_up()
    finally:
        await materializer.close()
    return materializer


def _forget_live_read_models(database_url: str) -> None:
    """The live read models, search index and checkpoint emptied (as their owner): ``main`` folds anew."""
    with psycopg.connect(libpq_url(database_url)) as connection:
        rollups = [name for (name,) in connection.execute(
            "SELECT tablename FROM pg_tables WHERE schemaname = 'public' AND tablename LIKE '%%rollups'"
        ).fetchall()]  # fmt: skip
        tables = [*READ_MODEL_TABLES, "turn_search", *rollups]
        connection.execute(f"TRUNCATE {', '.join(tables)}")
        connection.execute("DELETE FROM checkpoints WHERE name = 'materializer:main'")
        connection.execute("DELETE FROM materializers WHERE name = 'main'")


def _index_names(database_url: str) -> set[str]:
    with psycopg.connect(libpq_url(database_url)) as connection:
        rows = connection.execute("SELECT indexname FROM pg_indexes WHERE schemaname = 'public'").fetchall()
    return {name for (name,) in rows}


async def test_migrating_indexes_the_turns_folded_already_and_downgrading_restores_the_old_index(
    browsing: Browsing, database_url: str
) -> None:
    indexed = _indexed_words(database_url)
    config = alembic_config(database_url)
    command.downgrade(config, "0023")  # 0023's index holds the turns of turn_rows only
    assert _indexed_words(database_url) == [row for row in indexed if row[1] != browsing.recorded.running]
    command.downgrade(config, "0022")
    names = _index_names(database_url)
    assert "events_turn_text" in names
    assert "turn_search_words" not in names
    command.upgrade(config, "head")
    names = _index_names(database_url)
    assert "events_turn_text" not in names
    assert "turn_search_words" in names
    # 0023 filled it from turn_rows, as the trigger did; 0024 with the running episode's turn
    assert _indexed_words(database_url) == indexed
    assert hits((await browsing.client.get("/search?q=51")).text) == [
        str(turn.turn_id) for turn in reversed(browsing.recorded.branching_turns[1:3])
    ]


async def test_the_live_materializer_names_a_database_not_migrated_for_it(database_url: str) -> None:
    command.downgrade(alembic_config(database_url), "0023")
    materializer = Materializer(database_url, MaterializerConfig())
    with pytest.raises(ConfigError, match=r"no turnstile_index_turns \(migration 0024.*turnstile migrate"):
        await materializer.open()
    await materializer.close()
    command.upgrade(alembic_config(database_url), "head")
    await materializer.open()  # migrated: it goes on
    await materializer.close()


async def test_two_episodes_side_by_side_aligned_by_turn(browsing: Browsing) -> None:
    client, recorded = browsing.client, browsing.recorded
    first, second = recorded.group[0], recorded.group[1]
    prefixes = await client.get(f"/compare?a={first[:10]}&b={second[:10]}", follow_redirects=False)
    assert prefixes.status_code == 307
    assert prefixes.headers["location"] == f"/compare?a={first}&b={second}"
    page = (await client.get(f"/compare?a={first}&b={second}")).text
    assert re.findall(r'data-episode="([^"]+)"', page) == [first, second]
    assert 'id="a-turn-1"' in page
    assert 'id="b-turn-2"' in page
    # turn 1 asks "What is 0 + 2?" beside "What is 1 + 2?": they differ from the first turn
    assert 'They first differ at <a href="#a-turn-1">turn 1</a>' in page
    assert "What is 0 + 2?" in page
    assert "What is 1 + 2?" in page
    verdicts = re.findall(r'data-turn="(\d)"[^>]*>turn \d: ([^<]+)<', page)
    assert verdicts == [
        ("1", "different messages, different reply"),
        ("2", "same messages, different reply"),
    ]
    same = (await client.get(f"/compare?a={first}&b={first}")).text
    assert "say the same at every turn" in same
    uneven = (await client.get(f"/compare?a={first}&b={recorded.failed}")).text
    assert uneven.count('class="missing"') == 1  # the failed episode has one turn
    assert (await client.get(f"/compare?a={first}")).status_code == 400
    assert (await client.get(f"/compare?a={first}&b=nosuchepisode")).status_code == 404
    assert 'id="compare-form"' in (await client.get("/compare")).text


async def test_the_pages_as_json(browsing: Browsing) -> None:
    client, recorded = browsing.client, browsing.recorded
    listing = await client.get("/api/episodes?policy=main&per=3&sort=started&order=asc")
    assert listing.headers["content-type"] == "application/json"
    body = listing.json()
    assert len(body["episodes"]) == 3
    assert body["next"] == "/api/episodes?policy=main&order=asc&page=2&per=3"
    second: dict[str, Any] = (await client.get(body["next"])).json()
    assert {e["episode_id"] for e in body["episodes"]}.isdisjoint(e["episode_id"] for e in second["episodes"])
    episode = (await client.get(f"/api/episodes/{recorded.branching}")).json()
    assert episode["episode_id"] == recorded.branching
    assert [turn["turn_id"] for turn in episode["turns"]] == [
        str(t.turn_id) for t in recorded.branching_turns
    ]
    first = episode["turns"][0]
    assert first["completion_logprobs"] == pytest.approx([-0.01, -0.2, -0.7, -1.6, -4.0], rel=1e-6)  # float32
    assert first["prompt_token_ids"] == list(recorded.branching_turns[0].prompt_token_ids)
    assert episode["read_model"]["status"] == "finished"
    assert episode["total_reward"] == 1.0
    run = (await client.get("/api/runs/main")).json()
    assert run["stats"]["episodes"] == 7
    assert {row["termination"] for row in run["terminations"]} == {"done", "error"}
    assert [row["policy"] for row in (await client.get("/api/runs")).json()["runs"]] == ["main", "other"]
    assert (await client.get("/api/batches")).json()["batches"]
    missing = await client.get("/api/episodes/nosuchepisode")
    assert missing.status_code == 404
    assert missing.json()["error"] == "No such episode"
    ambiguous = (await client.get("/api/episodes/group")).json()
    assert sorted(ambiguous["candidates"]) == sorted(recorded.group)
    assert (await client.get("/api/episodes?min_reward=lots")).json()["message"] == (
        "min_reward: 'lots' is not a number"
    )
    assert (await client.get("/api/runs/nosuchpolicy")).status_code == 404


async def test_tokens_ids_and_the_whole_prompt_without_hovering(browsing: Browsing) -> None:
    client, recorded = browsing.client, browsing.recorded
    a, b, _, _ = recorded.branching_turns
    page = (await client.get(f"/episodes/{recorded.branching}")).text
    tables = page.split('<details class="token-table"')[1:]
    assert len(tables) == 4
    assert all(not table.startswith(" open") for table in tables)  # folded until asked
    opened = (await client.get(f"/episodes/{recorded.branching}?tokens=1")).text
    assert opened.count('<details class="token-table" open') == 4
    # turn b adds 6 prompt ids to a's prompt and completion: those, then each completion token in a row
    second = tables[1]
    added = b.prompt_token_ids[len(a.prompt_token_ids) + len(a.completion_token_ids) :]
    assert len(added) == 6
    assert "6 prompt tokens added to turn 1's" in second
    assert " ".join(map(str, added)) in second
    rows = re.findall(r'<td class="num mono">(\d+)</td>.*?<td class="num">(-?[\d.]+)</td>', second)
    assert [(int(i), float(lp)) for i, lp in rows] == list(
        zip(b.completion_token_ids, [round(x, 4) for x in b.completion_logprobs], strict=True)
    )
    assert "alternatives" in second
    whole = await client.get(f"/episodes/{recorded.branching}/turns/2")
    assert whole.status_code == 200
    assert f"The whole prompt the engine saw ({len(b.prompt_token_ids)} tokens)" in whole.text
    assert " ".join(map(str, b.prompt_token_ids)) in whole.text
    assert (await client.get(f"/episodes/{recorded.branching}/turns/9")).status_code == 404
