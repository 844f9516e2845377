"""``turnstile serve ...``: the long-running services, one command each (what a deployment runs)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer

from consumers.cli.common import (
    METRICS_HOST,
    Agent,
    Backend,
    Concurrency,
    EpisodeTimeout,
    HeartbeatTimeout,
    MaxBodyMib,
    MaxTokens,
    MaxTurns,
    MetricsHost,
    MetricsPort,
    ReadTimeout,
    Retries,
    Reward,
    SwapInFlight,
    Temperature,
    console,
    sampling,
    with_materializer_options,
)
from pipeline.errors import ConfigError
from pipeline.inference import (
    DEFAULT_BUDGET_BYTES,
    DEFAULT_RETRY_REPLIES,
    DEFAULT_RETRY_REPLY_BYTES,
    IN_FLIGHT_DEFAULT,
)
from pipeline.settings import Settings

if TYPE_CHECKING:
    from pipeline.materialize import MaterializerConfig


def optional_database_url(policy: str) -> str | None:
    """The policy's log's URL if one is set (or `turnstile up` runs here), else None: an inference consumer
    without one serves its first weights and refuses every version (it cannot check them against the log)."""
    try:
        return Settings().require_database_url(policy)
    except ConfigError:
        return None


def inference(
    policy: str = typer.Option(..., help="the policy served: requests arrive on llm.<policy>.requests"),
    backend: Backend = typer.Option(
        Backend.torch, help="torch | vllm | scripted (instant fixed replies, for benchmarks)"
    ),
    model_dir: Path = typer.Option(None, "--model", help="a Hugging Face model directory (local)"),
    consumer_id: str = typer.Option(
        "", help="this consumer's id in sticky subjects \\[default: host-pid-random]"
    ),
    max_batch: int = typer.Option(
        16, min=1, help="torch backend: requests running at once (they join and leave at token boundaries)"
    ),
    max_batch_tokens: int = typer.Option(
        2048,
        min=1,
        help="torch backend: tokens fed to the model in one step, a token per running request plus prefill "
        "(a longer prompt is prefilled in chunks between decode steps); at least --max-batch",
    ),
    swap_in_flight: SwapInFlight = typer.Option(
        SwapInFlight(IN_FLIGHT_DEFAULT),
        help="vllm: when a new policy version is loaded, the requests in flight are restarted on it (their "
        "tokens of the old version dropped; the reply's timings.restarted_ms says so) or drained (finished "
        "on the old version, which their replies name) before the swap; torch always drains",
    ),
    held_mib: float = typer.Option(
        DEFAULT_BUDGET_BYTES / 2**20,
        min=0,
        help="MiB of memory for recent turns (token ids, messages, tools; a turn shares what the turn it "
        "continued holds), kept so a request continuing one need not send them again; least recently used "
        "first",
    ),
    retry_replies: int = typer.Option(
        DEFAULT_RETRY_REPLIES,
        min=0,
        help="replies kept for answering a request sent again (a client's retry gets the same reply, not a "
        "second generation), newest first; 0: none",
    ),
    retry_replies_mib: float = typer.Option(
        DEFAULT_RETRY_REPLY_BYTES / 2**20, min=0, help="MiB the replies kept for retries may take together"
    ),
    script: Path = typer.Option(
        None,
        help="torch backend: answer with the replies of this script (JSON rules matched on the request; "
        "see pipeline/inference/script.py), scored by the model: engine token ids and logprobs",
    ),
    metrics_port: MetricsPort = None,
    metrics_host: MetricsHost = METRICS_HOST,
) -> None:
    """Answer LLM requests for POLICY over NATS (queue group `inference`), reloading published versions."""

    from consumers.inference import InferenceConfig, create_app
    from consumers.runtime import run, setup_logging

    setup_logging()
    config = InferenceConfig(
        nats_url=Settings().require_nats_url(),
        policy=policy,
        backend=backend.value,
        model=model_dir,
        consumer_id=consumer_id,
        max_batch=max_batch,
        max_batch_tokens=max_batch_tokens,
        in_flight=swap_in_flight.value,
        held_bytes=int(held_mib * 2**20),
        retry_replies=retry_replies,
        retry_reply_bytes=int(retry_replies_mib * 2**20),
        metrics_port=metrics_port,
        metrics_host=metrics_host,
        script=script,
        database_url=optional_database_url(policy),
    )
    application, service = create_app(config)
    console.print(
        f"inference consumer [bold]{service.consumer_id}[/bold] serving policy {policy!r} ({backend.value})"
    )
    run(application.run())


def runner(
    agent: Agent,
    policy: str = typer.Option(..., help="take tasks from tasks.<policy>, send requests to llm.<policy>"),
    concurrency: Concurrency = 64,
    max_turns: MaxTurns = None,
    retries: Retries = 1,
    timeout: EpisodeTimeout = None,
    reward: Reward = None,
    temperature: Temperature = 1.0,
    max_tokens: MaxTokens = 256,
    ack_wait: float = typer.Option(
        60.0, help="seconds without progress before a task goes to another runner"
    ),
    lease_timeout: float = typer.Option(
        30.0, help="seconds after which a silent runner's episodes are aborted"
    ),
    heartbeat_timeout: HeartbeatTimeout = 15.0,
    max_batches_ahead: int | None = typer.Option(
        None,
        help="take no new task while the trainer (--trainer) has more than this many batches of the policy "
        r"waiting: rollouts paced to the learner, so fewer are skipped as stale \[default: never wait]",
        show_default=False,
    ),
    trainer: str = typer.Option("trainer", help="the trainer whose backlog --max-batches-ahead watches"),
    metrics_port: MetricsPort = None,
    metrics_host: MetricsHost = METRICS_HOST,
) -> None:
    """Take tasks from the TASKS work queue and run AGENT on them, on as many machines as you like."""

    from consumers.runner import serve_runner
    from consumers.runtime import Connections, run, setup_logging
    from pipeline.runners import RunnerConfig, load_agent, load_reward_function

    setup_logging()
    if max_batches_ahead is not None and max_batches_ahead < 0:
        raise ConfigError(f"--max-batches-ahead must be 0 or more, got {max_batches_ahead}")
    settings = Settings()
    connections = Connections(
        settings.require_database_url(policy),
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
        sampling=sampling(temperature, max_tokens, None),
    )
    run(
        serve_runner(
            connections,
            loaded,
            config,
            reward_fn=reward_fn,
            ack_wait=ack_wait,
            console=console,
            metrics_port=metrics_port,
            metrics_host=metrics_host,
            max_batches_ahead=max_batches_ahead,
            trainer=trainer,
        )
    )
    console.print("runner stopped")


POLICY_LOG_HELP = (
    "the policy whose log this is: its database in TURNSTILE_DATABASE_URLS (docs/scale.md) \\[default: "
    "TURNSTILE_DATABASE_URL]"
)


@with_materializer_options
def materializer(
    name: str = typer.Option("main", help="the read models' name (main: the public tables)"),
    policy: str = typer.Option(None, help=POLICY_LOG_HELP, show_default=False),
    metrics_port: MetricsPort = None,
    metrics_host: MetricsHost = METRICS_HOST,
    config: MaterializerConfig | None = None,
) -> None:
    """Fold the log into read models and training batches as events arrive (exactly once)."""

    from consumers.materializer import serve_materializer
    from consumers.runtime import run, setup_logging

    setup_logging()
    assert config is not None  # with_materializer_options gives it
    console.print(f"materializer {name!r} running ({config.semantics()})")
    done = run(
        serve_materializer(
            Settings().require_database_url(policy),
            config,
            metrics_port=metrics_port,
            metrics_host=metrics_host,
        )
    )
    console.print(f"materializer stopped at position {done.position}")


def relay(
    schema: str = typer.Option("public", help="the schema whose batch_outbox is published"),
    policy: str = typer.Option(None, help=POLICY_LOG_HELP, show_default=False),
    poll_interval: float = typer.Option(
        1.0, help="seconds between passes when no NOTIFY wakes the relay sooner"
    ),
    outbox_retention: float = typer.Option(
        86_400.0,
        help="seconds a published batch payload stays in the outbox before it is deleted (0: at once; inf: "
        "keep); `batches` keeps its size and sha256 and `turnstile rematerialize` rebuilds the same bytes",
    ),
    metrics_port: MetricsPort = None,
    metrics_host: MetricsHost = METRICS_HOST,
) -> None:
    """Publish the materializer's batches to JetStream BATCHES (batches.<policy>), each once."""

    from consumers.relay import RelayConfig, serve_relay

    if poll_interval <= 0:
        raise ConfigError(f"--poll-interval must be more than 0, got {poll_interval}")
    if not outbox_retention >= 0:
        raise ConfigError(f"--outbox-retention is seconds, 0 or more (inf: keep), got {outbox_retention}")
    from consumers.runtime import run, setup_logging

    setup_logging()
    settings = Settings()
    config = RelayConfig(
        settings.require_database_url(policy),
        settings.require_nats_url(),
        schema=schema,
        poll_interval=poll_interval,
        outbox_retention=outbox_retention,
        metrics_port=metrics_port,
        metrics_host=metrics_host,
    )
    run(serve_relay(config, console=console))
    console.print("relay stopped")


def trainer(
    policy: str = typer.Option(..., help="train on batches.<policy>; publish policy.<policy>.versions"),
    model_dir: Path = typer.Option(..., "--model", help="the starting weights (a local model directory)"),
    checkpoints: Path = typer.Option(..., help="where checkpoints v000001, v000002, ... are written"),
    durable: str = typer.Option("trainer", help="this trainer's name (its JetStream consumer and record)"),
    lr: float = typer.Option(3e-3, help="Adam learning rate"),
    clip: float = typer.Option(0.2, help="PPO ratio clip"),
    version_every: int = typer.Option(1, help="batches per published policy version"),
    max_staleness: int = typer.Option(
        None, help="skip batches more than N versions behind \\[default: never]"
    ),
    ack_wait: float = typer.Option(120.0, help="seconds before an unfinished batch is delivered again"),
    merge_waiting: int = typer.Option(
        1, help="batches already waiting taken into one step when the trainer is behind (1: never)"
    ),
    seed: int = typer.Option(0, help="torch seed"),
    threads: int = typer.Option(1, help="torch CPU threads"),
    device: str = typer.Option(
        None, help="cuda, cuda:N or cpu \\[default: cuda when there is one, else cpu]"
    ),
    bf16: bool = typer.Option(
        None,
        "--bf16/--fp32",
        help="bf16 autocast, fp32 master weights \\[default: bf16 on cuda, fp32 on cpu]",
    ),
    micro_batch_tokens: int = typer.Option(
        0, help="padded tokens per forward pass, gradients accumulated (0: the whole batch at once)"
    ),
    kl_coef: float = typer.Option(0.0, help="weight of the KL to the starting weights (0: none)"),
    lora_rank: int = typer.Option(0, help="LoRA adapters of this rank (0: full fine-tuning; needs [lora])"),
    lora_alpha: int = typer.Option(None, help="LoRA alpha \\[default: twice the rank]"),
    keep_checkpoints: int = typer.Option(
        3, help="version directories kept under --checkpoints, the newest (0: keep all)"
    ),
    log_steps: Path = typer.Option(
        None, help="append a JSON line per learner step (loss, staleness, reward ...) to this file"
    ),
    track: str = typer.Option(None, help="log each step to an experiment tracker: wandb or mlflow"),
    track_dir: Path = typer.Option(
        None,
        help="where the tracker writes (wandb's offline run, mlflow's file store) "
        "\\[default: CHECKPOINTS/tracking]",
    ),
    metrics_port: MetricsPort = None,
    metrics_host: MetricsHost = METRICS_HOST,
) -> None:
    """PPO-clip on the batch stream; checkpoints and publishes new policy versions (exactly once)."""

    from consumers.runtime import run, setup_logging
    from consumers.trainer import TrainerConfig, serve_trainer
    from pipeline.training import LearnerOptions

    setup_logging()
    settings = Settings()
    config = TrainerConfig(
        database_url=settings.require_database_url(policy),
        nats_url=settings.require_nats_url(),
        policy=policy,
        model=model_dir,
        checkpoints=checkpoints,
        durable=durable,
        learner=LearnerOptions(
            lr=lr,
            clip=clip,
            seed=seed,
            threads=threads,
            device=device,
            bf16=bf16,
            micro_batch_tokens=micro_batch_tokens,
            kl_coef=kl_coef,
            lora_rank=lora_rank,
            lora_alpha=lora_alpha,
        ),
        version_every=version_every,
        max_staleness=max_staleness,
        ack_wait=ack_wait,
        merge_waiting=merge_waiting,
        keep_checkpoints=keep_checkpoints,
        log_steps=log_steps,
        track=track,
        track_dir=track_dir,
        metrics_port=metrics_port,
        metrics_host=metrics_host,
    )
    stats = run(serve_trainer(config))
    console.print(f"trainer stopped at policy version {stats.version} ({stats.trained} batches trained)")


def gateway(
    policy_default: str = typer.Option(None, help="the policy of sessions that name none"),
    host: str = typer.Option("127.0.0.1", help="the address to listen on (0.0.0.0: every interface)"),
    port: int = typer.Option(8000, help="the port to listen on (0: a free one)"),
    admin_key_env: str = typer.Option(
        "TURNSTILE_ADMIN_KEY", help="the environment variable that holds the admin key (required)"
    ),
    max_open_sessions: int = typer.Option(
        None, help="open sessions at most; starting one more gets 429 \\[default: no limit]"
    ),
    max_staleness: int = typer.Option(
        None,
        help="starting a session gets 429 while the newest published policy version is more than N ahead "
        "of the version the inference consumers answer with \\[default: never]",
    ),
    idle_timeout: float = typer.Option(
        3600.0, help="seconds without a call before a session ends as timeout (0: never)"
    ),
    gone_after: float = typer.Option(
        30.0,
        help="seconds without a call, after a reply found its client gone, before a session ends as aborted "
        "(0: only --idle-timeout ends it)",
    ),
    public_url: str = typer.Option(
        None, help="the URL clients reach the gateway at, for the base_url it hands out \\[default: Host]"
    ),
    heartbeat_timeout: HeartbeatTimeout = 15.0,
    shared_sessions: bool = typer.Option(
        False,
        "--shared-sessions",
        help="serve sessions with the other gateway replicas that share this NATS and log: any replica "
        "serves any session (behind a load balancer with no affinity), and a stopping replica leaves its "
        "sessions open for the others (docs/gateway.md#replicas)",
    ),
    ui: bool = typer.Option(
        False,
        "--ui",
        help="also serve the episode browser at /ui (read-only, as TURNSTILE_READER_URL; HTTP Basic with the "
        "admin key as password)",
    ),
    max_body_mib: MaxBodyMib = 32.0,
    read_timeout: ReadTimeout = 30.0,
    metrics_port: MetricsPort = None,
    metrics_host: MetricsHost = METRICS_HOST,
) -> None:
    """Serve the OpenAI- and Anthropic-compatible gateway: every call of a session is a recorded turn."""
    import os

    from consumers.gateway import GatewayConfig, serve_gateway

    admin_key = os.environ.get(admin_key_env, "").strip()
    if not admin_key:
        raise ConfigError(
            f"no admin key: set {admin_key_env} to a secret (e.g. `export {admin_key_env}=$(openssl rand "
            "-hex 32)`); it protects session creation, and the gateway does not start without one"
        )
    from consumers.runtime import run, setup_logging

    setup_logging()
    settings = Settings()
    config = GatewayConfig(
        database_url=settings.require_database_url(),
        policy_database_urls=settings.policy_database_urls(),
        nats_url=settings.require_nats_url(),
        admin_key=admin_key,
        policy_default=policy_default,
        host=host,
        port=port,
        capacity=max_open_sessions,
        max_staleness=max_staleness,
        idle_timeout=idle_timeout or None,
        gone_after=gone_after or None,
        public_url=public_url,
        heartbeat_timeout=heartbeat_timeout,
        shared_sessions=shared_sessions,
        ui_reader_url=settings.require_reader_url() if ui else None,
        metrics_port=metrics_port,
        metrics_host=metrics_host,
        max_body_bytes=round(max_body_mib * 1024 * 1024),
        read_timeout=read_timeout,
    )
    run(serve_gateway(config, console=console))
    console.print("gateway stopped")
