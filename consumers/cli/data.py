"""``turnstile rematerialize``, ``sql``, ``replay`` and ``episodes``: reading and rebuilding the log."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Final

import typer
from rich.console import Console

from consumers.cli.common import (
    MaxBodyMib,
    ReadTimeout,
    Status,
    Termination,
    console,
    with_materializer_options,
)
from pipeline.errors import ConfigError, TurnstileError
from pipeline.settings import Settings

if TYPE_CHECKING:
    from pipeline.materialize import MaterializerConfig


@with_materializer_options
def rematerialize(
    name: str = typer.Option(..., help="the rebuild's name: its tables go to schema rm_<name>"),
    replace: bool = typer.Option(False, help="drop an earlier rebuild of that name first"),
    policy: str = typer.Option(
        None,
        help="the policy whose log is rebuilt: its database in TURNSTILE_DATABASE_URLS (docs/scale.md) "
        "\\[default: TURNSTILE_DATABASE_URL]",
        show_default=False,
    ),
    config: MaterializerConfig | None = None,
) -> None:
    """Rebuild read models and batches from position 0 into schema rm_NAME; the log and the live
    materializer are untouched. The same options give byte-identical batches."""
    import asyncio

    from consumers.materializer import rematerialize as rebuild
    from consumers.runtime import setup_logging

    setup_logging()
    if name == "main":
        raise ConfigError("'main' is the live materializer; give the rebuild another --name")
    assert config is not None  # with_materializer_options gives it
    done = asyncio.run(rebuild(Settings().require_database_url(policy), config, replace=replace))
    console.print(
        f"rebuilt [bold]{name}[/bold] up to position {done.position} in schema {config.schema}; "
        f'query it with turnstile sql --schema {name} "SELECT ..."'
    )
    if done.skipped:
        console.print(
            f"[bold yellow]{done.skipped} events could not be folded and were skipped[/bold yellow]: "
            f'turnstile sql --schema {name} "SELECT * FROM skipped_events"'
        )


def sql(
    query: str = typer.Argument(
        ..., help="one query (SELECT, WITH, VALUES, TABLE, EXPLAIN or SHOW); '-' reads it from stdin"
    ),
    as_csv: bool = typer.Option(False, "--csv", help="print CSV: a header line, NULL as an empty field"),
    as_json: bool = typer.Option(False, "--json", help="print a JSON array with an object per row"),
    schema: str | None = typer.Option(
        None,
        help="read the tables of the rebuild NAME (schema rm_NAME) before the live ones; the views stay live",
    ),
    limit: int | None = typer.Option(None, help="fetch at most N rows"),
    timeout: float = typer.Option(60.0, help="seconds the query may run before it is cancelled"),
    allow_superuser: bool = typer.Option(
        False, help="run even when the login is a superuser (a query could then act as that superuser)"
    ),
) -> None:
    """Run one read-only query (as role turnstile_reader) and print its rows as a table, CSV or JSON.

    Connects with TURNSTILE_READER_URL (else TURNSTILE_DATABASE_URL); refuses a superuser login.

    Views: episode_stats, reward_by_policy_version, group_rewards, turn_latency_by_consumer,
    prefix_break_rate_by_agent, batch_staleness, terminations; worked queries in docs/queries.sql.
    """
    from rich.markup import escape

    from pipeline.materialize import rebuild_schema
    from pipeline.sql import SqlError, run_readonly, to_csv, to_json, to_table

    if as_csv and as_json:
        raise ConfigError("--csv and --json: choose one")
    if limit is not None and limit < 0:
        raise ConfigError(f"--limit must be 0 or more, got {limit}")
    if timeout <= 0:
        raise ConfigError(f"--timeout must be more than 0 seconds, got {timeout:g}")
    text = sys.stdin.read() if query == "-" else query
    search_path = None if schema in (None, "main", "public") else rebuild_schema(schema)
    reader_url = Settings().require_reader_url()
    try:
        result = run_readonly(
            reader_url,
            text,
            search_path=search_path,
            limit_rows=limit,
            timeout_s=timeout,
            allow_superuser=allow_superuser,
        )
    except SqlError as error:
        # main() prints errors as rich markup; PostgreSQL's words and the query may hold [brackets].
        raise TurnstileError(escape(str(error))) from None
    if as_csv:
        sys.stdout.write(to_csv(result))
    elif as_json:
        sys.stdout.write(to_json(result))
    elif result.columns:
        # In a terminal the table fits its width; piped, it keeps its natural width rather than folding at 80.
        Console(width=None if sys.stdout.isatty() else 100_000).print(to_table(result))
    shown = f"{len(result.rows)} row{'' if len(result.rows) == 1 else 's'}"
    console.print(f"{shown} (more not fetched: --limit {limit})" if result.truncated else shown)


def replay(
    episode_id: str = typer.Argument(
        None, help="the episode's id, or enough of its beginning to be unambiguous"
    ),
    until: int = typer.Option(None, help="show the state as of turn N (the fold of the events up to it)"),
    tokens: bool = typer.Option(False, "--tokens", help="show completion tokens shaded by logprob"),
    model_dir: Path = typer.Option(
        None, "--model", help="a local tokenizer directory: --tokens shows decoded token texts, not ids"
    ),
    as_json: bool = typer.Option(False, "--json", help="print the folded episode (or the rerun) as JSON"),
    discount: float = typer.Option(1.0, help="discounted returns: a turn's reward + discount x its child's"),
    rerun: bool = typer.Option(
        False, "--rerun", help="run the agent again on the recorded replies and report the first divergence"
    ),
    agent: str = typer.Option(None, help="--rerun: this agent instead of the recorded one (pkg.mod:Name)"),
    all_episodes: bool = typer.Option(False, "--all", help="--rerun every episode --where selects"),
    where: str = typer.Option(
        None, help="--all: an SQL condition over the episodes read model, e.g. \"policy = 'main'\""
    ),
    timeout: float = typer.Option(60.0, help="--rerun: seconds the agent may take per episode"),
) -> None:
    """Show a recorded episode as a transcript, or rerun its agent on the recorded replies.

    Reads the log itself (no materializer needed), as TURNSTILE_READER_URL (the reader login, or a read
    replica's URL) else TURNSTILE_DATABASE_URL. --rerun writes nothing and exits 1 when one diverged.

    --all --where selects the episodes from the episodes read model (read-only SQL).
    """
    asked = ReplayRequest(
        episode_id, until, tokens, model_dir, as_json, discount, rerun, agent, all_episodes, where, timeout
    )
    for conflict, message in asked.conflicts():
        if conflict:
            raise ConfigError(message)
    database_url = Settings().require_reader_url()  # reads only: a read replica will do
    # In a terminal the output fits its width; piped (a file, CI) it is 120 columns, without colour.
    out = Console(width=None if sys.stdout.isatty() else 120)
    mode = "all" if all_episodes else "rerun" if rerun else "show"
    _REPLAY_MODES[mode](asked, database_url, out)


@dataclass(frozen=True)
class ReplayRequest:
    """What ``turnstile replay`` was asked, as its options."""

    episode_id: str
    """None (as typer gives it) with --all."""
    until: int | None
    tokens: bool
    model_dir: Path | None
    as_json: bool
    discount: float
    rerun: bool
    agent: str | None
    all_episodes: bool
    where: str | None
    timeout: float

    def conflicts(self) -> list[tuple[bool, str]]:
        """Each option conflict and its message, in the order checked: the first true one is told."""
        return [
            (
                not self.rerun and bool(self.agent or self.all_episodes or self.where),
                "--agent, --all and --where rerun episodes: add --rerun",
            ),
            (
                self.rerun and bool(self.tokens or self.model_dir),
                "--tokens and --model show a transcript; they do not combine with --rerun",
            ),
            (
                self.where is not None and not self.all_episodes,
                "--where selects the episodes of --all; add --all (or give one EPISODE_ID)",
            ),
            (
                self.all_episodes == (self.episode_id is not None),
                "give one EPISODE_ID, or --rerun --all [--where CONDITION], not both",
            ),
            (
                self.all_episodes and self.until is not None,
                "--until is for one episode; it does not combine with --all",
            ),
            (not 0.0 <= self.discount <= 1.0, f"--discount must be within [0, 1], got {self.discount}"),
            (self.timeout <= 0, f"--timeout must be more than 0 seconds, got {self.timeout:g}"),
        ]


def _replay_show(asked: ReplayRequest, database_url: str, out: Console) -> None:
    """One episode as a transcript (or JSON)."""
    import asyncio

    from pipeline.log import EventStore
    from pipeline.replay import (
        episode_json,
        load_episode,
        load_tokenizer,
        render_transcript,
        resolve_episode_id,
    )

    tokenizer = load_tokenizer(asked.model_dir) if asked.model_dir else None

    async def show() -> None:
        store = await EventStore.connect(database_url)
        try:
            found = await resolve_episode_id(store, asked.episode_id)
            replayed = await load_episode(store, found, until=asked.until)
        finally:
            await store.close()
        if asked.as_json:
            sys.stdout.write(json.dumps(episode_json(replayed, asked.discount), indent=2) + "\n")
        else:
            shaded = asked.tokens or tokenizer is not None
            out.print(
                render_transcript(replayed, discount=asked.discount, tokens=shaded, tokenizer=tokenizer)
            )

    asyncio.run(show())
    raise SystemExit(0)


def _replay_rerun(asked: ReplayRequest, database_url: str, out: Console) -> None:
    """One episode's agent rerun on its recorded replies; exits 1 when it diverged."""
    import asyncio

    from pipeline.log import EventStore
    from pipeline.replay import RerunResult, render_rerun, rerun_by_id, resolve_episode_id

    async def rerun() -> RerunResult:
        store = await EventStore.connect(database_url)
        try:
            found = await resolve_episode_id(store, asked.episode_id)
            return await rerun_by_id(
                store, found, agent=asked.agent, until=asked.until, timeout=asked.timeout
            )
        finally:
            await store.close()

    result = asyncio.run(rerun())
    if asked.as_json:
        sys.stdout.write(json.dumps(result.to_json(), indent=2) + "\n")
    else:
        out.print(render_rerun(result))
    raise SystemExit(0 if result.identical else 1)


def _replay_all(asked: ReplayRequest, database_url: str, out: Console) -> None:
    """Every episode ``--where`` selects rerun; exits 1 when one diverged or failed."""
    import asyncio

    from rich.markup import escape

    from pipeline.log import EventStore
    from pipeline.replay import RerunResult, RerunSummary, render_rerun, rerun_all
    from pipeline.sql import SqlError, episode_ids_where

    def shown(episode_id: str, outcome: RerunResult | TurnstileError) -> None:
        if asked.as_json:
            return
        if isinstance(outcome, TurnstileError):
            out.print(f"[bold red]failed[/bold red]    {escape(episode_id)}  {escape(str(outcome))}")
        else:
            out.print(render_rerun(outcome))

    async def many(ids: list[str]) -> RerunSummary:
        store = await EventStore.connect(database_url)
        try:
            return await rerun_all(store, ids, agent=asked.agent, timeout=asked.timeout, each=shown)
        finally:
            await store.close()

    try:
        # As the user that reruns (and appends) anyway: --where cannot do more than that user can.
        ids = episode_ids_where(database_url, asked.where, allow_superuser=True)
    except SqlError as error:
        raise TurnstileError(f"--where: {escape(str(error))}") from None
    if not ids:
        console.print(
            "no episode matched (--all --where reads the episodes read model, which "
            "`turnstile serve materializer` fills)"
        )
        return
    summary = asyncio.run(many(ids))
    if asked.as_json:
        results = [result.to_json() for result in summary.results]
        errors = [{"episode_id": episode, "error": error} for episode, error in summary.errors]
        sys.stdout.write(json.dumps({"results": results, "errors": errors}, indent=2) + "\n")
    else:
        out.print(summary.line())
    if summary.diverged or summary.errors:
        raise SystemExit(1)


_REPLAY_MODES: Final[dict[str, Callable[[ReplayRequest, str, Console], None]]] = {
    "show": _replay_show,
    "rerun": _replay_rerun,
    "all": _replay_all,
}
"""``turnstile replay``'s modes: a transcript, one rerun, or every selected episode rerun."""


def episodes(
    policy: str = typer.Option(None, help="only this policy"),
    status: Status = typer.Option(None, help="running | finished"),
    termination: Termination = typer.Option(
        None, help="only episodes ended so: done, max_turns, truncated, error, cancelled, timeout, aborted"
    ),
    agent: str = typer.Option(None, help="only this agent (as recorded: package.module:Name)"),
    min_reward: float = typer.Option(None, help="only episodes whose rewards sum to at least this"),
    max_reward: float = typer.Option(None, help="only episodes whose rewards sum to at most this"),
    since: str = typer.Option(None, help="started since: 30m, 1h, 2d, 1w ago, or a date/time (local)"),
    limit: int = typer.Option(20, help="show at most N episodes"),
    as_json: bool = typer.Option(False, "--json", help="print a JSON array with an object per episode"),
    lineages: bool = typer.Option(
        False,
        "--lineages",
        help="also each episode's lineages: their turns, which are trained, and why each root started "
        "(first call, side call, edit, template break, new conversation), by the materializer's default rule",
    ),
) -> None:
    """List recorded episodes, newest first, from the log itself (no materializer needed), as
    TURNSTILE_READER_URL (the reader login, or a read replica's URL) else TURNSTILE_DATABASE_URL."""
    import asyncio

    from pipeline.log import EventStore
    from pipeline.materialize import MaterializerConfig, TurnLineage, lineages_of_records
    from pipeline.replay import (
        EpisodeFilter,
        EpisodeRow,
        episode_row_json,
        episodes_table,
        lineages_json,
        lineages_table,
        list_episodes,
        parse_since,
    )

    if limit < 1:
        raise ConfigError(f"--limit must be at least 1, got {limit}")
    filters = EpisodeFilter(
        policy=policy,
        status=None if status is None else status.value,
        termination=None if termination is None else termination.value,
        agent=agent,
        min_reward=min_reward,
        max_reward=max_reward,
        since=parse_since(since) if since else None,
        limit=limit,
    )
    database_url = Settings().require_reader_url()  # reads only: a read replica will do

    async def fetch() -> tuple[list[EpisodeRow], bool, dict[str, list[TurnLineage]]]:
        store = await EventStore.connect(database_url)
        try:
            rows, more = await list_episodes(store, filters)
            found: dict[str, list[TurnLineage]] = {}
            for row in rows if lineages else []:
                records = await store.read_stream(f"episode-{row.episode_id}")
                found[row.episode_id] = lineages_of_records(records, MaterializerConfig())
            return rows, more, found
        finally:
            await store.close()

    rows, more, found = asyncio.run(fetch())
    wide = Console(width=None if sys.stdout.isatty() else 100_000)
    if as_json:
        objects = [episode_row_json(row) for row in rows]
        for shown_row in objects if lineages else []:
            shown_row["lineages"] = lineages_json(found[shown_row["episode_id"]])
        sys.stdout.write(json.dumps(objects, indent=2) + "\n")
    elif rows:
        wide.print(episodes_table(rows))
        for row in rows if lineages else []:
            wide.print(lineages_table(row.episode_id, found[row.episode_id]))
    shown = f"{len(rows)} episode{'' if len(rows) == 1 else 's'}, newest first"
    console.print(f"{shown} (more: --limit {limit * 2})" if more else shown)


def plot(
    charts: list[str] = typer.Argument(
        None,
        help="which: reward_curve, reward_by_version, staleness, throughput \\[default: all four]",
        show_default=False,
    ),
    policy: str = typer.Option("demo", help="the policy whose runs are drawn"),
    out: Path | None = typer.Option(
        None,
        help="the directory the PNG files go to (NAME.png) "
        "\\[default: $TURNSTILE_DATA_DIR/plots or .turnstile/plots]",
        show_default=False,
    ),
    schema: str | None = typer.Option(None, help="read the tables of the rebuild NAME (schema rm_NAME)"),
    allow_superuser: bool = typer.Option(
        False, help="run even when the login is a superuser (see turnstile sql)"
    ),
) -> None:
    """Draw the standard plots of a policy from the read models, at any time (read-only, as role
    turnstile_reader, like turnstile sql): reward while training and per policy version with 95% bands,
    staleness of batches, throughput, drawn by matplotlib."""
    from rich.markup import escape

    from pipeline.dev import CHART_NAMES, NO_MATPLOTLIB, PlotsUnavailable, draw, have_matplotlib, read_charts
    from pipeline.materialize import rebuild_schema
    from pipeline.sql import SqlError

    if not have_matplotlib():
        raise PlotsUnavailable(NO_MATPLOTLIB)  # before reading anything: one line, no traceback
    names = charts or list(CHART_NAMES)
    unknown = sorted(set(names) - set(CHART_NAMES))
    if unknown:
        raise ConfigError(f"unknown plot {', '.join(unknown)}; plots: {', '.join(CHART_NAMES)}")
    search_path = None if schema in (None, "main", "public") else rebuild_schema(schema)
    try:
        drawn = read_charts(
            Settings().require_reader_url(),
            policy,
            names,
            search_path=search_path,
            allow_superuser=allow_superuser,
        )
    except SqlError as error:
        raise TurnstileError(escape(str(error))) from None
    directory = out or Settings().data_dir / "plots"
    for chart in drawn:
        path = draw(chart, directory / f"{chart.name}.png")
        console.print(f"{chart.title}: {path}" + (" (no data yet)" if chart.empty else ""))


def ui(
    host: str = typer.Option("127.0.0.1", help="the address to listen on (0.0.0.0: every interface)"),
    port: int = typer.Option(8080, help="the port to listen on (0: a free one)"),
    model: list[str] = typer.Option(
        None,
        "--model",
        help="a local tokenizer directory to decode completion tokens: DIR for every policy, or POLICY=DIR "
        "(repeatable)",
    ),
    allow_superuser: bool = typer.Option(
        False, help="run even when the login is a superuser (a query could then act as that superuser)"
    ),
    rerun: bool = typer.Option(
        False,
        "--rerun",
        help="serve /episodes/ID/rerun: the episode's agent rerun in this process on its recorded replies "
        "(turnstile replay --rerun; writes nothing), its divergence beside the recorded turn. Runs code",
    ),
    rerun_agent: str = typer.Option(
        None, help="--rerun: this agent instead of the recorded one (pkg.mod:Name)"
    ),
    max_body_mib: MaxBodyMib = 32.0,
    read_timeout: ReadTimeout = 30.0,
) -> None:
    """Serve the episode browser: find, read and compare episodes, runs and batches in a web browser.

    Read-only: connects with TURNSTILE_READER_URL (else TURNSTILE_DATABASE_URL), as role turnstile_reader
    in read-only transactions; refuses a superuser login. Deep links: /episodes?FILTERS, /episodes/ID,
    /turns/TURN_ID, /runs/POLICY, /batches/BATCH_ID.
    """
    import asyncio

    from consumers.runtime import setup_logging
    from consumers.ui import UiConfig, serve_ui

    if rerun_agent and not rerun:
        raise ConfigError("--rerun-agent is the agent of --rerun: add --rerun")
    tokenizer_dirs: dict[str, Path] = {}
    for given in model or []:
        policy, equals, directory = given.rpartition("=")
        if equals and not policy:
            raise ConfigError(f"--model {given!r}: give DIR or POLICY=DIR")
        tokenizer_dirs[policy or "*"] = Path(directory)
    setup_logging()
    config = UiConfig(
        reader_url=Settings().require_reader_url(),
        host=host,
        port=port,
        allow_superuser=allow_superuser,
        tokenizer_dirs=tokenizer_dirs,
        reruns=rerun,
        rerun_agent=rerun_agent,
        max_body_bytes=round(max_body_mib * 1024 * 1024),
        read_timeout=read_timeout,
    )
    asyncio.run(serve_ui(config, console=console))
