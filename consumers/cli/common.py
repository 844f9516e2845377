"""What the command groups share: the console, option types declared once (choices as enums, so the CLI
validates them and ``--help`` lists them), and the small parsers of option values."""

from __future__ import annotations

import enum
import functools
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer
import typer.core
from pydantic import ValidationError
from rich.console import Console

from pipeline.errors import ConfigError, describe_validation_error
from schemas import SamplingParams

if TYPE_CHECKING:
    from pipeline.materialize import MaterializerConfig

console = Console(stderr=True)
_R = TypeVar("_R")


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


class SwapInFlight(enum.StrEnum):
    restart = "restart"
    drain = "drain"


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


class SideCalls(enum.StrEnum):
    skip = "skip"
    train = "train"


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
ConnectTimeout = Annotated[
    float,
    typer.Option(
        help="seconds to keep trying to reach the servers (for scripts started before them; 0: one attempt, "
        "so a server that is not there is said at once)"
    ),
]

# -- the HTTP servers (`turnstile serve gateway`, `turnstile ui`) --

MaxBodyMib = Annotated[
    float,
    typer.Option(
        help="largest request body, MiB (over it: 413 while it is read; 32 holds a 200k-token chat)"
    ),
]
ReadTimeout = Annotated[
    float,
    typer.Option(help="seconds a client may take to send its headers, and between parts of its body (408)"),
]

# -- every `turnstile serve ...` service --

MetricsPort = Annotated[
    int | None,
    typer.Option(
        envvar="TURNSTILE_METRICS_PORT",
        help="serve Prometheus /metrics and /health on this port (0: a free one) \\[default: off]",
        show_default=False,
    ),
]
METRICS_HOST = "127.0.0.1"
"""``--metrics-host``'s default, as ``consumers.runtime.METRICS_HOST`` (not imported from there: the CLI
imports a service's modules only when that service runs)."""
MetricsHost = Annotated[
    str,
    typer.Option(
        envvar="TURNSTILE_METRICS_HOST",
        help="the address /metrics and /health listen on (0.0.0.0: every interface, as in a container)",
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
SideCallsOption = Annotated[
    SideCalls,
    typer.Option(
        help="skip: side calls (a root without tools in an episode with tools, or another model than the "
        "episode's main one) are not trained unless a call asked (x-turnstile-train: true) | train: they are"
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


def _keyword(name: str, annotation: Any, default: Any) -> inspect.Parameter:
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation)


MATERIALIZER_OPTIONS = [
    _keyword("discount", Discount, 1.0),
    _keyword("style", StyleOption, Style.individual),
    _keyword("advantage", AdvantageOption, Advantage.grpo),
    _keyword("advantage_peers", PeersOption, Peers.depth),
    _keyword("side_calls", SideCallsOption, SideCalls.skip),
    _keyword("batch_samples", BatchSamples, 64),
    _keyword("batch_tokens", BatchTokens, None),
    _keyword("max_staleness", SampleStaleness, None),
    _keyword("stale", StaleOption, Stale.drop),
    _keyword("group_timeout", GroupTimeout, 600.0),
    _keyword("step_events", StepEvents, 10_000),
]


def materializer_config(
    name: str,
    *,
    discount: float,
    style: Style,
    advantage: Advantage,
    advantage_peers: Peers,
    side_calls: SideCalls,
    batch_samples: int,
    batch_tokens: int | None,
    max_staleness: int | None,
    stale: Stale,
    group_timeout: float,
    step_events: int,
) -> MaterializerConfig:
    """The materializer options of a command as the materializer's configuration."""
    from pipeline.materialize import MaterializerConfig

    return MaterializerConfig(
        name=name,
        discount=discount,
        style=style.value,
        advantage=advantage.value,
        advantage_peers=advantage_peers.value,
        side_calls=side_calls.value,
        batch_samples=batch_samples,
        batch_tokens=batch_tokens,
        max_staleness=max_staleness,
        stale=stale.value,
        group_timeout_s=group_timeout,
        step_events=step_events,
    )


def _evaluated(annotation: Any, command: Callable[..., Any]) -> Any:
    # what typing.get_type_hints does for one annotation, in the command's module
    return eval(annotation, command.__globals__) if isinstance(annotation, str) else annotation


def with_materializer_options(command: Callable[..., _R]) -> Callable[..., _R]:
    """``command`` with the materializer's options after its ``name`` option (declared once, here, for
    ``serve materializer`` and ``rematerialize``); it receives them as one ``config: MaterializerConfig``."""
    own = inspect.signature(command)  # annotations as written: `config`'s names a type imported for mypy only
    kept = [
        p.replace(kind=inspect.Parameter.KEYWORD_ONLY, annotation=_evaluated(p.annotation, command))
        for p in own.parameters.values()
        if p.name != "config"
    ]
    parameters = [kept[0], *MATERIALIZER_OPTIONS, *kept[1:]]  # name, the materializer's, the command's own

    @functools.wraps(command)
    def wrapper(**given: Any) -> _R:
        options = {option.name: given.pop(option.name) for option in MATERIALIZER_OPTIONS}
        return command(config=materializer_config(given["name"], **options), **given)

    # typer reads a command's options from its signature and type hints
    setattr(wrapper, "__signature__", own.replace(parameters=parameters))  # noqa: B010
    wrapper.__annotations__ = {p.name: p.annotation for p in parameters}
    return wrapper


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
