"""The OpenAI-compatible HTTP API, served by the service process beside its ZMQ protocol."""
