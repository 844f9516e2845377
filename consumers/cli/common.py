"""What the command groups share: the console, option types declared once (choices as enums, so the CLI
validates them and ``--help`` lists them), and the small parsers of option values."""

from __future__ import annotations

import enum
from typing import Annotated, Any

import typer
import typer.core
from pydantic import ValidationError
from rich.console import Console

from pipeline.errors import ConfigError, describe_validation_error
from schemas import SamplingParams

console = Console(stderr=True)


def _no_type(ctx: Any) -> None:
    return None


def _without_flag_types(params: list[Any]) -> list[Any]:
    # typer's help prints a type beside every option (`--json <bool>`), which reads as if a flag took a
    # value; typer has no setting for it, so a flag's `display_type_rich` (what the help prints) says none.
    for param in params:
        if param.param_type_name == "option" and (param.is_flag or param.count):
            setattr(param, "display_type_rich", _no_type)  # noqa: B010 (a method, replaced on this object)
    return params


class Command(typer.core.TyperCommand):
    """A command whose ``--help`` shows no type beside an option that takes no value."""

    def get_params(self, ctx: Any) -> list[Any]:
        return _without_flag_types(super().get_params(ctx))


class Group(typer.core.TyperGroup):
    """A command group whose ``--help`` shows no type beside an option that takes no value."""

    def get_params(self, ctx: Any) -> list[Any]:
        return _without_flag_types(super().get_params(ctx))


class Typer(typer.Typer):
    """``typer.Typer`` whose groups and commands are :class:`Group` and :class:`Command`."""

    def __init__(self, **settings: Any) -> None:
        super().__init__(cls=Group, **settings)

    def command(self, *args: Any, **settings: Any) -> Any:
        return super().command(*args, **{"cls": Command, **settings})


class Backend(enum.StrEnum):
    torch = "torch"
    vllm = "vllm"
    scripted = "scripted"


class Style(enum.StrEnum):
    individual = "individual"
    concat = "concat"


class Advantage(enum.StrEnum):
    grpo = "grpo"
    mean = "mean"
    none = "none"


class Peers(enum.StrEnum):
    depth = "depth"
    slot = "slot"


class Stale(enum.StrEnum):
    drop = "drop"
    flag = "flag"


class Status(enum.StrEnum):
    running = "running"
    finished = "finished"


class Termination(enum.StrEnum):
    done = "done"
    max_turns = "max_turns"
    truncated = "truncated"
    error = "error"
    cancelled = "cancelled"
    timeout = "timeout"
    aborted = "aborted"


# -- options of `turnstile run` and `turnstile serve runner` --

AGENT_HELP = "the agent, as package.module:Name (e.g. pipeline.examples.calculator:CalculatorAgent)"
Agent = Annotated[str, typer.Option(help=AGENT_HELP)]
Concurrency = Annotated[int, typer.Option(help="episodes in flight at most")]
MaxTurns = Annotated[
    int | None, typer.Option(help="LLM turns an episode may take \\[default: no limit]", show_default=False)
]
Retries = Annotated[int, typer.Option(help="times an episode that ends in error is run again")]
EpisodeTimeout = Annotated[
    float | None, typer.Option(help="seconds an episode may take \\[default: no limit]", show_default=False)
]
Reward = Annotated[
    str | None,
    typer.Option(help="reward function package.module:name (task, episode) -> float", show_default=False),
]
Temperature = Annotated[float, typer.Option(help="sampling temperature")]
MaxTokens = Annotated[int, typer.Option(help="completion tokens per turn at most")]
HeartbeatTimeout = Annotated[float, typer.Option(help="seconds an LLM call waits for a silent consumer")]

# -- every `turnstile serve ...` service --

MetricsPort = Annotated[
    int | None,
    typer.Option(
        envvar="TURNSTILE_METRICS_PORT",
        help="serve Prometheus /metrics and /health on this port (0: a free one) \\[default: off]",
        show_default=False,
    ),
]

# -- options of `turnstile serve materializer` and `turnstile rematerialize` --

Discount = Annotated[
    float, typer.Option(help="reward backprop: a turn's value = its reward + discount x its child's")
]
StyleOption = Annotated[
    Style, typer.Option(help="individual (a sample per turn) | concat (a sample per path)")
]
AdvantageOption = Annotated[
    Advantage, typer.Option(help="grpo (r - mean) / std over the group | mean (r - mean) | none (r)")
]
PeersOption = Annotated[
    Peers,
    typer.Option(
        help="who a sample is compared with: depth (samples at the same depth of the episodes' turn trees, "
        "each episode weighing 1) | slot (the k-th sample of each episode: the rule before trees)"
    ),
]
BatchSamples = Annotated[int, typer.Option(help="samples per batch (groups are kept whole)")]
BatchTokens = Annotated[
    int | None, typer.Option(help="tokens per batch instead of a sample count", show_default=False)
]
SampleStaleness = Annotated[
    int | None,
    typer.Option(
        help="samples older than newest version - N are stale \\[default: never]", show_default=False
    ),
]
StaleOption = Annotated[Stale, typer.Option(help="drop stale samples from batches, or flag them")]
GroupTimeout = Annotated[
    float, typer.Option(help="log seconds a group waits for missing members before it goes out")
]
StepEvents = Annotated[int, typer.Option(help="events folded per transaction")]


def sampling(temperature: float, max_tokens: int, seed: int | None) -> SamplingParams:
    try:
        return SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed)
    except ValidationError as error:
        raise ConfigError(f"sampling options: {describe_validation_error(error)}") from None


def tags(pairs: list[str]) -> dict[str, str]:
    found = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ConfigError(f"--tag {pair!r}: write it as key=value")
        found[key] = value
    return found
