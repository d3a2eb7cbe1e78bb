"""docs/demo.md's sample screen: the demo's own rendering (layerwatch/cli/demo.py) of what a real
`layerwatch demo --drill static` read a few seconds after its page, kept in tests/data/demo-screen.json:
the exporter's /metrics page, Prometheus' pending and firing alerts, every figure of layerwatch/alerts/signals.py,
the notifications the demo's receiver got and the drill's times. The limits come from the committed
profiles, so the sample follows them. tests/test_demo_screen.py renders it; to make it again, with
Prometheus and Alertmanager installed (about two minutes):

    python -m tests.demo_screen capture     # runs the drill, rewrites tests/data/demo-screen.json
    python -m tests.demo_screen docs        # rewrites the sample in docs/demo.md from it
"""

from __future__ import annotations

import json
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from layerwatch.alerts.profile_file import PROFILES_DIR, load_profiles
from layerwatch.cli.demo import frame
from layerwatch.demo.alert_view import AlertView, PrometheusAlert, Snapshot
from layerwatch.demo.drills import DRILLS, DrillRun
from layerwatch.demo.loadgen import run_load
from layerwatch.demo.processes import free_port
from layerwatch.demo.receiver import Notification, WebhookReceiver
from layerwatch.demo.stack import DEMO_TIMING, DemoStack, host_port
from layerwatch.exporter.live_view import parse_samples, render_samples
from layerwatch.mixin import config

DATA = Path(__file__).resolve().parent / "data" / "demo-screen.json"
DOC = Path(__file__).resolve().parent.parent / "docs" / "demo.md"
MARKER = "<!-- the sample screen: python -m tests.demo_screen docs (tests/test_demo_screen.py) -->"
DOC_COLUMNS = 173  # the narrowest terminal that shows the alert state beside the histogram
DRILL = "static"
TAKEN_AT = 10_000.0  # the snapshot's monotonic clock, rebuilt: every age is relative to it
SETTLE_SECONDS = 6.0  # after the page: its notification and the figures past their limits are on screen


def render(data: dict, columns: int, rows: int, banner: str = "") -> str:
    """The demo's screen of `data` in a terminal of `columns` × `rows` (an empty banner: none)."""
    profiles = {p.model_name: p for p in load_profiles(PROFILES_DIR)}
    snapshot = Snapshot(
        data["prometheus_url"],
        alerts=[PrometheusAlert(**alert) for alert in data["alerts"]],
        figures={(model, label): value for model, label, value in data["figures"]},
        notifications=[Notification(TAKEN_AT - n["age"], n["receiver"], n["payload"]) for n in data["notifications"]],
        profiles=profiles,
        taken_at=TAKEN_AT,
        window=DEMO_TIMING.rules(config.RATE_WINDOW),
        restart=(data["shim_instance"], TAKEN_AT - data["drill"]["paged_after"] - data["drill"]["page_age"]),
    )
    drill = DrillRun(DRILLS[data["drill"]["name"]], None, None, 0.0)  # type: ignore[arg-type]  # times only
    drill.injected_at = 0.0
    drill.serving_at = data["drill"]["restart_took"]
    drill.paged_at = data["drill"]["paged_after"]
    samples = parse_samples(data["metrics"])

    def screen(histogram_last: bool) -> str:
        return render_samples(
            samples,
            data["exporter_url"],
            data["clock"],
            snapshot.compact_lines if histogram_last else snapshot.lines,
            columns,
            expected_static=lambda model: profiles[model].routing.static_layers if model in profiles else None,
            histogram_last=histogram_last,
        )

    text = frame(banner, "\n".join(drill.status()) + "\n\n", screen, columns, rows)
    return text if banner else text.lstrip("\n")


def capture() -> dict:
    """Run the drill as `layerwatch demo --drill static` does and read everything a few seconds after its page."""
    with tempfile.TemporaryDirectory(prefix="layerwatch-demo-screen-") as workdir:
        stack = DemoStack(Path(workdir))
        receiver = WebhookReceiver()
        stop = threading.Event()
        try:
            shim_url, exporter_url = stack.start_core(
                port=free_port(), exporter_port=free_port(), shadow_rate=1.0, model_flags=[]
            )
            profiles = load_profiles(PROFILES_DIR)
            prometheus_url = stack.start_prometheus(
                shim_url,
                exporter_url,
                profiles=profiles,
                receiver=receiver,
                prometheus_port=free_port(),
                alertmanager_port=free_port(),
            )
            view = AlertView(prometheus_url, profiles, DEMO_TIMING.rules, receiver)
            load = dict(duration=float("inf"), concurrency=2, max_tokens=48, stop=stop)
            threading.Thread(target=run_load, args=(shim_url, stack.model_name), kwargs=load, daemon=True).start()
            drill = DrillRun(DRILLS[DRILL], stack, receiver, baseline_seconds=20.0)
            while drill.paged_at is None or time.monotonic() < drill.paged_at + SETTLE_SECONDS:
                drill.poll()
                stack.check_alive()
                time.sleep(0.5)
            view.restarting(host_port(shim_url), drill.injected_at or 0.0)
            snapshot = view.snapshot()
            with urllib.request.urlopen(exporter_url + "/metrics", timeout=10) as response:
                metrics = response.read().decode()
        finally:
            stop.set()
            stack.stop_all()
            receiver.close()
    assert drill.injected_at is not None and drill.serving_at is not None and drill.paged_at is not None
    if snapshot.error is not None:
        raise RuntimeError(f"Prometheus not readable: {snapshot.error}")
    return {
        "prometheus_url": prometheus_url,
        "exporter_url": exporter_url,
        "shim_instance": host_port(shim_url),
        "clock": time.strftime("%H:%M:%S"),
        "drill": {
            "name": DRILL,
            "restart_took": round(drill.serving_at - drill.injected_at, 1),
            "paged_after": round(drill.paged_at - drill.injected_at, 1),
            "page_age": round(snapshot.taken_at - drill.paged_at, 1),
        },
        "alerts": [
            {"name": a.name, "state": a.state, "labels": a.labels, "active_for": a.active_for} for a in snapshot.alerts
        ],
        "figures": [[model, label, value] for (model, label), value in sorted(snapshot.figures.items())],
        "notifications": [
            {"age": round(snapshot.taken_at - n.received_at, 1), "receiver": n.receiver, "payload": n.payload}
            for n in snapshot.notifications or []
        ],
        "metrics": metrics,
    }


def doc_sample(doc: str) -> tuple[int, int]:
    """Where the sample screen's lines lie in `doc`: the fenced block after MARKER."""
    start = doc.index(MARKER + "\n```\n") + len(MARKER) + 5
    return start, doc.index("```\n", start)


def sample() -> str:
    return render(json.loads(DATA.read_text()), DOC_COLUMNS, 200) + "\n"


if __name__ == "__main__":
    if sys.argv[1:] == ["capture"]:
        DATA.parent.mkdir(exist_ok=True)
        DATA.write_text(json.dumps(capture(), indent=1, sort_keys=True) + "\n")
        print(f"wrote {DATA}")
    elif sys.argv[1:] == ["docs"]:
        doc = DOC.read_text()
        start, end = doc_sample(doc)
        DOC.write_text(doc[:start] + sample() + doc[end:])
        print(f"wrote {DOC}")
    else:
        sys.exit(__doc__)
