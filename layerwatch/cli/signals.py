"""How the long-running commands answer signals (docs/interfaces.md, "Signals").

SIGTERM and SIGINT stop `serve`, `exporter`, `top`, `demo` and `import-gguf` (which removes the
folder it was writing): the command undoes what it started,
says so, and exits by the signal (status 128 + its number: 143, 130), as a shell expects of a
program it interrupted. SIGHUP reloads where there is something to reload (`serve`: the gate file;
it never stops it) and stops the others like SIGTERM (status 129): `top` and `demo` run in a
terminal, and a closed terminal must not leave them or what they started running; `exporter` has
nothing to reload (every setting is a flag), and a hang-up means whoever ran it by hand is gone.
A signal that is ignored when the command starts (`nohup`, a background job's SIGINT) stays ignored.

`stop_on` makes those signals raise `Stopped` in the main thread, wherever it is (in the imports of
start-up included), so that the command's `finally` clean-up runs; `main` then exits by the signal.
Once stopping, further stop signals are logged and ignored: each clean-up step has its own timeout.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
from collections.abc import Iterable
from types import FrameType
from typing import NoReturn

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class Stopped(BaseException):
    """A stop signal arrived (a BaseException, as KeyboardInterrupt: `except Exception` lets it through)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def stop_on(signums: Iterable[int], log: logging.Logger, while_doing: str = "") -> None:
    """From now on, each of `signums` (unless ignored) logs `SIGTERM received{while_doing}: stopping`
    and raises Stopped."""

    def stop(signum: int, _: FrameType | None) -> None:
        for other in STOP_SIGNALS:
            if signal.getsignal(other) is stop:
                signal.signal(other, already_stopping)
        log.warning("%s received%s: stopping", signal.Signals(signum).name, while_doing)
        raise Stopped(signum)

    def already_stopping(signum: int, _: FrameType | None) -> None:
        log.warning("%s received while stopping: ignored", signal.Signals(signum).name)

    for signum in signums:
        if signal.getsignal(signum) is not signal.SIG_IGN:
            signal.signal(signum, stop)


def exit_by(signum: int) -> NoReturn:
    """End the process by `signum`'s default action, so that its parent sees it was stopped by it."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a terminal that hung up, a closed pipe
            stream.flush()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
    sys.exit(128 + signum)  # not reached: the default action of every stop signal ends the process
