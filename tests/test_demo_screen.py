"""The demo's screen, rendered by its own code from what a real `layerwatch demo --drill static` read at its
page (tests/demo_screen.py): docs/demo.md shows exactly that, every figure a page reads is on it and
says what it counts, and a small terminal keeps the drill's status and the alerts in sight."""

from __future__ import annotations

import json

from layerwatch.alerts.profile_file import PROFILES_DIR, load_profile
from layerwatch.alerts.signals import figures_for
from layerwatch.demo.alert_view import PAST
from tests.demo_screen import DATA, DOC, doc_sample, render, sample

SCREEN = json.loads(DATA.read_text())
PAGE = "LayerwatchRoutingStatic"


def test_docs_demo_md_shows_the_screen_the_code_renders():
    doc = DOC.read_text()
    start, end = doc_sample(doc)
    assert doc[start:end] == sample(), "docs/demo.md's sample screen is stale: python -m tests.demo_screen docs"


def test_the_captured_run_holds_every_figure_a_page_reads():
    captured = {label for _, label, _ in SCREEN["figures"]}
    demo = load_profile(PROFILES_DIR / "demo.yaml")
    assert {figure.label for figure in figures_for(demo)} <= captured, "recapture: python -m tests.demo_screen capture"


def test_the_screen_labels_what_each_figure_counts():
    screen = sample()
    lines = screen.splitlines()
    assert "skip ratio 0.254  (since the exporter started)" in screen  # the report's, cumulative
    assert "  entropy histogram since the exporter started (cumulative); the verdict reads the window" in lines
    assert (
        "static layers (below τ for ≥95% of tokens: skipped whatever the token) 11,12,13,14  "
        "(healthy profile: 12,13,14)" in screen
    )
    assert "static-run layers (below τ for ≤5% of tokens: run whatever the token) 0,1,2" in screen
    assert "what the pages read (rates: last 3s; routing, peaks: the exporter's window)" in screen
    # Both of the firing alert's triggers have their figure marked, and nothing else is.
    marked = [line.split(PAST)[1] for line in lines if PAST in line]
    assert marked == [f"{PAGE} (share)", f"{PAGE} (new_static_layers)"], lines
    assert "est. perplexity increase    +4.3 %  none     (no alert reads it: context)" in screen
    assert screen.count("LayerwatchTargetDown") == 2 == screen.count("(expected: the drill's restart)")


def test_an_80_by_24_terminal_keeps_the_drill_line_and_the_alerts_in_sight():
    banner = "\n".join(f"banner line {i}" for i in range(8))  # the demo's: addresses and timing
    lines = render(SCREEN, 80, 24, banner).splitlines()
    assert len(lines) <= 23 and max(map(len, lines)) <= 80, lines  # the last row is the cursor's
    assert lines[0].startswith(f"drill static (--static-gates) must page {PAGE}")
    assert lines[1].startswith(f"  PAGED {PAGE} 27.9s after the fault")
    firing = [line for line in lines if line.startswith("  FIRING")]
    assert len(firing) == len(SCREEN["alerts"]) == 5, lines
    # Which figure crossed which limit: both of the page's, marked within the 80 columns (the table
    # was below the notifications, out of sight, and the marks past the 80th column).
    marked = [line for line in lines if PAST in line]
    assert [line[:29].strip() for line in marked] == ["token-dependent share", "newly static layers"], lines
    assert all(line.index(PAST) + len(PAST) < 80 for line in marked), marked
    assert lines[-1].startswith("… ") and lines[-1].endswith("more lines: a taller terminal shows them")
    assert not [line for line in lines if line.startswith("banner")]
