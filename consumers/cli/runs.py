"""``turnstile run``, ``submit`` and ``demo``: agents over tasks, and the closed loop on one machine."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import typer
from rich.console import Console

from consumers.cli.common import (
    Agent,
    Concurrency,
    ConnectTimeout,
    EpisodeTimeout,
    MaxTokens,
    MaxTurns,
    Retries,
    Reward,
    Temperature,
    console,
    sampling,
    tags,
)
from pipeline.errors import ConfigError
from pipeline.settings import Settings


def run(
    agent: Agent,
    tasks: Path = typer.Option(..., help="a JSONL file, one task object per line"),
    policy: str = typer.Option(..., help="the policy: requests go to llm.<policy>.requests"),
    group_size: int = typer.Option(1, help="episodes per task (one group, for group-relative advantages)"),
    concurrency: Concurrency = 64,
    max_turns: MaxTurns = None,
    retries: Retries = 1,
    timeout: EpisodeTimeout = None,
    reward: Reward = None,
    temperature: Temperature = 1.0,
    max_tokens: MaxTokens = 256,
    seed: int = typer.Option(None, help="sampling seed"),
    tag: list[str] = typer.Option([], help="key=value recorded with every episode (repeatable)"),
    connect_timeout: ConnectTimeout = 0.0,
) -> None:
    """Run AGENT on every task of a file, recording every episode; Ctrl-C cancels cleanly."""
    import asyncio

    from consumers.runner import run_task_file
    from consumers.runtime import Connections
    from pipeline.runners import (
        RunnerConfig,
        failed_for_infrastructure,
        failure_report,
        load_agent,
        load_reward_function,
        stats_table,
    )

    settings = Settings()
    if connect_timeout < 0:
        raise ConfigError(f"--connect-timeout must be 0 (one attempt) or more, got {connect_timeout:g}")
    connections = Connections(
        settings.require_database_url(policy), settings.require_nats_url(), connect_for=connect_timeout
    )
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
        sampling=sampling(temperature, max_tokens, seed),
        tags=tags(tag),
    )
    result = asyncio.run(
        run_task_file(connections, loaded, config, tasks, reward_fn=reward_fn, console=console)
    )
    console.print(stats_table(result.stats, "cancelled" if result.cancelled else "finished"))
    for line in failure_report(result.stats):
        console.print(line, markup=False, highlight=False, soft_wrap=True)
    if result.cancelled:
        raise SystemExit(130)
    if failed_for_infrastructure(result.stats):
        raise SystemExit(1)  # the servers or the consumers, not the agent: a script must notice


def submit(
    tasks: Path = typer.Argument(..., help="a JSONL file, one task object per line"),
    policy: str = typer.Option(..., help="tasks go to the work queue subject tasks.<policy>"),
    group_size: int = typer.Option(1, help="episodes per task"),
    harness: bool = typer.Option(
        False,
        "--harness",
        help="for `turnstile serve harness` (harness.tasks.<policy>): each line the harness's JSONL form, or "
        '{"id": ..., "path": "<a Harbor task directory on the harness machines>"}',
    ),
    connect_timeout: ConnectTimeout = 0.0,
) -> None:
    """Put every task of a file on the JetStream work queue TASKS for `turnstile serve runner` (or, with
    --harness, on HARNESS_TASKS for `turnstile serve harness`)."""
    import asyncio
    import contextlib

    from nats.errors import TimeoutError as NatsTimeoutError

    from consumers.runtime import connect_nats
    from pipeline.runners import (
        TaskLineError,
        TaskSpec,
        harness_durable,
        old_harness_tasks,
        read_tasks,
        submit_tasks,
        task_subject,
    )

    if group_size < 1:
        raise ConfigError(f"--group-size must be at least 1, got {group_size}")
    if connect_timeout < 0:
        raise ConfigError(f"--connect-timeout must be 0 (one attempt) or more, got {connect_timeout:g}")
    specs: list[TaskSpec] = []
    for item in read_tasks(tasks):
        if isinstance(item, TaskLineError):
            console.print(f"[red]task file {tasks}, {item}[/red] (skipped; the other tasks are submitted)")
        else:
            specs.append(item)

    subject = task_subject(policy, harness=harness)

    async def send() -> tuple[int, dict[str, int]]:
        # bounded, one line per failed attempt, then one clear error (never nats-py's traceback storm)
        connection = await connect_nats(Settings().require_nats_url(), connect_for=connect_timeout)
        assert connection is not None  # None only when a stop event is given
        try:
            try:
                sent = await submit_tasks(connection, policy, specs, group_size=group_size, harness=harness)
            except NatsTimeoutError:  # a refused publish gets no answer: the server only logs the refusal
                raise ConfigError(
                    f"JetStream did not answer storing tasks on {subject}: the NATS user in "
                    "TURNSTILE_NATS_URL may not be allowed to (deploy/nats.conf: runners' tasks take the "
                    "runner or admin user, harness tasks admin only)"
                ) from None
            stranded: dict[str, int] = {}
            if harness:
                with contextlib.suppress(NatsTimeoutError):  # a user that may not read TASKS: nothing to say
                    stranded = await old_harness_tasks(connection)
            return len(sent), stranded
        finally:
            await connection.drain()

    sent, stranded = asyncio.run(send())
    console.print(f"submitted {sent} tasks to {subject} (group size {group_size})")
    for old_subject, count in stranded.items():
        durable = harness_durable(old_subject.removeprefix("tasks.harness."))
        console.print(
            f"[yellow]{count} harness tasks still wait on {old_subject} in TASKS, where harness tasks "
            "were queued before HARNESS_TASKS: no harness takes them. Submit their file again with "
            f"--harness, then drop them and their old consumer: `nats stream purge TASKS --subject "
            f"{old_subject}` and `nats consumer rm TASKS {durable}`[/yellow]",
            soft_wrap=True,
        )


def demo(
    minutes: float = typer.Option(3.0, help="how long the loop runs (at most, with --until-batches)"),
    until_batches: int | None = typer.Option(
        None, help="stop once this many batches are trained in this run (a run of a fixed amount of training)"
    ),
    data_dir: Path = typer.Option(
        None, help="servers, model, checkpoints and logs \\[default: $TURNSTILE_DATA_DIR or .turnstile]"
    ),
    seed: int = typer.Option(0, help="trainer seed"),
    concurrency: int = typer.Option(None, help="episodes in flight \\[default: 64; 8 with --harness]"),
    max_batches_ahead: int = typer.Option(
        0, help="start no new group while the trainer has more batches than this waiting (pacing)"
    ),
    pace: bool = typer.Option(True, help="pace rollouts to the learner (--no-pace: as fast as they come)"),
    harness: bool = typer.Option(
        False,
        "--harness",
        help="a black-box agent instead: a gateway, and the harness running a command agent per episode in "
        "a sandbox on Harbor task directories, rewarded by their verifiers (policy harness-demo)",
    ),
    tasks: Path = typer.Option(
        None, help="--harness: task directories \\[default: examples/harness-demo]", exists=True
    ),
    sandbox: str = typer.Option(
        None, help="--harness: the sandbox backend \\[default: bwrap where installed, else none]"
    ),
) -> None:
    """The closed loop on this machine: embedded servers, tiny model, inference, materializer, relay,
    trainer and a runner on a task the model learns (--harness: a black-box agent under the harness, scored
    by task verifiers); live progress, then a summary and a reward curve."""
    from consumers.closed_loop import (
        HARNESS_TASKS,
        DemoConfig,
        HarnessDemo,
        default_sandbox,
        report,
        run_demo,
    )

    if minutes <= 0:
        raise ConfigError(f"--minutes must be positive, got {minutes}")
    if until_batches is not None and until_batches < 1:
        raise ConfigError(f"--until-batches must be at least 1, got {until_batches}")
    if max_batches_ahead < 0:
        raise ConfigError(f"--max-batches-ahead must be 0 or more, got {max_batches_ahead}")
    if not harness and (tasks is not None or sandbox is not None):
        raise ConfigError("--tasks and --sandbox are options of `turnstile demo --harness`")
    if concurrency is not None and concurrency < 1:
        raise ConfigError(f"--concurrency must be at least 1, got {concurrency}")
    config = DemoConfig(
        data_dir=data_dir or Settings().data_dir,
        minutes=minutes,
        until_batches=until_batches,
        seed=seed,
        concurrency=concurrency or 64,
        max_batches_ahead=max_batches_ahead if pace else None,
    )
    if harness:  # a sandboxed agent is a process of its own: fewer at a time, smaller groups and batches
        black_box = HarnessDemo(tasks or HARNESS_TASKS, sandbox or default_sandbox())
        config = replace(
            config, harness=black_box, concurrency=concurrency or 8, group_size=4, batch_samples=16
        )
    summary = run_demo(config, console)
    report(summary, config, Console())
