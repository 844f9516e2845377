"""``turnstile up``, ``migrate``, ``export-schemas`` and ``model init-tiny``: servers, schema and models."""

from __future__ import annotations

import json
import signal
import sys
import threading
from pathlib import Path

import typer

import schemas
from consumers.cli.common import console
from pipeline.settings import SERVERS_FILE, Settings


def up(
    data_dir: Path = typer.Option(
        None, help="where the servers keep their data \\[default: $TURNSTILE_DATA_DIR or .turnstile]"
    ),
    nats_cluster: int = typer.Option(
        1,
        min=1,
        max=9,
        help="NATS servers joined in a cluster (3: the task queues and BATCHES replicated x3, a node may go "
        "down); TURNSTILE_NATS_URL then names every node",
    ),
    reset: bool = typer.Option(
        False,
        "--reset",
        help="first remove this data directory's database, streams and checkpoints: start fresh",
    ),
    list_clusters: bool = typer.Option(
        False, "--list-clusters", help="list the clusters kept outside data directories (as root) and exit"
    ),
    prune: bool = typer.Option(
        False, "--prune", help="remove those outside clusters whose data directory is gone, and exit"
    ),
) -> None:
    """Start embedded PostgreSQL and NATS (JetStream) on free ports, migrate, run until Ctrl-C or SIGTERM."""
    import asyncio

    from pipeline.dev import EmbeddedNatsCluster, EmbeddedServers
    from pipeline.log import make_logins, migrate

    if list_clusters or prune:
        _clusters(prune)
        return
    directory = data_dir or Settings().data_dir
    if reset:
        EmbeddedServers(directory, nats_nodes=nats_cluster).reset()
        console.print(f"removed the database, streams and checkpoints of {directory.absolute()}")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    console.print(f"starting PostgreSQL and NATS in {directory.absolute()} ...")
    with EmbeddedServers(directory, nats_nodes=nats_cluster) as servers:
        if isinstance(servers.nats, EmbeddedNatsCluster):
            asyncio.run(servers.nats.replicate_streams())
        migrate(servers.postgres.url)
        # Everyday commands log in as users that are not superusers (a superuser's query can read server
        # files or stop other sessions); the superuser stays for migrations.
        exports = servers.exports(make_logins(servers.postgres.url))
        servers_file = servers.data_dir / SERVERS_FILE
        servers_file.write_text(exports)
        sys.stdout.write(exports)
        sys.stdout.flush()
        data_dir = servers.data_dir.absolute()
        where = f"in {data_dir}" + (f" or in {data_dir.parent}" if data_dir.name == ".turnstile" else "")
        console.print(
            "[green]ready[/green]: paste the lines above into other shells (also in "
            f"{servers_file}, which other turnstile commands read when run {where}, or anywhere with "
            f"TURNSTILE_DATA_DIR={data_dir}); Ctrl-C stops both servers, the data stays."
        )
        try:
            servers.watch(stop)
        finally:
            servers_file.unlink(missing_ok=True)
        console.print("stopping ...")
    console.print("stopped.")


def _clusters(prune: bool) -> None:
    """As root, a data directory ``nobody`` cannot reach keeps its PostgreSQL cluster under SYSTEM_DIR."""
    from pipeline.dev import SYSTEM_DIR, outside_clusters, prune_outside_clusters

    for cluster in prune_outside_clusters() if prune else []:
        console.print(f"removed {cluster.path} ({cluster.size / 1e6:,.0f} MB), left by {cluster.owner}")
    clusters = outside_clusters()
    for cluster in clusters:
        state = "running" if cluster.running else "orphaned" if cluster.orphaned else "in use"
        owner = cluster.owner or "unknown (made before owner markers; remove it by hand if unused)"
        console.print(f"{cluster.path}  {cluster.size / 1e6:,.0f} MB  {state}  data directory: {owner}")
    if not clusters:
        console.print(f"no clusters kept in {SYSTEM_DIR}")


def migrate() -> None:
    """Bring the database to the newest schema (idempotent), as TURNSTILE_ADMIN_DATABASE_URL (the database's
    owner) or else TURNSTILE_DATABASE_URL."""
    from pipeline.log import migrate as run_migrations

    run_migrations(Settings().require_admin_database_url())
    console.print("[green]database is at the newest schema[/green]")


def export_schemas(
    directory: Path = typer.Argument(Path(schemas.__file__).parent / "json"),
) -> None:
    """Write the JSON Schema of every event and wire message (for agents in other languages)."""
    written = schemas.json_schemas()
    directory.mkdir(parents=True, exist_ok=True)
    for name, schema in written.items():
        (directory / name).write_text(json.dumps(schema, indent=2, sort_keys=True) + "\n")
    console.print(f"wrote {len(written)} schemas to {directory}")


def init_tiny_model(directory: Path = typer.Argument(..., help="where to write the model")) -> None:
    """Build a tiny random-init causal LM with a locally trained tokenizer (offline, byte-identical)."""
    from pipeline.inference.tinymodel import build_tiny_model  # torch: imported only when asked for

    build_tiny_model(directory)
    console.print(f"tiny model written to {directory}")


def init_long_model(
    directory: Path = typer.Argument(..., help="where to write the model"),
    window: int = typer.Option(256, min=2, help="the sliding attention window of every layer, in tokens"),
) -> None:
    """Build the tiny model for agent prompts: 131,072-token context, sliding-window attention, so a turn
    costs the same at 60k prompt tokens as at 1k (offline, byte-identical)."""
    from pipeline.inference.tinymodel import build_long_model

    build_long_model(directory, window=window)
    console.print(f"long-context tiny model written to {directory}")
