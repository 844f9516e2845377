"""The event log: the append-only PostgreSQL event store (the only source of truth), its store port and in-
memory adapter, token packing, the tables, consumer checkpoints and migrations."""
