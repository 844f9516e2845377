"""Turnstile's library: the event store, embedded servers, settings and (in later pieces) LLM clients,
episode sessions, materialization and replay."""
