"""layerwatch/log_limit.py: a flood of one kind of refusal logs a burst, then a few lines a period, and
the first line after a quiet spell says how many were held back; other kinds keep their allowance."""

from __future__ import annotations

import logging

from layerwatch.log_limit import RateLimit


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_flood_logs_a_burst_then_says_how_many_it_held_back(caplog):
    clock = Clock()
    log = logging.getLogger("tests.log_limit.flood")
    log.addFilter(RateLimit(burst=3, period=60.0, clock=clock))
    with caplog.at_level(logging.WARNING, logger=log.name):
        for number in range(1000):
            log.warning("refused %d from %s", number, "127.0.0.1")
        assert [r.getMessage() for r in caplog.records] == [f"refused {n} from 127.0.0.1" for n in range(3)]
        clock.now = 20.0  # one line's worth of allowance back (3 a minute)
        log.warning("refused %d from %s", 1000, "127.0.0.1")
        log.warning("refused %d from %s", 1001, "127.0.0.1")
    messages = [r.getMessage() for r in caplog.records]
    assert messages[3:] == ["refused 1000 from 127.0.0.1 (997 similar lines suppressed)"]


def test_each_kind_of_line_keeps_its_own_allowance(caplog):
    log = logging.getLogger("tests.log_limit.kinds")
    log.addFilter(RateLimit(burst=2, period=60.0, clock=Clock()))
    with caplog.at_level(logging.WARNING, logger=log.name):
        for _ in range(50):
            log.warning("refused (%s)", "unauthorized", extra={"rate_key": "unauthorized"})
        log.warning("refused (%s)", "malformed", extra={"rate_key": "malformed"})
        log.warning("another message")
    messages = [r.getMessage() for r in caplog.records]
    assert messages == ["refused (unauthorized)"] * 2 + ["refused (malformed)", "another message"]
