"""The harness: agent CLIs run per task in sandboxes, verified, with the reward posted to the gateway."""

from pipeline.harness.admin import AdminClient, GatewayUnavailable, Journal
from pipeline.harness.agents import AGENTS, DEFAULT_CLIS, AgentSpec, agent_spec, base_env, python_mounts
from pipeline.harness.backends import BACKENDS, backend
from pipeline.harness.report import Attempt, HarnessStats
from pipeline.harness.run import Harness, HarnessConfig, Recovered, opened_harness, run_harness
from pipeline.harness.sandbox import ExecResult, Sandbox, SandboxBackend, SandboxError, SandboxSpec
from pipeline.harness.tasks import HarnessTask, harbor_task, jsonl_tasks, load_tasks, queued_task

__all__ = [
    "AGENTS",
    "BACKENDS",
    "DEFAULT_CLIS",
    "AdminClient",
    "AgentSpec",
    "Attempt",
    "ExecResult",
    "GatewayUnavailable",
    "Harness",
    "HarnessConfig",
    "HarnessStats",
    "HarnessTask",
    "Journal",
    "Recovered",
    "Sandbox",
    "SandboxBackend",
    "SandboxError",
    "SandboxSpec",
    "agent_spec",
    "backend",
    "base_env",
    "harbor_task",
    "jsonl_tasks",
    "load_tasks",
    "opened_harness",
    "python_mounts",
    "queued_task",
    "run_harness",
]
