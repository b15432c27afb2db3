"""The OpenAI-compatible HTTP API."""
