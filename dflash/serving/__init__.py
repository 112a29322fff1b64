"""The OpenAI-compatible HTTP server: request parsing, the generation worker, metrics."""
