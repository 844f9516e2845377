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

from pipeline.errors import ConfigError, TurnstileError, describe_validation_error
from pipeline.settings import SERVERS_FILE, Settings
from schemas import SamplingParams

if TYPE_CHECKING:
    from pipeline.materializer import MaterializerConfig

app = typer.Typer(help="Turnstile: collect RL rollouts from LLM agents.", no_args_is_help=True)
console = Console(stderr=True)


@app.command()
def up(
    data_dir: Path = typer.Option(
        None, help="where the servers keep their data [default: $TURNSTILE_DATA_DIR or .turnstile]"
    ),
) -> None:
    """Start embedded PostgreSQL and NATS (JetStream) on free ports, migrate, run until Ctrl-C or SIGTERM."""
    from pipeline.db import migrate
    from pipeline.embedded import EmbeddedServers

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
    from pipeline.db import migrate as run_migrations

    run_migrations(Settings().require_database_url())
    console.print("[green]database is at the newest schema[/green]")


@app.command("export-schemas")
def export_schemas(
    directory: Path = typer.Argument(Path(__file__).parent.parent / "schemas" / "json"),
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
    import logging

    from consumers.inference import InferenceConfig, create_app

    if backend not in ("torch", "vllm", "scripted"):
        raise TurnstileError(f"unknown backend {backend!r}: use torch, vllm or scripted")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
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

    from consumers.runner import Connections, run_task_file
    from pipeline.episode import load_agent, load_reward_function
    from pipeline.progress import stats_table
    from pipeline.runner import RunnerConfig

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

    from pipeline.runner import TaskLineError, TaskSpec, read_tasks
    from pipeline.taskqueue import submit_tasks

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
    import logging

    from consumers.runner import Connections
    from consumers.runner import serve_runner as serve
    from pipeline.episode import load_agent, load_reward_function
    from pipeline.runner import RunnerConfig

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
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
    from pipeline.materializer import MaterializerConfig

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
    import logging

    from consumers.materializer import serve_materializer as serve_it

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
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
    import logging

    from consumers.materializer import rematerialize as rebuild

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
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
    import logging

    from consumers.relay import RelayConfig
    from consumers.relay import serve_relay as serve

    if poll_interval <= 0:
        raise ConfigError(f"--poll-interval must be more than 0, got {poll_interval}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
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

    from pipeline.sql import SqlError, run_readonly, to_csv, to_json, to_table

    if as_csv and as_json:
        raise ConfigError("--csv and --json: choose one")
    if limit is not None and limit < 0:
        raise ConfigError(f"--limit must be 0 or more, got {limit}")
    if timeout <= 0:
        raise ConfigError(f"--timeout must be more than 0 seconds, got {timeout:g}")
    text = sys.stdin.read() if query == "-" else query
    search_path = None if schema in (None, "main", "public") else f"rm_{schema}"
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


@model.command("init-tiny")
def model_init_tiny(directory: Path = typer.Argument(..., help="where to write the model")) -> None:
    """Build a tiny random-init causal LM with a locally trained tokenizer (offline, byte-identical)."""
    from pipeline.tinymodel import build_tiny_model

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
