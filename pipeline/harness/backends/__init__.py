"""Sandbox backends by name (``turnstile harness run --sandbox NAME``).

A backend is imported only when it is asked for: Docker's and Kubernetes' clients are large and optional.
Adding a backend is one line here: its name and where its class lives (a class made without arguments).
"""

from __future__ import annotations

import importlib
from typing import Final

from pipeline.errors import ConfigError
from pipeline.harness.sandbox import SandboxBackend

BACKENDS: Final[dict[str, str]] = {
    "none": "pipeline.harness.backends.process:ProcessBackend",
    "bwrap": "pipeline.harness.backends.bubblewrap:BubblewrapBackend",
    "docker": "pipeline.harness.backends.docker:DockerBackend",
    "kubernetes": "pipeline.harness.backends.kubernetes:KubernetesBackend",
}
"""Backend name -> ``module:Class``."""


def backend(name: str) -> SandboxBackend:
    """The backend called ``name``; an unknown name is a ``ConfigError`` listing the known ones."""
    if name not in BACKENDS:
        raise ConfigError(f"unknown sandbox backend {name!r}: choose one of {', '.join(sorted(BACKENDS))}")
    module, _, attribute = BACKENDS[name].partition(":")
    made: SandboxBackend = getattr(importlib.import_module(module), attribute)()
    return made


__all__ = ["BACKENDS", "backend"]
