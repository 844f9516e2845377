"""The ``turnstile`` command."""

from __future__ import annotations

import json
import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from pydantic import ValidationError
from rich.console import Console

import schemas
from pipeline.errors import ConfigError, TurnstileError, describe_validation_error
from pipeline.settings import SERVERS_FILE, Settings
from schemas import SamplingParams

if TYPE_CHECKING:
    from pipeline.materialize.materializer import MaterializerConfig

app = typer.Typer(help="Turnstile: collect RL rollouts from LLM agents.", no_args_is_help=True)
console = Console(stderr=True)


@app.command()
def up(
    data_dir: Path = typer.Option(
        None, help="where the servers keep their data [default: $TURNSTILE_DATA_DIR or .turnstile]"
    ),
) -> None:
    """Start embedded PostgreSQL and NATS (JetStream) on free ports, migrate, run until Ctrl-C or SIGTERM."""
    from pipeline.dev.embedded import EmbeddedServers
    from pipeline.log.db import migrate

    directory = data_dir or Settings().data_dir
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    console.print(f"starting PostgreSQL and NATS in {directory.absolute()} ...")
    with EmbeddedServers(directory) as servers:
        migrate(servers.postgres.url)
        exports = servers.exports()
        servers_file = servers.data_dir / SERVERS_FILE
        servers_file.write_text(exports)
        sys.stdout.write(exports)
        sys.stdout.flush()
        console.print(
            "[green]ready[/green]: paste the lines above into other shells (also in "
            f"{servers_file}, which other turnstile commands in this directory read); Ctrl-C stops both "
            "servers, the data stays."
        )
        try:
            while not stop.wait(0.5):
                if servers.postgres.process is None or servers.postgres.process.poll() is not None:
                    raise TurnstileError(
                        "PostgreSQL exited unexpectedly; see its log in " + str(servers.postgres.data_dir)
                    )
                if servers.nats.process is None or servers.nats.process.poll() is not None:
                    raise TurnstileError(
                        "nats-server exited unexpectedly; see its log in " + str(servers.nats.data_dir)
                    )
        finally:
            servers_file.unlink(missing_ok=True)
        console.print("stopping ...")
    console.print("stopped.")


@app.command()
def migrate() -> None:
    """Bring the database named by TURNSTILE_DATABASE_URL to the newest schema (idempotent)."""
    from pipeline.log.db import migrate as run_migrations

    run_migrations(Settings().require_database_url())
    console.print("[green]database is at the newest schema[/green]")


@app.command("export-schemas")
def export_schemas(
    directory: Path = typer.Argument(Path(schemas.__file__).parent / "json"),
) -> None:
    """Write the JSON Schema of every event and wire message (for agents in other languages)."""
    from schemas import json_schemas

    directory.mkdir(parents=True, exist_ok=True)
    for name, schema in json_schemas().items():
        (directory / name).write_text(json.dumps(schema, indent=2, sort_keys=True) + "\n")
    console.print(f"wrote {len(json_schemas())} schemas to {directory}")


serve = typer.Typer(help="Run a Turnstile service.", no_args_is_help=True)
model = typer.Typer(help="Model directories.", no_args_is_help=True)
app.add_typer(serve, name="serve")
app.add_typer(model, name="model")


@serve.command("inference")
def serve_inference(
    policy: str = typer.Option(..., help="the policy served: requests arrive on llm.<policy>.requests"),
    backend: str = typer.Option(
        "torch", help="torch | vllm | scripted (instant fixed replies, for benchmarks)"
    ),
    model_dir: Path = typer.Option(None, "--model", help="a Hugging Face model directory (local)"),
    consumer_id: str = typer.Option(
        "", help="this consumer's id in sticky subjects [default: host-pid-random]"
    ),
    max_batch: int = typer.Option(16, help="torch backend: requests batched together"),
) -> None:
    """Answer LLM requests for POLICY over NATS (queue group `inference`), reloading published versions."""
    import asyncio

    from consumers.inference import InferenceConfig, create_app

    if backend not in ("torch", "vllm", "scripted"):
        raise TurnstileError(f"unknown backend {backend!r}: use torch, vllm or scripted")
    _service_logging()
    config = InferenceConfig(
        nats_url=Settings().require_nats_url(),
        policy=policy,
        backend=backend,  # type: ignore[arg-type]
        model=model_dir,
        consumer_id=consumer_id,
        max_batch=max_batch,
    )
    application, service = create_app(config)
    console.print(
        f"inference consumer [bold]{service.consumer_id}[/bold] serving policy {policy!r} ({backend})"
    )
    asyncio.run(application.run())


def _sampling(temperature: float, max_tokens: int, seed: int | None) -> SamplingParams:
    try:
        return SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed)
    except ValidationError as error:
        raise ConfigError(f"sampling options: {describe_validation_error(error)}") from None


def _tags(pairs: list[str]) -> dict[str, str]:
    tags = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ConfigError(f"--tag {pair!r}: write it as key=value")
        tags[key] = value
    return tags


def _service_logging() -> None:
    """Log lines with times for long-running services."""
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


AGENT_HELP = "the agent, as package.module:Name (e.g. pipeline.examples.calculator:CalculatorAgent)"


@app.command()
def run(
    agent: str = typer.Option(..., help=AGENT_HELP),
    tasks: Path = typer.Option(..., help="a JSONL file, one task object per line"),
    policy: str = typer.Option(..., help="the policy: requests go to llm.<policy>.requests"),
    group_size: int = typer.Option(1, help="episodes per task (one group, for group-relative advantages)"),
    concurrency: int = typer.Option(64, help="episodes in flight at most"),
    max_turns: int = typer.Option(None, help="LLM turns an episode may take [default: no limit]"),
    retries: int = typer.Option(1, help="times an episode that ends in error is run again"),
    timeout: float = typer.Option(None, help="seconds an episode may take [default: no limit]"),
    reward: str = typer.Option(None, help="reward function package.module:name (task, episode) -> float"),
    temperature: float = typer.Option(1.0, help="sampling temperature"),
    max_tokens: int = typer.Option(256, help="completion tokens per turn at most"),
    seed: int = typer.Option(None, help="sampling seed"),
    tag: list[str] = typer.Option([], help="key=value recorded with every episode (repeatable)"),
) -> None:
    """Run AGENT on every task of a file, recording every episode; Ctrl-C cancels cleanly."""
    import asyncio

    from consumers.runner import run_task_file
    from consumers.runtime import Connections
    from pipeline.runners import load_agent, load_reward_function
    from pipeline.runners.progress import stats_table
    from pipeline.runners.runner import RunnerConfig

    settings = Settings()
    connections = Connections(settings.require_database_url(), settings.require_nats_url())
    loaded = load_agent(agent)
    reward_fn = load_reward_function(reward) if reward else None
    if not tasks.is_file():
        raise ConfigError(f"task file {str(tasks)!r} does not exist")
    config = RunnerConfig(
        policy=policy,
        agent_name=agent,
        group_size=group_size,
        concurrency=concurrency,
        max_turns=max_turns,
        retries=retries,
        timeout=timeout,
        sampling=_sampling(temperature, max_tokens, seed),
        tags=_tags(tag),
    )
    result = asyncio.run(
        run_task_file(connections, loaded, config, tasks, reward_fn=reward_fn, console=console)
    )
    console.print(stats_table(result.stats, "cancelled" if result.cancelled else "finished"))
    if result.cancelled:
        raise SystemExit(130)


@app.command()
def submit(
    tasks: Path = typer.Argument(..., help="a JSONL file, one task object per line"),
    policy: str = typer.Option(..., help="tasks go to the work queue subject tasks.<policy>"),
    group_size: int = typer.Option(1, help="episodes per task"),
) -> None:
    """Put every task of a file on the JetStream work queue TASKS for `turnstile serve runner`."""
    import asyncio

    import nats

    from pipeline.runners.runner import TaskLineError, TaskSpec, read_tasks
    from pipeline.runners.taskqueue import submit_tasks

    if group_size < 1:
        raise ConfigError(f"--group-size must be at least 1, got {group_size}")
    specs: list[TaskSpec] = []
    for item in read_tasks(tasks):
        if isinstance(item, TaskLineError):
            console.print(f"[red]task file {tasks}, {item}[/red] (skipped; the other tasks are submitted)")
        else:
            specs.append(item)

    async def send() -> int:
        connection = await nats.connect(Settings().require_nats_url())
        try:
            return len(await submit_tasks(connection, policy, specs, group_size=group_size))
        finally:
            await connection.drain()

    console.print(f"submitted {asyncio.run(send())} tasks to tasks.{policy} (group size {group_size})")


@serve.command("runner")
def serve_runner(
    agent: str = typer.Option(..., help=AGENT_HELP),
    policy: str = typer.Option(..., help="take tasks from tasks.<policy>, send requests to llm.<policy>"),
    concurrency: int = typer.Option(64, help="episodes in flight at most"),
    max_turns: int = typer.Option(None, help="LLM turns an episode may take [default: no limit]"),
    retries: int = typer.Option(1, help="times an episode that ends in error is run again"),
    timeout: float = typer.Option(None, help="seconds an episode may take [default: no limit]"),
    reward: str = typer.Option(None, help="reward function package.module:name (task, episode) -> float"),
    temperature: float = typer.Option(1.0, help="sampling temperature"),
    max_tokens: int = typer.Option(256, help="completion tokens per turn at most"),
    ack_wait: float = typer.Option(
        60.0, help="seconds without progress before a task goes to another runner"
    ),
    lease_timeout: float = typer.Option(
        30.0, help="seconds after which a silent runner's episodes are aborted"
    ),
    heartbeat_timeout: float = typer.Option(15.0, help="seconds an LLM call waits for a silent consumer"),
) -> None:
    """Take tasks from the TASKS work queue and run AGENT on them, on as many machines as you like."""
    import asyncio

    from consumers.runner import serve_runner as serve
    from consumers.runtime import Connections
    from pipeline.runners import load_agent, load_reward_function
    from pipeline.runners.runner import RunnerConfig

    _service_logging()
    settings = Settings()
    connections = Connections(
        settings.require_database_url(),
        settings.require_nats_url(),
        heartbeat_timeout=heartbeat_timeout,
        lease_timeout=lease_timeout,
    )
    loaded = load_agent(agent)
    reward_fn = load_reward_function(reward) if reward else None
    config = RunnerConfig(
        policy=policy,
        agent_name=agent,
        concurrency=concurrency,
        max_turns=max_turns,
        retries=retries,
        timeout=timeout,
        sampling=_sampling(temperature, max_tokens, None),
    )
    asyncio.run(serve(connections, loaded, config, reward_fn=reward_fn, ack_wait=ack_wait, console=console))
    console.print("runner stopped")


def _materializer_config(
    name: str,
    discount: float,
    style: str,
    advantage: str,
    batch_samples: int,
    batch_tokens: int | None,
    max_staleness: int | None,
    stale: str,
    group_timeout: float,
    step_events: int,
) -> MaterializerConfig:
    from pipeline.materialize.materializer import MaterializerConfig

    return MaterializerConfig(
        name=name,
        discount=discount,
        style=style,  # type: ignore[arg-type]
        advantage=advantage,  # type: ignore[arg-type]
        batch_samples=batch_samples,
        batch_tokens=batch_tokens,
        max_staleness=max_staleness,
        stale=stale,  # type: ignore[arg-type]
        group_timeout_s=group_timeout,
        step_events=step_events,
    )


DISCOUNT = typer.Option(1.0, help="reward backprop: a turn's value = its reward + discount x its child's")
STYLE = typer.Option("individual", help="individual (a sample per turn) | concat (a sample per path)")
ADVANTAGE = typer.Option("grpo", help="grpo (r - mean) / std over the group | mean (r - mean) | none (r)")
BATCH_SAMPLES = typer.Option(64, help="samples per batch (groups are kept whole)")
BATCH_TOKENS = typer.Option(None, help="tokens per batch instead of a sample count")
MAX_STALENESS = typer.Option(None, help="samples older than newest version - N are stale [default: never]")
STALE = typer.Option("drop", help="drop stale samples from batches, or flag them")
GROUP_TIMEOUT = typer.Option(600.0, help="log seconds a group waits for missing members before it goes out")
STEP_EVENTS = typer.Option(2000, help="events folded per transaction")


@serve.command("materializer")
def serve_materializer(
    name: str = typer.Option("main", help="the read models' name (main: the public tables)"),
    discount: float = DISCOUNT,
    style: str = STYLE,
    advantage: str = ADVANTAGE,
    batch_samples: int = BATCH_SAMPLES,
    batch_tokens: int = BATCH_TOKENS,
    max_staleness: int = MAX_STALENESS,
    stale: str = STALE,
    group_timeout: float = GROUP_TIMEOUT,
    step_events: int = STEP_EVENTS,
) -> None:
    """Fold the log into read models and training batches as events arrive (exactly once)."""
    import asyncio

    from consumers.materializer import serve_materializer as serve_it

    _service_logging()
    config = _materializer_config(
        name, discount, style, advantage, batch_samples, batch_tokens, max_staleness, stale, group_timeout,
        step_events,
    )  # fmt: skip
    console.print(f"materializer {name!r} running ({config.semantics()})")
    done = asyncio.run(serve_it(Settings().require_database_url(), config))
    console.print(f"materializer stopped at position {done.position}")


@app.command()
def rematerialize(
    name: str = typer.Option(..., help="the rebuild's name: its tables go to schema rm_<name>"),
    discount: float = DISCOUNT,
    style: str = STYLE,
    advantage: str = ADVANTAGE,
    batch_samples: int = BATCH_SAMPLES,
    batch_tokens: int = BATCH_TOKENS,
    max_staleness: int = MAX_STALENESS,
    stale: str = STALE,
    group_timeout: float = GROUP_TIMEOUT,
    step_events: int = STEP_EVENTS,
    replace: bool = typer.Option(False, help="drop an earlier rebuild of that name first"),
) -> None:
    """Rebuild read models and batches from position 0 into schema rm_NAME; the log and the live
    materializer are untouched. The same options give byte-identical batches."""
    import asyncio

    from consumers.materializer import rematerialize as rebuild

    _service_logging()
    if name == "main":
        raise ConfigError("'main' is the live materializer; give the rebuild another --name")
    config = _materializer_config(
        name, discount, style, advantage, batch_samples, batch_tokens, max_staleness, stale, group_timeout,
        step_events,
    )  # fmt: skip
    done = asyncio.run(rebuild(Settings().require_database_url(), config, replace=replace))
    console.print(
        f"rebuilt [bold]{name}[/bold] up to position {done.position} in schema {config.schema}; "
        f'query it with turnstile sql --schema {name} "SELECT ..."'
    )


@serve.command("relay")
def serve_relay(
    schema: str = typer.Option("public", help="the schema whose batch_outbox is published"),
    poll_interval: float = typer.Option(
        1.0, help="seconds between passes when no NOTIFY wakes the relay sooner"
    ),
) -> None:
    """Publish the materializer's batches to JetStream BATCHES (batches.<policy>), each once."""
    import asyncio

    from consumers.relay import RelayConfig
    from consumers.relay import serve_relay as serve

    if poll_interval <= 0:
        raise ConfigError(f"--poll-interval must be more than 0, got {poll_interval}")
    _service_logging()
    settings = Settings()
    config = RelayConfig(
        settings.require_database_url(),
        settings.require_nats_url(),
        schema=schema,
        poll_interval=poll_interval,
    )
    asyncio.run(serve(config, console=console))
    console.print("relay stopped")


# ignore_unknown_options: a query may begin with a comment ("-- reward by version ..."), which click would
# otherwise take for an option.
@app.command(context_settings={"ignore_unknown_options": True})
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
) -> None:
    """Run one read-only query (as role turnstile_reader) and print its rows as a table, CSV or JSON.

    Views: episode_stats, reward_by_policy_version, group_rewards, turn_latency_by_consumer,
    prefix_break_rate_by_agent, batch_staleness, terminations; worked queries in docs/queries.sql.
    """
    from rich.markup import escape

    from pipeline.materialize import rebuild_schema
    from pipeline.sql.readonly import SqlError, run_readonly, to_csv, to_json, to_table

    if as_csv and as_json:
        raise ConfigError("--csv and --json: choose one")
    if limit is not None and limit < 0:
        raise ConfigError(f"--limit must be 0 or more, got {limit}")
    if timeout <= 0:
        raise ConfigError(f"--timeout must be more than 0 seconds, got {timeout:g}")
    text = sys.stdin.read() if query == "-" else query
    search_path = None if schema in (None, "main", "public") else rebuild_schema(schema)
    database_url = Settings().require_database_url()
    try:
        result = run_readonly(
            database_url, text, search_path=search_path, limit_rows=limit, timeout_s=timeout
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


@serve.command("trainer")
def serve_trainer(
    policy: str = typer.Option(..., help="train on batches.<policy>; publish policy.<policy>.versions"),
    model_dir: Path = typer.Option(..., "--model", help="the starting weights (a local model directory)"),
    checkpoints: Path = typer.Option(..., help="where checkpoints v000001, v000002, ... are written"),
    durable: str = typer.Option("trainer", help="this trainer's name (its JetStream consumer and record)"),
    lr: float = typer.Option(3e-3, help="Adam learning rate"),
    clip: float = typer.Option(0.2, help="PPO ratio clip"),
    version_every: int = typer.Option(1, help="batches per published policy version"),
    max_staleness: int = typer.Option(None, help="skip batches more than N versions behind [default: never]"),
    ack_wait: float = typer.Option(120.0, help="seconds before an unfinished batch is delivered again"),
    seed: int = typer.Option(0, help="torch seed"),
    threads: int = typer.Option(1, help="torch CPU threads"),
) -> None:
    """PPO-clip on the batch stream; checkpoints and publishes new policy versions (exactly once)."""
    import asyncio

    from consumers.trainer import TrainerConfig
    from consumers.trainer import serve_trainer as serve_it

    _service_logging()
    settings = Settings()
    config = TrainerConfig(
        database_url=settings.require_database_url(),
        nats_url=settings.require_nats_url(),
        policy=policy,
        model=model_dir,
        checkpoints=checkpoints,
        durable=durable,
        lr=lr,
        clip=clip,
        version_every=version_every,
        max_staleness=max_staleness,
        ack_wait=ack_wait,
        seed=seed,
        threads=threads,
    )
    stats = asyncio.run(serve_it(config))
    console.print(f"trainer stopped at policy version {stats.version} ({stats.trained} batches trained)")


@app.command()
def demo(
    minutes: float = typer.Option(3.0, help="how long the loop runs"),
    data_dir: Path = typer.Option(
        None, help="servers, model, checkpoints and logs [default: $TURNSTILE_DATA_DIR or .turnstile]"
    ),
    seed: int = typer.Option(0, help="trainer seed"),
    concurrency: int = typer.Option(64, help="episodes in flight"),
) -> None:
    """The closed loop on this machine: embedded servers, tiny model, inference, materializer, relay,
    trainer and a runner on a task the model learns; live progress, then a summary and a reward curve."""
    from consumers.demo import DemoConfig, report, run_demo

    if minutes <= 0:
        raise ConfigError(f"--minutes must be positive, got {minutes}")
    config = DemoConfig(
        data_dir=data_dir or Settings().data_dir, minutes=minutes, seed=seed, concurrency=concurrency
    )
    summary = run_demo(config, console)
    report(summary, config, Console())


@app.command()
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

    Reads the log itself (no materializer needed). --rerun writes nothing and exits 1 when one diverged.

    --all --where selects the episodes from the episodes read model (read-only SQL).
    """
    import asyncio

    from rich.markup import escape

    from pipeline.log import EventStore
    from pipeline.replay import (
        RerunSummary,
        episode_json,
        load_episode,
        load_tokenizer,
        render_rerun,
        render_transcript,
        rerun_by_id,
        resolve_episode_id,
    )

    if not rerun and (agent or all_episodes or where):
        raise ConfigError("--agent, --all and --where rerun episodes: add --rerun")
    if rerun and (tokens or model_dir):
        raise ConfigError("--tokens and --model show a transcript; they do not combine with --rerun")
    if where is not None and not all_episodes:
        raise ConfigError("--where selects the episodes of --all; add --all (or give one EPISODE_ID)")
    if all_episodes == (episode_id is not None):
        raise ConfigError("give one EPISODE_ID, or --rerun --all [--where CONDITION], not both")
    if all_episodes and until is not None:
        raise ConfigError("--until is for one episode; it does not combine with --all")
    if not 0.0 <= discount <= 1.0:
        raise ConfigError(f"--discount must be within [0, 1], got {discount}")
    if timeout <= 0:
        raise ConfigError(f"--timeout must be more than 0 seconds, got {timeout:g}")
    database_url = Settings().require_database_url()
    # In a terminal the output fits its width; piped (a file, CI) it is 120 columns, without colour.
    out = Console(width=None if sys.stdout.isatty() else 120)
    tokenizer = load_tokenizer(model_dir) if model_dir else None

    async def one() -> int:
        store = await EventStore.connect(database_url)
        try:
            found = await resolve_episode_id(store, episode_id)
            if rerun:
                result = await rerun_by_id(store, found, agent=agent, until=until, timeout=timeout)
                if as_json:
                    sys.stdout.write(json.dumps(result.to_json(), indent=2) + "\n")
                else:
                    out.print(render_rerun(result))
                return 0 if result.identical else 1
            replayed = await load_episode(store, found, until=until)
            if as_json:
                sys.stdout.write(json.dumps(episode_json(replayed, discount), indent=2) + "\n")
            else:
                shaded = tokens or tokenizer is not None
                out.print(render_transcript(replayed, discount=discount, tokens=shaded, tokenizer=tokenizer))
            return 0
        finally:
            await store.close()

    async def many(ids: list[str]) -> RerunSummary:
        from pipeline.runners import load_agent

        summary = RerunSummary()
        loaded = {agent: load_agent(agent)} if agent else {}
        store = await EventStore.connect(database_url)
        try:
            for selected in ids:
                try:
                    result = await rerun_by_id(store, selected, agent=agent, timeout=timeout, agents=loaded)
                except TurnstileError as error:
                    summary.errors.append((selected, str(error)))
                    if not as_json:
                        out.print(f"[bold red]failed[/bold red]    {escape(selected)}  {escape(str(error))}")
                    continue
                summary.results.append(result)
                if not as_json:
                    out.print(render_rerun(result))
        finally:
            await store.close()
        return summary

    if not all_episodes:
        raise SystemExit(asyncio.run(one()))
    from pipeline.sql.readonly import SqlError, run_readonly

    try:
        rows = run_readonly(
            database_url, f"SELECT episode_id FROM episodes WHERE ({where or 'true'}) ORDER BY started_at"
        ).rows
    except SqlError as error:
        raise TurnstileError(f"--where: {escape(str(error))}") from None
    if not rows:
        console.print(
            "no episode matched (--all --where reads the episodes read model, which "
            "`turnstile serve materializer` fills)"
        )
        return
    summary = asyncio.run(many([str(row[0]) for row in rows]))
    if as_json:
        results = [result.to_json() for result in summary.results]
        errors = [{"episode_id": episode, "error": error} for episode, error in summary.errors]
        sys.stdout.write(json.dumps({"results": results, "errors": errors}, indent=2) + "\n")
    else:
        out.print(summary.line())
    if summary.diverged or summary.errors:
        raise SystemExit(1)


@app.command()
def episodes(
    policy: str = typer.Option(None, help="only this policy"),
    status: str = typer.Option(None, help="running | finished"),
    termination: str = typer.Option(
        None, help="only episodes ended so: done, max_turns, truncated, error, cancelled, timeout, aborted"
    ),
    agent: str = typer.Option(None, help="only this agent (as recorded: package.module:Name)"),
    min_reward: float = typer.Option(None, help="only episodes whose rewards sum to at least this"),
    max_reward: float = typer.Option(None, help="only episodes whose rewards sum to at most this"),
    since: str = typer.Option(None, help="started since: 30m, 1h, 2d, 1w ago, or a date/time (local)"),
    limit: int = typer.Option(20, help="show at most N episodes"),
    as_json: bool = typer.Option(False, "--json", help="print a JSON array with an object per episode"),
) -> None:
    """List recorded episodes, newest first, from the log itself (no materializer needed)."""
    import asyncio

    from pipeline.log import EventStore
    from pipeline.replay import (
        EpisodeFilter,
        EpisodeRow,
        episode_row_json,
        episodes_table,
        list_episodes,
        parse_since,
    )

    if status not in (None, "running", "finished"):
        raise ConfigError(f"--status {status!r}: use running or finished")
    if limit < 1:
        raise ConfigError(f"--limit must be at least 1, got {limit}")
    filters = EpisodeFilter(
        policy=policy,
        status=status,  # type: ignore[arg-type]
        termination=termination,
        agent=agent,
        min_reward=min_reward,
        max_reward=max_reward,
        since=parse_since(since) if since else None,
        limit=limit,
    )
    database_url = Settings().require_database_url()

    async def fetch() -> tuple[list[EpisodeRow], bool]:
        store = await EventStore.connect(database_url)
        try:
            return await list_episodes(store, filters)
        finally:
            await store.close()

    rows, more = asyncio.run(fetch())
    if as_json:
        sys.stdout.write(json.dumps([episode_row_json(row) for row in rows], indent=2) + "\n")
    elif rows:
        Console(width=None if sys.stdout.isatty() else 100_000).print(episodes_table(rows))
    shown = f"{len(rows)} episode{'' if len(rows) == 1 else 's'}, newest first"
    console.print(f"{shown} (more: --limit {limit * 2})" if more else shown)


@serve.command("gateway")
def serve_gateway(
    policy_default: str = typer.Option(None, help="the policy of sessions that name none"),
    host: str = typer.Option("127.0.0.1", help="the address to listen on (0.0.0.0: every interface)"),
    port: int = typer.Option(8000, help="the port to listen on (0: a free one)"),
    admin_key_env: str = typer.Option(
        "TURNSTILE_ADMIN_KEY", help="the environment variable that holds the admin key (required)"
    ),
    max_open_sessions: int = typer.Option(
        None, help="open sessions at most; starting one more gets 429 [default: no limit]"
    ),
    max_staleness: int = typer.Option(
        None,
        help="starting a session gets 429 while the newest published policy version is more than N ahead "
        "of the version the inference consumers answer with [default: never]",
    ),
    idle_timeout: float = typer.Option(
        3600.0, help="seconds without a call before a session ends as timeout (0: never)"
    ),
    public_url: str = typer.Option(
        None, help="the URL clients reach the gateway at, for the base_url it hands out [default: Host]"
    ),
    heartbeat_timeout: float = typer.Option(15.0, help="seconds an LLM call waits for a silent consumer"),
) -> None:
    """Serve the OpenAI- and Anthropic-compatible gateway: every call of a session is a recorded turn."""
    import asyncio
    import os

    from consumers.gateway import GatewayConfig
    from consumers.gateway import serve_gateway as serve_it

    admin_key = os.environ.get(admin_key_env, "").strip()
    if not admin_key:
        raise ConfigError(
            f"no admin key: set {admin_key_env} to a secret (e.g. `export {admin_key_env}=$(openssl rand "
            "-hex 32)`); it protects session creation, and the gateway does not start without one"
        )
    _service_logging()
    settings = Settings()
    config = GatewayConfig(
        database_url=settings.require_database_url(),
        nats_url=settings.require_nats_url(),
        admin_key=admin_key,
        policy_default=policy_default,
        host=host,
        port=port,
        capacity=max_open_sessions,
        max_staleness=max_staleness,
        idle_timeout=idle_timeout or None,
        public_url=public_url,
        heartbeat_timeout=heartbeat_timeout,
    )
    asyncio.run(serve_it(config, console=console))
    console.print("gateway stopped")


@model.command("init-tiny")
def model_init_tiny(directory: Path = typer.Argument(..., help="where to write the model")) -> None:
    """Build a tiny random-init causal LM with a locally trained tokenizer (offline, byte-identical)."""
    from pipeline.inference.tinymodel import build_tiny_model

    build_tiny_model(directory)
    console.print(f"tiny model written to {directory}")


def main() -> None:
    try:
        app()
    except TurnstileError as error:
        console.print(f"[red]error:[/red] {error}")
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
