"""The faults `layerwatch demo --drill NAME` injects, and the page each one must raise.

A drill restarts the shim with `serve` flags that break the gates the way the field saw them break
(docs/alerting.md, "The field's reports"), as tests/stack/test_end_to_end.py does (docs/end-to-end.md
has the faults and their times to page there); on vLLM it restarts `vllm serve` with the plugin's form
of those flags (vllm_serve.plugin_drill). A fault outside the engine (frames lost on the way to the
exporter) is injected without a restart. Adding a drill is one entry in DRILLS.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from layerwatch.demo.receiver import PAGER_PATH, TICKET_PATH, WebhookReceiver
from layerwatch.demo.stack import DemoStack


@dataclass(frozen=True)
class Drill:
    name: str
    serve_flags: tuple[str, ...]  # what the shim is restarted with; () for a fault outside it (no restart)
    page: str  # the alert that must notify
    fault: str  # what went wrong, in words
    # Where the rendered alertmanager.yml routes `page` by its severity: the pager (critical) or a ticket.
    receiver: str = PAGER_PATH
    # Without a restart: every this-many-th gate frame is lost between the engine and the exporter
    # (layerwatch/demo/frame_link.py); 0: none.
    lose_every_frame: int = 0

    @property
    def notified(self) -> str:
        """How `page` reaches a person, in a word: paged or ticketed."""
        return "paged" if self.receiver == PAGER_PATH else "ticketed"

    @property
    def restarts(self) -> bool:
        return not self.lose_every_frame


DRILLS: dict[str, Drill] = {
    drill.name: drill
    for drill in (
        Drill(
            "static",
            ("--static-gates",),
            "LayerwatchRoutingStatic",
            "every gate a constant: the same layers skipped for every token, the histogram keeps its two humps",
        ),
        Drill(
            "shuffle",
            ("--shuffle-gates",),
            "LayerwatchGateMiscalibrated",
            "each gate serves another layer: skip decisions no longer follow which layers matter",
        ),
        Drill(
            "scramble",
            ("--scramble-gates",),
            "LayerwatchGateMiscalibrated",
            "each gate on its own layer but reading the wrong features: it reacts to every token, by the wrong signal",
        ),
        Drill(
            "reset",
            ("--reset-gates",),
            "LayerwatchEntropyShapeChanged",
            "gate weights overwritten with freshly initialised ones: every layer scores about 0.5",
        ),
        Drill(
            "surge",
            ("--threshold", "0.3", "--patience", "1"),
            "LayerwatchSkipRateSurge",
            "a config push raises the skip threshold to 0.3 and cuts patience to 1: the skip ratio jumps far "
            "above its recent baseline, under the breaker's line (a ticket: quality is the quality guard's to page)",
            receiver=TICKET_PATH,
        ),
        Drill(
            "telemetry",
            (),
            "LayerwatchTelemetryLoss",
            "the network between the engine and the exporter loses one gate frame in five: the histograms and "
            "verdicts run on part of the traffic (a ticket)",
            receiver=TICKET_PATH,
            lose_every_frame=5,
        ),
        Drill(
            "runaway",
            ("--threshold", "0.95"),
            "LayerwatchRunawaySkipping",
            "skip threshold misconfigured to 0.95: the gates would skip almost every layer, so the fallback breaker "
            "keeps forcing full depth (the skip ratio stays low; the fallbacks page)",
        ),
    )
}


class DrillRun:
    """One drill in a running demo: a healthy baseline, then the fault (the shim restarted with the
    drill's flags, in a thread of its own so that the view keeps refreshing), then its page, timed
    from the start of the restart to the receiver's first firing notification of the drill's alert."""

    def __init__(self, drill: Drill, stack: DemoStack, receiver: WebhookReceiver, baseline_seconds: float) -> None:
        self.drill = drill
        self._stack = stack
        self._receiver = receiver
        self.inject_at = time.monotonic() + baseline_seconds
        self.injected_at: float | None = None  # the restart began
        self.serving_at: float | None = None  # the faulty shim answered /readyz
        self.paged_at: float | None = None
        self.error: str | None = None
        self._thread: threading.Thread | None = None

    def poll(self) -> None:
        """Inject the fault once the baseline is over; notice the page once it arrived."""
        if self._thread is None and time.monotonic() >= self.inject_at:
            self.injected_at = time.monotonic()
            self._thread = threading.Thread(target=self._inject, name=f"drill-{self.drill.name}", daemon=True)
            self._thread.start()
        if self.error is not None:
            raise RuntimeError(f"drill {self.drill.name}: restarting the {self._stack.engine} failed: {self.error}")
        self.check_page()

    def check_page(self) -> None:
        if self.injected_at is not None and self.paged_at is None:
            self.paged_at = self._receiver.first_firing(self.drill.receiver, self.drill.page, since=self.injected_at)

    def _inject(self) -> None:
        try:
            if self.drill.lose_every_frame:
                self._stack.lose_frames(every=self.drill.lose_every_frame)
                self.serving_at = time.monotonic()
            else:
                self.serving_at = self._stack.restart_engine(*self.drill.serve_flags)
        except (RuntimeError, TimeoutError, OSError) as exc:
            self.error = str(exc)

    @property
    def time_to_page(self) -> float | None:
        return None if self.paged_at is None or self.injected_at is None else self.paged_at - self.injected_at

    def status(self) -> list[str]:
        """Two lines: the drill, and where it stands."""
        d = self.drill
        how = f"({' '.join(d.serve_flags)})" if d.restarts else "(no restart)"
        must = "must page" if d.notified == "paged" else "must open a ticket for"
        lines = [f"drill {d.name} {how} {must} {d.page}: {d.fault}"]
        if self.injected_at is None:
            left = max(0.0, self.inject_at - time.monotonic())
            return lines + [f"  healthy baseline: the fault comes in {left:.0f}s"]
        if self.serving_at is None:
            since = time.monotonic() - self.injected_at
            return lines + [f"  fault injected {since:.0f}s ago; the {self._stack.engine} is restarting"]
        restart = self.serving_at - self.injected_at
        took = f"the restart took {restart:.1f}s" if d.restarts else "no restart"
        if self.paged_at is None:
            since = time.monotonic() - self.injected_at
            return lines + [f"  fault injected {since:.0f}s ago; {took}; not {d.notified} yet"]
        page = self.paged_at - self.injected_at
        more = f" ({took}, the alert {page - restart:.1f}s more)" if d.restarts else ""
        return lines + [f"  {d.notified.upper()} {d.page} {page:.1f}s after the fault{more}"]
