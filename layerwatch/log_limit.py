"""Rate-limited log lines: a flood of refused requests must not become a flood of the log.

`RateLimit` is a logging.Filter for the loggers that log refusals (the listeners' and the API's).
Each kind of message, told apart by its level, its format string (not its arguments: the peer's
address differs at every line) and the record's `rate_key` if the caller gave one
(`log.warning(..., extra={"rate_key": reason})`), passes in a burst of `burst` records, then at
most `burst` per `period` seconds; the first one to pass after some were held back says how many:
"... (N similar lines suppressed)". Other kinds keep their own allowance, so that a flood of one
never hides another. The counters (`layerwatch_mitigation_webhook_requests_total`, ...) still
count every refusal.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

BURST = 10  # lines of one kind logged at once, and again per PERIOD_SECONDS
PERIOD_SECONDS = 60.0
MAX_KINDS = 256  # message kinds remembered (format strings are constants: a bound, not a limit)


@dataclass
class _Allowance:
    tokens: float
    updated: float
    suppressed: int = 0


class RateLimit(logging.Filter):
    def __init__(
        self, burst: int = BURST, period: float = PERIOD_SECONDS, clock: Callable[[], float] = time.monotonic
    ) -> None:
        super().__init__()
        self._burst, self._rate, self._clock = burst, burst / period, clock
        self._allowances: OrderedDict[tuple[int, str, object], _Allowance] = OrderedDict()
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        kind = (record.levelno, str(record.msg), getattr(record, "rate_key", None))
        now = self._clock()
        with self._lock:
            allowance = self._allowances.get(kind)
            if allowance is None:
                allowance = self._allowances[kind] = _Allowance(float(self._burst), now)
                if len(self._allowances) > MAX_KINDS:
                    self._allowances.popitem(last=False)
            allowance.tokens = min(self._burst, allowance.tokens + (now - allowance.updated) * self._rate)
            allowance.updated = now
            if allowance.tokens < 1:
                allowance.suppressed += 1
                return False
            allowance.tokens -= 1
            suppressed, allowance.suppressed = allowance.suppressed, 0
        if suppressed:  # appended to the format string: the count holds no '%' to confuse the formatting
            record.msg = f"{record.msg} ({suppressed} similar line{'s' if suppressed > 1 else ''} suppressed)"
        return True


def limit_rate(logger: logging.Logger) -> logging.Logger:
    """`logger` with a RateLimit filter (one, however often this is called); returns it."""
    if not any(isinstance(f, RateLimit) for f in logger.filters):
        logger.addFilter(RateLimit())
    return logger
