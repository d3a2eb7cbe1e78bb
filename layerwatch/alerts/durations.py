"""Prometheus duration strings ("1h30m", "500ms") <-> seconds, and `Timing`.

Profiles are written in Prometheus' notation; rules are rendered from seconds through `Timing`, so
that a test can scale every window and `for:` by one factor.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

_UNIT_MS = {"d": 86_400_000, "h": 3_600_000, "m": 60_000, "s": 1000, "ms": 1}
# [0-9], not \d: Python's \d also matches other scripts' digits ("٣"), which Prometheus does not read.
_DURATION = re.compile(r"(?:([0-9]+)d)?(?:([0-9]+)h)?(?:([0-9]+)m)?(?:([0-9]+)s)?(?:([0-9]+)ms)?")
# Prometheus holds a duration as int64 nanoseconds (Go's time.Duration): a rule's `for:` or a PromQL
# range beyond it fails `promtool check rules` with "duration out of range". In milliseconds, the
# unit generated rules are written in: 2562047h47m16s854ms, about 292 years.
MAX_DURATION_MS = (2**63 - 1) // 1_000_000


def parse_duration(text: str) -> float:
    """'1h30m' -> 5400.0. Raises ValueError on anything Prometheus would not accept."""
    match = _DURATION.fullmatch(text)  # (not match(): `$` also matches before a trailing newline)
    if not text or not match or not any(match.groups()):
        raise ValueError(f"{text!r} is not a duration like 30s, 5m, 1h30m")
    # More digits than the largest duration has: out of range, before int() is asked to convert them.
    if any(len(value) > len(str(MAX_DURATION_MS)) for value in match.groups() if value):
        raise _out_of_range(text)
    milliseconds = sum(_UNIT_MS[unit] * int(value) for unit, value in zip(_UNIT_MS, match.groups()) if value)
    if milliseconds > MAX_DURATION_MS:
        raise _out_of_range(text)
    return milliseconds / 1000


def _out_of_range(text: str) -> ValueError:
    return ValueError(
        f"{text!r} is out of range: Prometheus durations are at most {format_duration(MAX_DURATION_MS / 1000)}"
    )


def format_duration(seconds: float) -> str:
    """5400 -> '1h30m', 0.5 -> '500ms', 0 -> '0s'. Rounds to whole milliseconds; raises ValueError
    for what Prometheus would not read (negative, over MAX_DURATION_MS)."""
    if not 0 <= seconds < math.inf:
        raise ValueError(f"{seconds} s is not a duration (negative or not finite)")
    remaining = round(seconds * 1000)
    if remaining > MAX_DURATION_MS:
        raise ValueError(f"{seconds} s is longer than Prometheus' longest duration, {MAX_DURATION_MS} ms")
    if remaining == 0:
        return "0s"
    parts = []
    for unit, size in (("h", 3_600_000), ("m", 60_000), ("s", 1000), ("ms", 1)):
        count, remaining = divmod(remaining, size)
        if count:
            parts.append(f"{count}{unit}")
    return "".join(parts)


@dataclass(frozen=True)
class Timing:
    """Multiplies every window and `for:` (1.0 in production, e.g. 0.01 in an end-to-end test)."""

    scale: float = 1.0

    def __call__(self, seconds: float) -> str:
        return format_duration(seconds * self.scale)
