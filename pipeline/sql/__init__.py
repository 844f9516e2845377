"""Read-only SQL over the log and read models (turnstile sql)."""
