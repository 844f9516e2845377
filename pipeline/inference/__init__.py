"""The inference path: LLM clients over NATS, the inference service a consumer runs, chat rendering with
token-exact continuation, the engine backends and the tiny local model."""
