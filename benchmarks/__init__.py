"""Benchmark scripts: each runs as `python benchmarks/NAME.py` from the repository root (docs/performance.md).

A package so that mypy and the tests import them by one name, `benchmarks.NAME`.
"""
