"""The HTTP gateway: OpenAI- and Anthropic-compatible routes over episode sessions, session keys and
admission, and the HTTP server."""
