"""Replay: episodes read back from the log as transcripts, listed, and re-run against a recording."""
