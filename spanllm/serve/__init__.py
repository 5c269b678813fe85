"""`spanllm serve`: an OpenAI-compatible HTTP server on the serving engine (see docs/serving.md)."""
