"""The real `layerwatch exporter` process on loopback: hostile datagrams, promtool, the golden
/metrics page, `top`, agreement with `layerwatch replay`, and slow HTTP clients."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

from layerwatch.alerts.profile_file import PROFILES_DIR, load_profiles
from layerwatch.catalog import ENTROPY_WINDOW_EDGES, EXPORTER, for_component
from layerwatch.demo.alert_view import TIMEOUT as ALERT_VIEW_TIMEOUT
from layerwatch.demo.alert_view import AlertView
from layerwatch.demo.processes import LAYERWATCH_COMMAND
from layerwatch.exporter.live_view import MAX_PAGE_BYTES, ScrapeError, scrape
from layerwatch.statistics import shares_below_edges
from layerwatch.wire import MAX_FRAME_BYTES, encode_frame
from tests.exporter.support import DATA, GOLDEN_TRACE, random_frame, trace_frames
from tests.slow_clients import Trickler, half_sent_requests
from tests.support import wait_for

GOLDEN_METRICS = DATA / "golden-metrics.txt"
# Values that depend on the clock or the host, not on the frames: left out of the golden page.
VOLATILE_PREFIXES = (
    "process_",
    "layerwatch_exporter_scrape_duration_seconds",
    "layerwatch_exporter_scrape_collector_duration_seconds",
)


def hostile_datagrams(rng: np.random.Generator) -> list[bytes]:
    valid = encode_frame(random_frame(rng, 0))
    wrong_version = bytearray(valid)
    wrong_version[4] = 9
    nan_frame = bytearray(valid)
    first_entropy = len(valid) - 4 - 4 * 6 * 4  # 4 rows x 6 layers, then one skip byte per row
    nan_frame[first_entropy : first_entropy + 4] = struct.pack("<f", float("nan"))
    huge_header = struct.pack("<4sBBHHQBB", b"LWGF", 1, 0, 65535, 65535, 0, 1, 1) + b"ms"
    return [
        b"",
        b"\x00",
        b"GET /metrics HTTP/1.1\r\n\r\n",
        rng.bytes(512),
        valid[: len(valid) // 2],
        valid + b"\x00",
        bytes(wrong_version),
        bytes(nan_frame),
        huge_header,
        b"LWGF" + rng.bytes(MAX_FRAME_BYTES - 4),  # right magic, junk up to the size limit
        valid[:20] + rng.bytes(65_507 - 20),  # the largest datagram loopback carries: oversized
    ]


def test_hostile_datagrams_are_counted_and_never_stop_the_exporter(start_exporter) -> None:
    exporter = start_exporter()
    rng = np.random.default_rng(7)
    hostile = hostile_datagrams(rng)
    valid = [encode_frame(random_frame(rng, sequence)) for sequence in range(20)]
    for index, datagram in enumerate(hostile):
        exporter.send(datagram)
        exporter.send(valid[index])
    for datagram in valid[len(hostile) :]:
        exporter.send(datagram)
    wait_for(
        lambda: (
            exporter.value("layerwatch_exporter_frames_malformed_total") == len(hostile)
            and exporter.received_frames() == len(valid)
        )
    )
    assert exporter.process.poll() is None
    assert exporter.get("/healthz") == (200, "ok\n")
    assert exporter.value("layerwatch_exporter_frames_lost_total", model_name="demo") == 0
    assert (
        exporter.value("layerwatch_entropy_count", model_name="demo", decision="run")
        + exporter.value("layerwatch_entropy_count", model_name="demo", decision="skip")
        == 20 * 4 * 6
    )
    assert exporter.stop() == -signal.SIGTERM  # a clean stop, then the exit by the signal (layerwatch/cli/signals.py)


def test_metrics_pass_promtool_and_match_the_catalog(start_exporter) -> None:
    promtool = shutil.which("promtool")
    assert promtool, "promtool (Debian package prometheus) is required"
    exporter = start_exporter("--per-layer", "--min-window-observations", "10", "--min-routing-tokens", "5")
    rng = np.random.default_rng(3)
    exporter.send_frames([encode_frame(random_frame(rng, i, model=m)) for i, m in enumerate(["a", "b"] * 5)])
    text = exporter.metrics_text()
    check = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    exposed = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE layerwatch_")}
    catalog = {spec.name for spec in for_component(EXPORTER)}
    assert exposed == catalog


def test_golden_metrics_for_a_fixed_trace(start_exporter, update_golden: bool) -> None:
    exporter = start_exporter("--per-layer", "--statistics-cache-seconds", "0")
    exporter.send_frames(trace_frames(GOLDEN_TRACE))
    page = stable_lines(exporter.metrics_text())
    if update_golden:
        GOLDEN_METRICS.write_text(page)
        pytest.skip(f"rewrote {GOLDEN_METRICS}")
    assert page == GOLDEN_METRICS.read_text(), (
        "the /metrics page changed; if intended, rerun with --update-golden and review the diff"
    )


def stable_lines(page: str) -> str:
    """The page without the volatile families (their HELP, TYPE and samples)."""

    def name(line: str) -> str:
        return line.split()[2] if line.startswith("# ") else line.split("{")[0].split()[0]

    return "".join(line + "\n" for line in page.splitlines() if not name(line).startswith(VOLATILE_PREFIXES))


def test_live_exporter_agrees_with_replay(start_exporter) -> None:
    exporter = start_exporter("--statistics-cache-seconds", "0")
    exporter.send_frames(trace_frames(GOLDEN_TRACE))
    replay = subprocess.run(
        [*LAYERWATCH_COMMAND, "replay", str(GOLDEN_TRACE), "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    reports = {r["model_name"]: r for r in map(json.loads, replay.stdout.splitlines())}
    assert {name: r["bimodal"] for name, r in reports.items()} == {"demo": True, "flat": False}
    for name, report in reports.items():
        model = {"model_name": name}
        assert exporter.value("layerwatch_entropy_bimodal", **model) == int(report["bimodal"])
        assert exporter.value("layerwatch_entropy_peaks", **model) == report["peaks"]
        assert exporter.value("layerwatch_entropy_window_observations", **model) == report["observations"]
        assert exporter.value("layerwatch_entropy_dip", **model) == pytest.approx(report["dip"], rel=1e-9)
        assert exporter.value("layerwatch_entropy_dip_p_value", **model) == pytest.approx(report["dip_p_value"])
        assert exporter.value("layerwatch_entropy_bimodality_coefficient", **model) == pytest.approx(
            report["bimodality_coefficient"], rel=1e-9
        )
        # The window's distribution, which the shape alert compares with the profile's healthy one: the
        # whole trace is in the window, so its shares below each edge are replay's histogram's.
        below = [exporter.value("layerwatch_entropy_window_below_ratio", **model, edge=e) for e in ENTROPY_WINDOW_EDGES]
        assert below == pytest.approx(shares_below_edges(np.asarray(report["histogram"])), abs=1e-12)
        count = sum(exporter.value("layerwatch_entropy_count", model_name=name, decision=d) for d in ("run", "skip"))
        skips = exporter.value("layerwatch_entropy_count", model_name=name, decision="skip")
        assert count == report["observations"] and skips / count == pytest.approx(report["skip_ratio"])
        layers = [{"model_name": name, "layer": str(layer)} for layer in range(len(report["per_layer_skip_rate"]))]
        layer_skips = [exporter.value("layerwatch_exporter_layer_skips_total", **labels) for labels in layers]
        layer_counts = [exporter.value("layerwatch_layer_entropy_count_total", **labels) for labels in layers]
        assert sum(layer_skips) == skips and sum(layer_counts) == count
        assert np.divide(layer_skips, layer_counts) == pytest.approx(report["per_layer_skip_rate"])


def test_the_verdict_is_withheld_until_the_window_is_large_enough(start_exporter) -> None:
    exporter = start_exporter("--min-window-observations", "100", "--statistics-cache-seconds", "0")
    rng = np.random.default_rng(5)
    exporter.send_frames([encode_frame(random_frame(rng, 0, rows=4, layers=6))])
    assert exporter.value("layerwatch_entropy_window_observations", model_name="demo") == 24
    assert exporter.value("layerwatch_entropy_bimodal", model_name="demo") is None
    exporter.send_frames([encode_frame(random_frame(rng, i, rows=4, layers=6)) for i in range(1, 5)])
    assert exporter.value("layerwatch_entropy_bimodal", model_name="demo") == 0  # uniform: one peak


def test_top_shows_histogram_verdict_and_statistics(start_exporter) -> None:
    exporter = start_exporter("--statistics-cache-seconds", "0")
    exporter.send_frames(trace_frames(GOLDEN_TRACE))
    top = subprocess.run(
        [*LAYERWATCH_COMMAND, "top", "--url", exporter.url, "--once"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "\x1b" not in top.stdout
    assert "demo: bimodal  (6,000 observations, window 6,000)" in top.stdout
    assert "flat: single-peak  (2,000 observations, window 2,000)" in top.stdout
    assert "skip ratio 0.560" in top.stdout
    assert "0.05-0.10 ████" in top.stdout
    assert "frames received 500" in top.stdout
    # The exporter as the demo prints it (its page) and as HOST:PORT: the same view.
    for given in (exporter.url + "/metrics", exporter.url.removeprefix("http://")):
        copied = subprocess.run([*LAYERWATCH_COMMAND, "top", "--url", given, "--once"], capture_output=True, text=True)
        assert copied.returncode == 0 and "demo: bimodal  (6,000 observations" in copied.stdout, copied.stderr

    # With a Prometheus it cannot read, the view still shows the exporter, and says so beside each
    # model's histogram when the terminal is wide enough (COLUMNS), below it when not.
    for columns, beside in (("200", True), ("80", False)):
        top = subprocess.run(
            [*LAYERWATCH_COMMAND, "top", "--url", exporter.url, "--once", "--prometheus", "http://127.0.0.1:9"],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "COLUMNS": columns},
        )
        assert "demo: bimodal  (6,000 observations, window 6,000)" in top.stdout
        unreadable = [line for line in top.stdout.splitlines() if "Prometheus http://127.0.0.1:9: not readable" in line]
        assert len(unreadable) == 2, top.stdout  # one per model
        assert all(("0.00-0.05" in line) == beside for line in unreadable), top.stdout


class StaticPage:
    """A loopback HTTP server answering every GET with one page: what `top --url` may be pointed at."""

    def __init__(self, page: str) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = page.encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def __enter__(self) -> StaticPage:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_top_shows_a_pages_escape_sequences_escaped_and_refuses_a_page_it_cannot_read() -> None:
    # Unescaped, label values reach the terminal raw (retitle it, clear it),
    # and a page without layerwatch_entropy_zero_total was a traceback carrying the raw escape.
    hostile = "demo\x1b]0;owned\x07\x1b[2J"
    page = GOLDEN_METRICS.read_text().replace('model_name="demo"', f'model_name="{hostile}"')
    with StaticPage(page) as server:
        top = subprocess.run(
            [*LAYERWATCH_COMMAND, "top", "--url", server.url, "--once"], capture_output=True, text=True
        )
    assert top.returncode == 0, top.stderr
    assert "\x1b" not in top.stdout and "\x07" not in top.stdout
    assert r"demo\x1b]0;owned\x07\x1b[2J: bimodal  (6,000 observations, window 6,000)" in top.stdout

    without_zeros = "".join(line for line in page.splitlines(True) if "layerwatch_entropy_zero_total" not in line)
    with StaticPage(without_zeros) as server:
        top = subprocess.run(
            [*LAYERWATCH_COMMAND, "top", "--url", server.url, "--once"], capture_output=True, text=True
        )
    assert top.returncode == 1 and "Traceback" not in top.stderr and "\x1b" not in top.stderr, top.stderr
    (line,) = top.stderr.splitlines()
    assert line.startswith(f"layerwatch top: cannot read {server.url}/metrics: not a layerwatch exporter's page")
    assert r"demo\x1b]0;owned\x07\x1b[2J: no layerwatch_entropy_zero_total" in line


def test_top_into_a_pipe_writes_each_view_whole_without_control_codes() -> None:
    """`layerwatch top | tee log` got each view cut to 80 x 24 ('… N more lines: a taller terminal
    shows them', with no terminal there) behind a clear-screen code."""
    with StaticPage(GOLDEN_METRICS.read_text()) as server:
        top = subprocess.Popen(
            [*LAYERWATCH_COMMAND, "top", "--url", server.url, "--interval", "0.2"],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "COLUMNS": "80", "LINES": "24"},
        )
        try:
            lines = [top.stdout.readline() for _ in range(60)]  # type: ignore[union-attr]
        finally:
            top.send_signal(signal.SIGTERM)
            top.communicate(timeout=30)
    assert not [line for line in lines if "\x1b" in line or "a taller terminal shows them" in line], lines
    assert [line.strip() for line in lines].count("0.95-1.00                                          0") >= 1, lines


def test_top_given_alertmanager_for_prometheus_says_so_and_shows_the_exporter() -> None:
    """Alertmanager 0.25 (the demo's) answers /api/v1/alerts with a list; `top --prometheus` at it, the address
    the demo prints below Prometheus', exited 1 with a TypeError traceback."""
    with StaticPage(GOLDEN_METRICS.read_text()) as exporter, StaticPage('{"status":"success","data":[]}') as am:
        top = subprocess.run(
            [*LAYERWATCH_COMMAND, "top", "--once", "--url", exporter.url, "--prometheus", am.url],
            capture_output=True,
            text=True,
            env={**os.environ, "COLUMNS": "80"},
        )
    assert top.returncode == 0 and "Traceback" not in top.stderr, top.stderr
    assert "demo: bimodal  (6,000 observations, window 6,000)" in top.stdout
    unreadable = (
        f"Prometheus {am.url}: not readable (/api/v1/alerts: not an answer of Prometheus' API (is this Prometheus?))"
    )
    assert top.stdout.count(unreadable) == 2, top.stdout  # one per model


class StreamedPage:
    """A loopback server answering one GET with `head` and `chunks` of a page, `interval` seconds apart,
    then closing."""

    def __init__(
        self,
        chunks: Iterator[bytes],
        interval: float = 0.0,
        head: bytes = b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\n",
    ) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"

        def serve() -> None:
            connection, _ = self.listener.accept()
            with connection, contextlib.suppress(OSError):  # the reader may hang up first
                connection.recv(65536)
                connection.sendall(head)
                for chunk in chunks:
                    connection.sendall(chunk)
                    time.sleep(interval)

        threading.Thread(target=serve, daemon=True).start()

    def __enter__(self) -> StreamedPage:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.listener.close()


def test_a_page_that_trickles_or_never_ends_is_given_up_on() -> None:
    """Whatever answers at --url: a page a comment line every 0.3 s held `top --once` forever (the socket's
    timeout bounds each read, not the page), and an endless one grew top to 4.4 GB in 20 s."""
    with StreamedPage((b"# still coming\n" for _ in range(40)), interval=0.3) as trickling:
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="the page took over 1 s"):
            scrape(trickling.url, timeout=1.0)
        assert time.monotonic() - started < 3.0
    # The head a byte at a time: read by http.client line by line, it got the same
    # per-read timeout, and no bound on the whole.
    head = b"HTTP/1.0 200 OK\r\n" + b"X-Padding: still coming\r\n" * 3 + b"\r\n"
    with StreamedPage((bytes([byte]) for byte in head), interval=0.3, head=b"") as trickling:
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="the page took over 1 s"):
            scrape(trickling.url, timeout=1.0)
        assert time.monotonic() - started < 3.0
    line = b"# " + b"x" * 65_534 + b"\n"
    endless = StreamedPage(itertools.repeat(line, MAX_PAGE_BYTES // len(line) + 2))
    with endless, pytest.raises(ValueError, match="a page over 64 MiB"):
        scrape(endless.url)


def test_a_broken_http_answer_is_a_one_line_refusal_not_a_traceback_or_a_short_page() -> None:
    """Unguarded, http.client's own errors (neither OSError nor ValueError) end
    `top` with a traceback, and a page cut short of its Content-Length is read as the whole page."""
    page = b"layerwatch_exporter_frames_total 1\n" * 20
    answers = {
        b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(page) + page[:70]: "the page ended 630 bytes short",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n100\r\n" + page[:70]: "IncompleteRead",
        b"HTTP/1.1 200 OK\r\nX: " + b"a" * 70_000 + b"\r\n\r\n": "LineTooLong: got more than 65536 bytes",
        b"HTTP/1.1 200 OK\r\n" + b"X: a\r\n" * 150 + b"\r\n": "HTTPException: got more than 100 headers",
        b"HELLO\r\n\r\n": "BadStatusLine: HELLO",
    }
    for answer, reason in answers.items():
        with StreamedPage(iter([answer]), head=b"") as broken, pytest.raises(ScrapeError, match=reason):
            scrape(broken.url)
    with StreamedPage(iter([b"HELLO\r\n\r\n"]), head=b"") as broken:
        top = subprocess.run(
            [*LAYERWATCH_COMMAND, "top", "--once", "--url", broken.url], capture_output=True, text=True, timeout=60
        )
    assert top.returncode == 1 and top.stderr.strip().splitlines() == [
        f"layerwatch top: cannot read {broken.url}/metrics: not a layerwatch exporter's page "
        "(not an HTTP answer: BadStatusLine: HELLO)"
    ], top.stderr


def test_a_hostile_prometheus_leaves_the_alert_view_one_line_within_its_timeout() -> None:
    """Unbounded, `top --prometheus` at a server trickling its answer, body or head, hangs
    for good (the timeout bounds each read, not the answer); a broken HTTP answer ends `top` with a
    traceback; an alert without labels is reported as the exporter's page being unreadable."""
    json_head = b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\n\r\n"
    answers = [
        (json_head + b'{"status": "success", "data": {"alerts": [', itertools.repeat(b" ", 100), "took over 3 s"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 500\r\n\r\n{", iter([]), "ended 499 bytes short of its Content-Length"),
        (b"HELLO\r\n\r\n", iter([]), "not an HTTP answer: BadStatusLine: HELLO"),
        (json_head + b'{"status": "success", "data": {"alerts": [{"state": "firing"}]}}', iter([]), "an alert without"),
        # The head a byte every 0.2 s: bounded by the per-read timeout only, it held the view 25 s and more.
        (b"", (bytes([byte]) for byte in json_head * 3), "took over 3 s"),
    ]
    for head, rest, reason in answers:
        with StreamedPage(rest, interval=0.2, head=head) as prometheus:
            started = time.monotonic()
            snapshot = AlertView(prometheus.url, load_profiles(PROFILES_DIR)).snapshot()
            assert time.monotonic() - started < 3 * ALERT_VIEW_TIMEOUT
        assert snapshot.error is not None and reason in snapshot.error and "\n" not in snapshot.error, snapshot.error


def test_top_reports_an_unreachable_exporter() -> None:
    top = subprocess.run(
        [*LAYERWATCH_COMMAND, "top", "--url", "http://127.0.0.1:9", "--once"],
        capture_output=True,
        text=True,
    )
    assert top.returncode == 1 and "cannot read http://127.0.0.1:9/metrics" in top.stderr


def _top_once_against(handler: type[BaseHTTPRequestHandler]) -> tuple[str, subprocess.CompletedProcess]:
    """`top --once` at a server on loopback whose requests `handler` answers: its URL and top's run."""
    with ThreadingHTTPServer(("127.0.0.1", 0), handler) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        url = f"http://127.0.0.1:{server.server_address[1]}"
        top = subprocess.run([*LAYERWATCH_COMMAND, "top", "--once", "--url", url], capture_output=True, text=True)
        server.shutdown()
    return url, top


def test_top_tells_a_server_that_is_not_an_exporter_from_no_server() -> None:
    """A server answering 404 is not told 'Is an exporter running there? Start one with ...'."""
    url, top = _top_once_against(BaseHTTPRequestHandler)  # no do_GET: 501
    assert top.returncode == 1 and top.stderr == (
        f"layerwatch top: cannot read {url}/metrics: not a layerwatch exporter's page (HTTP 501 Unsupported method "
        "('GET'))\n"
    )


class _PageHandler(BaseHTTPRequestHandler):
    page = b""

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(len(self.page)))
        self.end_headers()
        self.wfile.write(self.page)

    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.parametrize(
    "page",
    [b"", b'layerwatch_requests_total{model_name="m",status="ok"} 3.0\n'],
    ids=["an empty 200", "a shim's page"],
)
def test_top_refuses_a_metrics_page_that_is_not_an_exporters(page: bytes) -> None:
    """`top --url` at the shim's port (or at any server answering 200 with
    an empty page) showed 'frames received 0 ... no gate frames received yet', an idle exporter."""
    url, top = _top_once_against(type("Handler", (_PageHandler,), {"page": page}))
    assert top.returncode == 1 and top.stderr == (
        f"layerwatch top: cannot read {url}/metrics: not a layerwatch exporter's page (no layerwatch_exporter_ "
        "series: a shim's page, or another program's?)\n"
    )


def test_unknown_paths_are_404_and_bad_flags_are_refused(start_exporter) -> None:
    exporter = start_exporter()
    assert exporter.get("/nope")[0] == 404
    refused = subprocess.run(
        [*LAYERWATCH_COMMAND, "exporter", "--window-max-observations", "100000"],
        capture_output=True,
        text=True,
    )
    assert refused.returncode == 2 and "p-values stop being valid" in refused.stderr


def test_the_exporter_never_imports_torch_or_the_shim() -> None:
    code = (
        "import sys, pkgutil, importlib, layerwatch.exporter, layerwatch.wire, layerwatch.trace\n"
        "for m in pkgutil.iter_modules(layerwatch.exporter.__path__):\n"
        "    importlib.import_module('layerwatch.exporter.' + m.name)\n"
        "print(sorted(n for n in sys.modules if n.startswith(('torch', 'layerwatch.inference_shim'))))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def _threads(pid: int) -> int:
    return int(re.search(r"^Threads:\s+(\d+)", Path(f"/proc/{pid}/status").read_text(), re.M)[1])


def test_half_sent_requests_hold_no_thread_and_never_keep_a_scrape_out(start_exporter) -> None:
    """A thread per connection and no deadline would let 600 half-sent requests hold 604 threads
    for good, and a scrape time out during a burst of 1,000 connections. Here one event-loop thread
    reads every request head (within 10 s), at most
    64 connections are open, and each new one closes the one waiting longest for its head."""
    exporter = start_exporter()
    address = ("127.0.0.1", int(exporter.url.rsplit(":", 1)[1]))
    held = half_sent_requests(address, 300)
    try:
        started = time.monotonic()
        assert exporter.get("/metrics")[0] == 200
        assert time.monotonic() - started < 2.0
        assert _threads(exporter.process.pid) <= 12  # main, frames, the event loop, a few workers
    finally:
        for connection in held:
            connection.close()
    with Trickler(address, 100, head=b"GET /metrics HTTP/1.1\r\nX-Slow: ", interval=0.1):
        for _ in range(5):
            started = time.monotonic()
            assert exporter.get("/metrics")[0] == 200
            assert time.monotonic() - started < 2.0
    assert exporter.process.poll() is None
