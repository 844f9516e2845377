"""Development tooling: embedded PostgreSQL and nats-server from PyPI packages (``embedded``), the demo's
process supervisor and statistics (``demo``), a small PNG line chart (``plot``)."""

from pipeline.dev.demo import ServiceProcesses, Summary, mean_ci, summarize
from pipeline.dev.embedded import (
    EmbeddedNats,
    EmbeddedPostgres,
    EmbeddedServerError,
    EmbeddedServers,
    free_port,
)
from pipeline.dev.plot import line_chart

__all__ = [
    "EmbeddedNats",
    "EmbeddedPostgres",
    "EmbeddedServerError",
    "EmbeddedServers",
    "ServiceProcesses",
    "Summary",
    "free_port",
    "line_chart",
    "mean_ci",
    "summarize",
]
