"""The ``turnstile`` command: the composition root, one module per command group.

``servers`` (up, migrate, export-schemas, model init-tiny / init-long), ``runs`` (run, submit, demo),
``serve`` (the services), ``harness`` (harness run), ``data`` (rematerialize, sql, replay, episodes, plot,
ui); shared option types are in ``common``.
A command imports the services and library pieces it runs when it runs: importing all of them takes seconds,
which ``turnstile --help`` and every quick command would otherwise pay.
"""

from __future__ import annotations

import sys
from typing import NoReturn

from consumers.cli import data, harness, logins, runs, serve, servers
from consumers.cli.common import Typer, console
from pipeline.errors import TurnstileError

app = Typer(help="Turnstile: collect RL rollouts from LLM agents.", no_args_is_help=True)
serve_app = Typer(help="Run a Turnstile service.", no_args_is_help=True)
model_app = Typer(help="Model directories.", no_args_is_help=True)
harness_app = Typer(help="Agent CLIs per task in sandboxes, verified.", no_args_is_help=True)

app.command()(servers.up)
app.command()(servers.migrate)
app.command("export-schemas")(servers.export_schemas)
app.command()(runs.run)
app.command()(runs.submit)
app.command()(runs.demo)
app.command()(data.rematerialize)
# ignore_unknown_options: a query may begin with a comment ("-- reward by version ..."), which click would
# otherwise take for an option.
app.command(context_settings={"ignore_unknown_options": True})(data.sql)
app.command()(data.replay)
app.command()(data.episodes)
app.command()(data.plot)
app.command()(data.ui)

app.add_typer(serve_app, name="serve")
serve_app.command("inference")(serve.inference)
serve_app.command("runner")(serve.runner)
serve_app.command("materializer")(serve.materializer)
serve_app.command("relay")(serve.relay)
serve_app.command("trainer")(serve.trainer)
serve_app.command("gateway")(serve.gateway)
serve_app.command("harness")(harness.serve)

app.add_typer(harness_app, name="harness")
harness_app.command("run")(harness.run)

app.add_typer(model_app, name="model")
model_app.command("init-tiny")(servers.init_tiny_model)
model_app.command("init-long")(servers.init_long_model)


def main() -> None:
    try:
        app()
    except TurnstileError as error:
        fail(str(error))
    except Exception as error:
        denied = logins.permission_denied(error)
        if denied is None:
            raise
        fail(logins.refusal(logins.command_of(sys.argv[1:]), denied))


def fail(message: str) -> NoReturn:
    # soft_wrap: one line whatever the terminal's width (a script greps it; a log keeps it whole)
    console.print(f"[red]error:[/red] {message}", soft_wrap=True, highlight=False)
    raise SystemExit(2) from None
