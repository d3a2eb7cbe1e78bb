"""`layerwatch serve`: the gated model as an OpenAI-compatible HTTP service (see docs/service.md)."""
