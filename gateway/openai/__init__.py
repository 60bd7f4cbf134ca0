"""The OpenAI-compatible API: request and response shapes, request preparation, renderers, routes."""
