"""layerwatch: the one top-level package. Its modules are the torch-free core, the public names and formats
every other part shares; its subpackages are the parts (exporter, alerts, dashboards, deploy, demo, mixin,
inference_shim, integrations, cli: docs/architecture.md).

- catalog: every metric, its type, labels and help (the names dashboards and rules may query);
- wire: the gate-frame datagram the shim sends and the exporter receives;
- trace: the JSON Lines trace format `serve --trace-file` writes and `replay` reads;
- statistics: entropy histograms and the bimodality verdict;
- routing: per-layer below-threshold rates and the routing verdict (static pruning or per-token);
- request_tail: one finished request's skip fraction and token-dependent share;
- promql: which metric names a query reads, checked against the catalog.

It imports nothing else of the project (tests/test_architecture.py holds it to that).
"""
