"""Wire APIs (OpenAI chat completions, Anthropic messages): a request parsed into Turnstile's terms, a reply
rendered as that API's JSON and stream events, errors in its shape."""
