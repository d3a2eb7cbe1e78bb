"""`python die_with_parent.py PARENT_PID COMMAND [ARGS...]`: run COMMAND so that it ends with its parent.

layerwatch/demo/processes.py starts every process of the stack through this script, run by its path with the
standard library only. It asks Linux to send the process SIGTERM when the thread that started it
ends (prctl PR_SET_PDEATHSIG, which an exec keeps; processes.py starts them all from one thread
that lives as long as the starting process), then becomes COMMAND (exec: the same pid). So a demo
killed by SIGKILL, which can clean up nothing, still leaves nothing running: each process gets the
SIGTERM it stops cleanly on. A parent already gone by then (not PARENT_PID any more) means exit 1
at once. Elsewhere than on Linux, COMMAND runs without that guard.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def main(argv: list[str]) -> None:
    parent, command = int(argv[0]), argv[1:]
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
            sys.exit(f"die_with_parent: prctl(PR_SET_PDEATHSIG) failed: {os.strerror(ctypes.get_errno())}")
        if os.getppid() != parent:  # it died before the request took effect: nothing would tell us
            sys.exit("die_with_parent: the parent is gone")
    os.execvp(command[0], command)


if __name__ == "__main__":
    main(sys.argv[1:])
