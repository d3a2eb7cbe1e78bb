"""Worked examples of instrumenting an engine (docs/instrument.md): each runs as `python -m examples.NAME`
from the repository root. A package, as benchmarks/ is, so that the tests and benchmarks import them.

- router_llama: a transformers Llama whose decoder layers sit behind per-token sigmoid routers
  (FlexiDepth / MindSkip style), observed with `layerwatch.integrations.transformers`;
- gate_file_llama: layerwatch's own gate file and skip policy on a transformers Llama, reproducing
  the serving engine's skip decisions, observed the same way.
"""
