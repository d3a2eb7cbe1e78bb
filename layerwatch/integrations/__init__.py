"""Instrumentation for engines people already run, one module per framework.

Each module imports its framework (torch, transformers) and, of the project, only the torch-free core
(`layerwatch.client`, `layerwatch.trace`); nothing else imports them, so the core, the exporter and
the generators stay torch-free (tests/test_architecture.py holds both sides to that). Importing this
package imports no framework.

- transformers: a `PreTrainedModel`'s per-layer router or gate scores during `generate()`, as gate
  frames and trace lines (docs/instrument.md).
"""
