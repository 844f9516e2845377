"""The harness: agent CLIs run per task in sandboxes, verified, with the reward posted to the gateway."""

from pipeline.harness.sandbox import ExecResult, Sandbox, SandboxBackend, SandboxError, SandboxSpec

__all__ = ["ExecResult", "Sandbox", "SandboxBackend", "SandboxError", "SandboxSpec"]
