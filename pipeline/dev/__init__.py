"""Development tooling: embedded PostgreSQL and nats-server from PyPI packages (``embedded``), the demo's
process supervisor and statistics (``demo``), plots (``charts``: matplotlib)."""

from pipeline.dev.charts import Chart, Series, draw, mean_ci, read_charts
from pipeline.dev.embedded import (
    EmbeddedNats,
    EmbeddedPostgres,
    EmbeddedServerError,
    EmbeddedServers,
    free_port,
)
from pipeline.dev.supervisor import ServiceProcesses, Summary, summarize

__all__ = [
    "Chart",
    "EmbeddedNats",
    "EmbeddedPostgres",
    "EmbeddedServerError",
    "EmbeddedServers",
    "Series",
    "ServiceProcesses",
    "Summary",
    "draw",
    "free_port",
    "mean_ci",
    "read_charts",
    "summarize",
]
