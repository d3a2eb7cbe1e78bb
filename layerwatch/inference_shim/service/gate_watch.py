"""The gate file, watched while serving: a replacement is detected, validated in full, and either
swapped in at a decode-step boundary or rejected while the previous gates keep serving.

Every `interval` seconds the watcher compares the file's size, mtime and inode with what it saw
last (a stat: cheap). When they change it reads the file once and validates those bytes completely
with `load_gates` (safetensors structure, metadata, shapes, the base model's fingerprint), and
checks that the file calibrates the skip policy being served: a new threshold, patience, skip
rule or EWMA weight is a deploy decision (restart to apply), not something to slip in mid-stream.
A half-written file fails to parse (safetensors checks the header's offsets against the data
length), so it is rejected and judged again when the file changes next; the sha256 that
`layerwatch_model_info` reports is always that of bytes that were loaded in full. The swap itself
happens in the engine thread between two decode steps (`EngineWorker.swap_gates`), so no step ever
mixes two gate banks.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from layerwatch.inference_shim.runtime.gates import GateFileError, LoadedGates, load_gates
from layerwatch.inference_shim.runtime.model import Transformer
from layerwatch.inference_shim.service.metrics import GateReloadMetrics
from layerwatch.skip_policy import SkipPolicyConfig

log = logging.getLogger(__name__)

MIN_GATES_WATCH_SECONDS = 0.1  # polls closer than this would keep an idle shim busy for nothing
# The watcher sleeps in Event.wait, which raises OverflowError beyond threading.TIMEOUT_MAX (1e300 s
# killed the watcher thread, and with it every gate reload and SIGHUP check); a day is ample (0: never).
MAX_GATES_WATCH_SECONDS = 86_400.0


@dataclass(frozen=True)
class FileSignature:
    size: int
    mtime_ns: int
    inode: int


def file_signature(path: Path) -> FileSignature | None:
    try:
        stat = path.stat()
    except OSError:
        return None
    return FileSignature(stat.st_size, stat.st_mtime_ns, stat.st_ino)


class GateFileWatcher:
    """Polls one gate file; `apply` (blocking until the engine swapped) is called with valid new gates."""

    def __init__(
        self,
        path: Path,
        model: Transformer,
        policy: SkipPolicyConfig,
        policy_from_file: tuple[str, ...],
        served_sha256: str,
        apply: Callable[[LoadedGates], None],
        metrics: GateReloadMetrics,
        interval: float,
    ) -> None:
        self.path = path
        self._model = model
        self._policy = policy
        self._policy_from_file = policy_from_file  # the policy fields (GateMetadata's names) the file set
        self.served_sha256 = served_sha256
        self._apply = apply
        self._metrics = metrics
        self._interval = interval
        self._seen = file_signature(path)  # the file as it was loaded at start-up
        self._stopping = threading.Event()
        self._wake = threading.Event()  # set by check_now() and stop(): end the wait before the interval
        self._thread = threading.Thread(target=self._run, name="layerwatch-gate-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join()

    def check_now(self) -> None:
        """Check the file at once rather than at the next poll (SIGHUP)."""
        self._wake.set()

    def _run(self) -> None:
        while True:
            self._wake.wait(self._interval)
            self._wake.clear()
            if self._stopping.is_set():
                return
            try:
                self.check()
            except Exception:  # swapping valid gates in failed: serving must go on, on the old gates
                log.exception("swapping in the gate file %s failed", self.path)

    def check(self) -> None:
        """One poll: judge the file if it changed since the last poll."""
        current = file_signature(self.path)
        if current == self._seen:
            return
        self._seen = current
        try:
            loaded = load_gates(self.path, self._model)
            if loaded.sha256 == self.served_sha256:  # touched, or the served bytes put back
                self._metrics.file_rejected.set(0)
                return
            self._check_policy(loaded)
        except (ValueError, OSError) as exc:  # GateFileError is a ValueError; a read can fail mid-replacement
            self._reject(str(exc).removeprefix(f"{self.path}: "))
            return
        except Exception as exc:  # unforeseen (a bug, logged with its traceback): still a file that does not serve
            log.exception("checking the gate file %s failed", self.path)
            self._reject(f"{type(exc).__name__}: {exc}")
            return
        previous = self.served_sha256
        self._apply(loaded)
        self.served_sha256 = loaded.sha256
        self._metrics.loaded.inc()
        self._metrics.file_rejected.set(0)
        log.warning("reloaded gate file %s: gates_sha256 %s -> %s", self.path, previous, loaded.sha256)

    def _check_policy(self, loaded: LoadedGates) -> None:
        for name in self._policy_from_file:
            if name == "ewma_alpha" and self._policy.skip_rule != "ewma":
                continue  # the streak rule does not read it
            in_file, served = getattr(loaded.metadata, name), getattr(self._policy, name)
            if in_file != served:
                raise GateFileError(f"calibrated for {name} {in_file}, serving {served}: restart to apply a new {name}")

    def _reject(self, reason: str) -> None:
        self._metrics.rejected.inc()
        self._metrics.file_rejected.set(1)
        log.error("gate file %s rejected: %s; still serving gates_sha256=%s", self.path, reason, self.served_sha256)
