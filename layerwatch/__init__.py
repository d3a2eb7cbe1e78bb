"""layerwatch: observability for LLM inference with dynamic layer skipping.

This package holds the entry point and the torch-free pieces every component shares:
the metric catalog, the gate-frame wire format and the trace format.
"""
