"""`layerwatch top`: a terminal view of a live exporter, refreshing in place; with --prometheus, each
model's alerts and the figures its pages read, with their profile limits, beside its histogram.

The views themselves are layerwatch/exporter/live_view.py and layerwatch/demo/alert_view.py. It runs until SIGINT
(Ctrl-C), SIGTERM or SIGHUP (its terminal closed), and exits by the signal (layerwatch/cli/signals.py).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
import urllib.error
import urllib.parse
from dataclasses import dataclass

from layerwatch import argtypes
from layerwatch.alerts.durations import Timing
from layerwatch.alerts.profile_file import PROFILES_DIR, ProfileError, load_profiles
from layerwatch.demo.alert_view import AlertView
from layerwatch.exporter.live_view import CLEAR_SCREEN, fit_view, render_samples, scrape, terminal_text
from layerwatch.ports import EXPORTER_HTTP_PORT, LOOPBACK
from layerwatch.settings import add_flags, from_flags, setting

DEFAULT_URL = f"http://{LOOPBACK}:{EXPORTER_HTTP_PORT}"


@dataclass(frozen=True, kw_only=True)
class TopSettings:
    url: str = setting(
        DEFAULT_URL,
        type=argtypes.server_url("metrics"),
        help="the exporter: http://HOST:PORT, HOST:PORT or its page's address, .../metrics (default %(default)s)",
    )
    prometheus: str | None = setting(
        None,
        type=argtypes.server_url("alerts"),
        metavar="URL",
        help="a Prometheus that evaluates the layerwatch rules (e.g. http://127.0.0.1:9090): show each "
        "model's pending and firing alerts and the figures its pages read beside its histogram",
    )
    time_scale: float = setting(
        1.0,
        type=argtypes.positive(float),
        help="the time scale the rules were rendered with, which names the recorded series "
        "(default %(default)s: production; `layerwatch demo`'s is 0.01)",
    )
    profiles: str = setting(str(PROFILES_DIR), metavar="DIR", help="the models' profiles, for the limits")
    interval: float = setting(2.0, type=argtypes.interval, help="seconds between refreshes (default %(default)s)")
    once: bool = setting(False, help="print one view without terminal control codes and exit")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, TopSettings)


def no_exporter(url: str, exc: Exception) -> str:
    """What a reader without an exporter needs: which one to start, on the address read (`--http`
    is the exporter's flag: `top --http` was refused as 'did you mean --help?')."""
    reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
    exporter = "layerwatch exporter"
    if url != DEFAULT_URL:
        exporter += f" --http {urllib.parse.urlsplit(url).netloc}"
    return (
        f"layerwatch top: cannot read {url}/metrics: {reason}. Is an exporter running there? Start one with "
        f"`{exporter}`, or the whole demo with `scripts/demo.sh`"
    )


def run(args: argparse.Namespace) -> int:
    settings = from_flags(TopSettings, args)
    view = None
    if settings.prometheus:
        try:
            view = AlertView(settings.prometheus, load_profiles(settings.profiles), Timing(settings.time_scale))
        except ProfileError as exc:
            print(f"layerwatch top: {exc}", file=sys.stderr)
            return 2

    def screen(fit: bool) -> str:
        """The view, read once; with `fit`, fitted to the terminal (layerwatch/exporter/live_view.py)."""
        url = settings.url
        samples = scrape(url)
        if not any(name.startswith("layerwatch_exporter_") for name in samples):
            # A shim's /metrics, Prometheus' own, or an empty 200 read as an exporter with no frames yet.
            raise LookupError("no layerwatch_exporter_ series: a shim's page, or another program's?")
        snapshot = view.snapshot() if view is not None else None
        expected = view.expected_static if view is not None else None
        size = shutil.get_terminal_size()

        def render(histogram_last: bool) -> str:
            clock = time.strftime("%H:%M:%S")
            beside = None if snapshot is None else snapshot.compact_lines if histogram_last else snapshot.lines
            return render_samples(
                samples,
                settings.url,
                clock,
                beside,
                size.columns,
                expected_static=expected,
                histogram_last=histogram_last,
            )

        return fit_view(render(False), lambda: render(True), size.columns, size.lines) if fit else render(False)

    def unreadable(exc: Exception) -> str:
        # A page that does not parse, or lacks a series every exporter page has, is a ValueError or a
        # LookupError from the reading; its message may quote the page's labels.
        if isinstance(exc, OSError):
            return terminal_text(no_exporter(settings.url, exc))
        page = f"not a layerwatch exporter's page ({exc})"
        return terminal_text(f"layerwatch top: cannot read {settings.url}/metrics: {page}")

    if settings.once:
        try:
            print(screen(fit=False))
        except (OSError, ValueError, LookupError) as exc:  # (urllib's URLError is an OSError)
            print(unreadable(exc), file=sys.stderr)
            return 1
        return 0
    # Into a pipe or a file (`top | tee log`): each view whole, without the terminal's control codes.
    interactive = sys.stdout.isatty()
    try:
        while True:
            try:
                text = screen(fit=interactive)
            except (OSError, ValueError, LookupError) as exc:
                text = f"{unreadable(exc)} (retrying every {settings.interval:g} s)"
            sys.stdout.write((CLEAR_SCREEN if interactive else "") + text + "\n")
            sys.stdout.flush()
            time.sleep(settings.interval)  # until a stop signal (Ctrl-C, the terminal closing: signals.py)
    except BrokenPipeError:  # the reader went away (`layerwatch top | head`)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit flush succeeds
        return 0
