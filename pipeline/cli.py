"""The ``turnstile`` command."""

from __future__ import annotations

import json
import signal
import sys
import threading
from pathlib import Path

import typer
from rich.console import Console

from pipeline.errors import TurnstileError
from pipeline.settings import Settings

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
        (servers.data_dir / "servers.env").write_text(exports)
        sys.stdout.write(exports)
        sys.stdout.flush()
        console.print(
            "[green]ready[/green]: paste the lines above into other shells (also in "
            f"{servers.data_dir / 'servers.env'}); Ctrl-C stops both servers, the data stays."
        )
        while not stop.wait(0.5):
            if servers.postgres.process is None or servers.postgres.process.poll() is not None:
                raise TurnstileError(
                    "PostgreSQL exited unexpectedly; see its log in " + str(servers.postgres.data_dir)
                )
            if servers.nats.process is None or servers.nats.process.poll() is not None:
                raise TurnstileError(
                    "nats-server exited unexpectedly; see its log in " + str(servers.nats.data_dir)
                )
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
