"""Log lines of `MARKER key=value ...` pairs (logfmt) whose values may come from outside.

A value from a webhook (an alert's name, fingerprint or labels) must not be able to add a field
or a line to the log: a label `x reason=operator` or one holding a newline would otherwise forge
them. A value is written bare when that is safe (printable, no space, '"' or '='), else as a JSON
string, ASCII only, so that no control, line-separator or bidirectional character reaches the log
and `json.loads` gives the value back exactly.
"""

from __future__ import annotations

import json

_NOT_BARE = frozenset(' "=')


def logfmt_value(value: object) -> str:
    """`value` as one logfmt value: bare when safe, else quoted and escaped."""
    text = str(value)
    if text and text.isprintable() and _NOT_BARE.isdisjoint(text):
        return text
    return json.dumps(text)


def logfmt_line(marker: str, **fields: object) -> str:
    """`MARKER key=value ...`, every value through logfmt_value, in the order given."""
    return " ".join([marker, *(f"{key}={logfmt_value(value)}" for key, value in fields.items())])
