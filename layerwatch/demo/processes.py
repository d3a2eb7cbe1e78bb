"""Start, wait for and stop the stack's processes: used by `layerwatch demo` and the end-to-end tests.

Each process runs in its own session and process group with its output in a log file, so stopping
it also stops anything it spawned, and a terminal's signals reach only whoever started it (the demo
stops its processes itself, in order). Each one also ends with its starter: it gets SIGTERM when
the starting process ends, however it ends (die_with_parent.py), so that a starter killed by
SIGKILL leaves nothing behind either. Linux sends that signal when the *thread* that started the
process ends, so every process is started from one thread that lives as long as this process
(a drill restarts the shim from a thread of its own, which ends once it has).
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

# `layerwatch` in a child process, with the running interpreter (and so the same environment).
LAYERWATCH_COMMAND = [sys.executable, "-m", "layerwatch.cli.main"]
# Runs a command that gets SIGTERM when its parent ends: the standard library only, isolated mode.
DIE_WITH_PARENT = [sys.executable, "-I", "-S", str(Path(__file__).with_name("die_with_parent.py"))]
_STARTER = ThreadPoolExecutor(1, thread_name_prefix="process-starter")  # the parent thread of them all


# Where free_port looks first: below the kernel's ephemeral range, from which it gives every outgoing
# connection its local port. A port from that range (a bind to port 0) is free when chosen, but any
# connection may take it before the process it is for binds it, seconds later: a broken-checkpoint
# test's serve found its port "already in use" so.
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
BELOW_EPHEMERAL = 8192  # how many ports below the range to draw from


# Every port free_port gave this process: ports drawn back to back (a stack's four) are all free
# until their processes bind them, so one could be drawn twice (2 in 2,000 draws of four).
_given: set[int] = set()
_given_lock = threading.Lock()


def free_port(kind: int = socket.SOCK_STREAM) -> int:
    """A port on 127.0.0.1 that is free right now (TCP by default, UDP with SOCK_DGRAM) and that this
    process was never given before: one below the ephemeral range where one is free there, else one
    the kernel picks."""
    try:
        low = int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):  # not Linux
        low = 0
    candidates = range(max(1024, low - BELOW_EPHEMERAL), low)
    with _given_lock:
        for port in random.sample(candidates, min(len(candidates), 20)):
            if port not in _given and _bindable(port, kind):
                _given.add(port)
                return port
        for _ in range(20):
            with socket.socket(socket.AF_INET, kind) as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            if port not in _given:
                _given.add(port)
                return port
    raise OSError(f"no free port on 127.0.0.1 that this process was not given already ({len(_given)} given)")


def _bindable(port: int, kind: int) -> bool:
    with socket.socket(socket.AF_INET, kind) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:  # in use
            return False
        return True


class ManagedProcess:
    def __init__(self, name: str, argv: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.argv = argv
        self.log_path = log_path
        self._log = open(log_path, "ab")  # noqa: SIM115 -- the child writes to it until stop() closes it
        self.proc = _STARTER.submit(
            subprocess.Popen,
            [*DIE_WITH_PARENT, str(os.getpid()), *argv],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        ).result()

    def running(self) -> bool:
        return self.proc.poll() is None

    def wait_http(self, url: str, timeout: float = 60.0, expect: int = 200) -> None:
        """Poll `url` until it answers `expect`; fail with the log's tail if the process dies or time runs out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.running():
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(url, timeout=2) as resp:
                    if resp.status == expect:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.1)
        raise TimeoutError(f"{self.name} did not answer {url} within {timeout:.0f}s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        self._log.flush()
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def kill(self, timeout: float = 10.0) -> int | None:
        """SIGKILL the process group at once: a crash, as far as anything else can tell."""
        self._signal(signal.SIGKILL)
        self.proc.wait(timeout)
        return self.stop()

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM the process group, SIGKILL it if it lingers; returns the exit code."""
        if self.running():
            self._signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                self.proc.wait(timeout)
        self._log.close()
        return self.proc.returncode

    def _signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)
