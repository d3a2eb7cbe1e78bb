"""Prometheus duration strings ("1h30m", "500ms") <-> seconds, and `Timing`.

Profiles are written in Prometheus' notation; rules are rendered from seconds through `Timing`, so
that a test can scale every window and `for:` by one factor.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_UNITS = {"d": 86400.0, "h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}
_DURATION = re.compile(r"^(?:(\d+)d)?(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?(?:(\d+)ms)?$")


def parse_duration(text: str) -> float:
    """'1h30m' -> 5400.0. Raises ValueError on anything Prometheus would not accept."""
    match = _DURATION.match(text)
    if not text or not match or not any(match.groups()):
        raise ValueError(f"{text!r} is not a duration like 30s, 5m, 1h30m")
    return sum(_UNITS[unit] * int(value) for unit, value in zip(("d", "h", "m", "s", "ms"), match.groups()) if value)


def format_duration(seconds: float) -> str:
    """5400 -> '1h30m', 0.5 -> '500ms', 0 -> '0s'. Rounds to whole milliseconds."""
    if seconds < 0:
        raise ValueError(f"negative duration {seconds}")
    remaining = round(seconds * 1000)
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
