"""Which metric names a PromQL expression reads, and a check that each one exists.

Dashboards and rules are generated from code; this check makes generation fail when a query names
a series that no code defines (a typo, a renamed metric, a recording rule that was removed), which
Prometheus and Grafana would otherwise answer with an empty graph or a silent alert.

It is a tokenizer, not a parser: it removes what cannot be a metric name (strings, label matchers,
ranges, grouping label lists, Grafana variables) and keeps the identifiers that are not followed by
an opening parenthesis (functions, aggregations) and are not keywords.
"""

from __future__ import annotations

import re

from layerwatch import catalog

# Series Prometheus itself writes, which queries may read.
PROMETHEUS_SERIES = frozenset({"up", "ALERTS", "ALERTS_FOR_STATE"})

_KEYWORDS = frozenset(
    {
        "and",
        "or",
        "unless",
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
        "offset",
        "bool",
        "inf",
        "nan",
        "Inf",
        "NaN",
        "start",
        "end",
        "atan2",
    }
)
_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_GRAFANA_VARIABLES = re.compile(r"\$\{[^}]*\}|\$\w+|\[\[\w+\]\]")
_MATCHERS = re.compile(r"\{[^}]*\}")
_RANGES = re.compile(r"\[[^\]]*\]")
_LABEL_LISTS = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_IDENTIFIER = re.compile(r"(?<![\w.:])[A-Za-z_:][A-Za-z0-9_:]*")


def metric_names(expr: str) -> set[str]:
    """The metric names `expr` selects, e.g. {'up'} for 'sum by (job) (up{job="x"}) > 0'."""
    text = _STRINGS.sub('""', expr)
    text = _GRAFANA_VARIABLES.sub("", text)
    text = _MATCHERS.sub(" ", text)
    text = _RANGES.sub(" ", text)
    text = _LABEL_LISTS.sub(" ", text)
    names = set()
    for match in _IDENTIFIER.finditer(text):
        rest = text[match.end() :].lstrip()
        if rest.startswith("(") or match.group() in _KEYWORDS:
            continue
        names.add(match.group())
    return names


def known_series(recorded: set[str]) -> set[str]:
    """Every name a query may read: the catalog's series, vLLM's that it lists, recording rules,
    Prometheus' own."""
    return catalog.all_series_names() | catalog.VLLM_SERIES | set(recorded) | PROMETHEUS_SERIES


class UnknownMetricError(ValueError):
    pass


def check_queries(queries: list[tuple[str, str]], known: set[str]) -> None:
    """Raise UnknownMetricError naming every (where, expr) that reads an undefined series."""
    problems = []
    for where, expr in queries:
        unknown = sorted(metric_names(expr) - known)
        if unknown:
            problems.append(f"{where}: {', '.join(unknown)} (in: {' '.join(expr.split())})")
    if problems:
        raise UnknownMetricError(
            "queries read series that neither layerwatch/catalog.py nor a recording rule defines:\n  "
            + "\n  ".join(problems)
        )
