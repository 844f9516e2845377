"""Development tooling: embedded PostgreSQL and nats-server from PyPI packages, plots."""
