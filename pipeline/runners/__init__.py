"""Runners: many episodes of an agent over tasks from a file or the TASKS work queue, agent loading
(proxy-style agents through an in-process gateway included) and live progress."""

from pipeline.runners.loading import import_object, load_agent, load_reward_function
from pipeline.runners.progress import (
    failed_for_infrastructure,
    failure_report,
    live_progress,
    stats_line,
    stats_table,
)
from pipeline.runners.proxy import ProxyAgent, ProxyAgentAdapter, local_gateway, proxy_agent_adapter
from pipeline.runners.runner import (
    Runner,
    RunnerConfig,
    RunStats,
    TaskLineError,
    TaskSpec,
    read_tasks,
    run_tasks,
)
from pipeline.runners.taskqueue import (
    HARNESS_TASKS_STREAM,
    PASSING_FETCH_ERRORS,
    TASKS_STREAM,
    RunningTasks,
    TaskWorker,
    Working,
    ensure_tasks_stream,
    harness_durable,
    old_harness_tasks,
    submit_tasks,
    task_stream,
    task_subject,
)

__all__ = [
    "HARNESS_TASKS_STREAM",
    "PASSING_FETCH_ERRORS",
    "TASKS_STREAM",
    "ProxyAgent",
    "ProxyAgentAdapter",
    "RunStats",
    "Runner",
    "RunnerConfig",
    "RunningTasks",
    "TaskLineError",
    "TaskSpec",
    "TaskWorker",
    "Working",
    "ensure_tasks_stream",
    "failed_for_infrastructure",
    "failure_report",
    "harness_durable",
    "import_object",
    "live_progress",
    "load_agent",
    "load_reward_function",
    "local_gateway",
    "old_harness_tasks",
    "proxy_agent_adapter",
    "read_tasks",
    "run_tasks",
    "stats_line",
    "stats_table",
    "submit_tasks",
    "task_stream",
    "task_subject",
]
