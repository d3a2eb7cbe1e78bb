"""`layerwatch demo`: the whole stack on the embedded demo model, in one terminal.

With `--engine vllm` the model (SmolLM2 by default) is served by `vllm serve` with layerwatch's plugin
instead of the shim (layerwatch/demo/vllm_serve.py), and a drill restarts it with the plugin's form of
the fault.

Starts the exporter and the shim (on the demo model, or the model --model names: layerwatch/demo/models.py has
each one's serving, load and timing; `smollm2` is a real one), Prometheus and Alertmanager with the
repo's own configs on scaled timing (the demo model's: the end-to-end test's) when their binaries are
installed (Alertmanager delivering to a receiver in this process), and a load generator (sampled
requests only, layerwatch/demo/loadgen.py); then shows the live entropy histogram with the alert state and the
figures each page reads beside it (without Prometheus: the shim's shadow check since it started)
until --duration, Ctrl-C, SIGTERM or SIGHUP (its terminal closed). With --drill, a fault is injected
after a healthy baseline and the view shows its page arriving. Every process it started is stopped on
the way out, whatever the way out is: the stop signals unwind to the `finally` below
(layerwatch/cli/signals.py, which then exits by the signal), and a demo killed outright takes its
processes with it (layerwatch/demo/processes.py).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from layerwatch import argtypes, ports
from layerwatch.alerts.profile_file import PROFILES_DIR, ProfileError, load_profiles
from layerwatch.cli.signals import Stopped
from layerwatch.demo.alert_view import AlertView
from layerwatch.demo.drills import DRILLS, DrillRun
from layerwatch.demo.loadgen import run_load
from layerwatch.demo.models import (
    DEFAULT_MODEL,
    DEMO_MODELS,
    VLLM_DEFAULT_MODEL,
    DemoModel,
    checkpoint_folder,
    demo_model,
    model_cache,
    serve_flags,
)
from layerwatch.demo.receiver import WebhookReceiver
from layerwatch.demo.stack import DemoStack, host_port, monitoring_installed
from layerwatch.demo.vllm_serve import VLLM_DRILL_PAGES, VllmServe
from layerwatch.exporter.live_view import CLEAR_SCREEN, Samples, ScrapeError, fit_view, render_samples, scrape, total
from layerwatch.mixin import config
from layerwatch.settings import add_flags, from_flags, setting

INSTALL_HINT = "scripts/install-system-deps.sh --demo installs them (root or sudo)"
STOP_HINT = "(Ctrl-C stops the demo)"
DRILL_HELP = (
    "after --baseline seconds of healthy traffic, inject the drill's fault (most restart the engine with faulty "
    'flags) and show its alert; each drill\'s fault and alert: docs/demo.md, "Drills"'
)


def _defaults(setting: str) -> str:
    """A flag's default on each demo model, in words: `demo 2, smollm2 1`."""
    return ", ".join(f"{m.name} {getattr(m, setting):g}" for m in DEMO_MODELS.values())


@dataclass(frozen=True, kw_only=True)
class DemoSettings:
    """The model, the ports, the drill and the load; None: the model's own (DemoModel)."""

    model: DemoModel | None = setting(  # None: DEFAULT_MODEL, on vLLM VLLM_DEFAULT_MODEL
        None,
        type=demo_model,
        metavar="NAME|DIR",
        help="; ".join(f"{m.name}: {m.what}" for m in DEMO_MODELS.values())
        + f" (default {DEFAULT_MODEL.name}, with --engine vllm {VLLM_DEFAULT_MODEL.name}); or a checkpoint folder",
    )
    engine: str = setting(
        "shim",
        choices=("shim", "vllm"),
        help="what serves the model: the shim (`layerwatch serve`), or `vllm serve` with layerwatch's plugin "
        "(--enforce-eager, from --vllm-python's environment; a checkpoint folder, not the embedded model; "
        "default %(default)s)",
    )
    vllm_python: str = setting(
        ".venv-vllm/bin/python",
        metavar="PYTHON",
        help="the Python of vLLM's environment, which scripts/setup-vllm.sh makes (default %(default)s)",
    )
    port: int = setting(
        ports.SHIM_HTTP_PORT,
        type=argtypes.port,
        help="the engine's HTTP port, the shim's or vLLM's (default %(default)s)",
    )
    exporter_port: int = setting(
        ports.EXPORTER_HTTP_PORT, type=argtypes.port, help="exporter HTTP port (default %(default)s)"
    )
    prometheus_port: int = setting(ports.PROMETHEUS_PORT, type=argtypes.port, help="(default %(default)s)")
    alertmanager_port: int = setting(ports.ALERTMANAGER_PORT, type=argtypes.port, help="(default %(default)s)")
    no_prometheus: bool = setting(False, help="do not start Prometheus and Alertmanager")
    drill: str | None = setting(None, choices=sorted(DRILLS), help=DRILL_HELP)
    baseline: float | None = setting(
        None,
        type=float,
        help="seconds of healthy traffic before a drill's fault (default: the model's, "
        + _defaults("baseline_seconds")
        + ")",
    )
    concurrency: int | None = setting(
        None, type=int, help="load generator clients (default: " + _defaults("concurrency") + ")"
    )
    max_tokens: int | None = setting(
        None, type=int, help="tokens per generated completion (default: " + _defaults("max_tokens") + ")"
    )
    shadow_rate: float = setting(
        1.0,
        type=float,
        help="share of requests the shim (on vLLM: its guard) compares with the full-depth model "
        "(default %(default)s, as in the end-to-end test: the shuffle drill's page needs the samples)",
    )
    duration: float = setting(0.0, type=float, help="stop after this many seconds (0 = until Ctrl-C)")
    interval: float = setting(2.0, type=argtypes.interval, help="seconds between screen refreshes")
    workdir: str | None = setting(
        None,
        help="where configs, logs and the Prometheus and Alertmanager data go (those two start empty every run; "
        "default: a temporary folder, removed when the demo ends)",
    )
    keep_workdir: bool = setting(
        False,
        help="keep the temporary folder when the demo ends, and print where it is (a --workdir, and the folder "
        "of a demo that failed, are always kept)",
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, DemoSettings)


def run(args: argparse.Namespace) -> int:
    settings = from_flags(DemoSettings, args)
    on_vllm = settings.engine == "vllm"
    model = settings.model or (VLLM_DEFAULT_MODEL if on_vllm else DEFAULT_MODEL)
    if on_vllm and model.gguf is None and model.folder is None:
        print(f"layerwatch demo: --engine vllm serves a checkpoint folder, not {model.what}", file=sys.stderr)
        return 2
    baseline = model.baseline_seconds if settings.baseline is None else settings.baseline
    concurrency = model.concurrency if settings.concurrency is None else settings.concurrency
    max_tokens = model.max_tokens if settings.max_tokens is None else settings.max_tokens
    try:
        drill = model.drill(settings.drill) if settings.drill else None
    except ValueError as exc:
        print(f"layerwatch demo: {exc}", file=sys.stderr)
        return 2
    if drill is not None and on_vllm:  # without the shim's quality guard and fallbacks, another alert pages
        drill = dataclasses.replace(drill, page=VLLM_DRILL_PAGES[drill.name])
    monitoring = not settings.no_prometheus and monitoring_installed()
    if drill is not None and not monitoring:
        why = "--no-prometheus was given" if settings.no_prometheus else f"they are not installed: {INSTALL_HINT}"
        print(f"layerwatch demo: --drill needs Prometheus and Alertmanager to page; {why}", file=sys.stderr)
        return 2
    taken = taken_port(settings, monitoring)
    if taken is not None:
        print(f"layerwatch demo: {taken}: stop what holds it, or give the demo another", file=sys.stderr)
        return 2
    temporary = settings.workdir is None
    workdir = Path(settings.workdir or tempfile.mkdtemp(prefix="layerwatch-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    failed = False
    stack = DemoStack(workdir, model.timing, frame_link=drill is not None and not drill.restarts)
    receiver = WebhookReceiver() if monitoring else None
    stop = threading.Event()
    drill_run: DrillRun | None = None
    interrupted = False
    try:
        if on_vllm:
            serve = vllm_serve(model, Path(settings.vllm_python))
            _say(f"starting vllm serve ({serve.python}): about a minute...")
            engine_url, exporter_url = stack.start_vllm(
                port=settings.port, exporter_port=settings.exporter_port, serve=serve, shadow_rate=settings.shadow_rate
            )
            lines = [
                f"vllm serve (API)   {engine_url}/v1   metrics {engine_url}/metrics",
                serve.note(),
                f"vllm-guard (API)   {stack.guard_url}/v1   metrics {stack.guard_url}/metrics   (the load goes here: "
                f"it checks {settings.shadow_rate:g} of the answers at full depth)",
            ]
        else:
            engine_url, exporter_url = stack.start_core(
                port=settings.port,
                exporter_port=settings.exporter_port,
                shadow_rate=settings.shadow_rate,
                model_flags=serve_flags(model, model_cache(), _say),
            )
            lines = [f"shim (OpenAI API)  {engine_url}/v1   metrics {engine_url}/metrics"]
        lines.append(f"exporter           {exporter_url}/metrics")
        view = None
        if receiver is not None:
            profiles = load_profiles(PROFILES_DIR)
            prometheus_url = stack.start_prometheus(
                engine_url,
                exporter_url,
                profiles=profiles,
                receiver=receiver,
                prometheus_port=settings.prometheus_port,
                alertmanager_port=settings.alertmanager_port,
            )
            view = AlertView(prometheus_url, profiles, stack.timing.rules, receiver)
            lines += [
                f"prometheus         {prometheus_url}/alerts",
                f"alertmanager       http://127.0.0.1:{settings.alertmanager_port}   "
                f"delivers to this demo: {receiver.url('/pager')}, /ticket",
                stack.timing.note(),
            ]
        elif settings.no_prometheus:
            lines.append("prometheus         off (--no-prometheus): no rule is evaluated, no alert can fire")
        else:
            lines.append(f"prometheus         not installed: no rule is evaluated, no alert can fire ({INSTALL_HINT})")
        removed = (
            " (removed when the demo ends; --keep-workdir keeps it)" if temporary and not settings.keep_workdir else ""
        )
        lines.append(f"logs and configs   {workdir}{removed}")
        banner = "\n".join(lines)
        print(banner, flush=True)

        load = threading.Thread(
            target=run_load,
            args=(stack.guard_url or engine_url, stack.model_name),
            kwargs=dict(
                duration=float("inf"),
                concurrency=concurrency,
                max_tokens=max_tokens,
                stop=stop,
                traffic=model.traffic,
            ),
            daemon=True,
        )
        load.start()
        if drill is not None and receiver is not None:
            drill_run = DrillRun(drill, stack, receiver, baseline)
        _show(engine_url, exporter_url, banner, settings, stack, view, drill_run)
    except Stopped:
        interrupted = True
        raise
    except (RuntimeError, TimeoutError, ProfileError) as exc:
        failed = True
        _say(f"layerwatch demo: {exc}", sys.stderr)
        return 1
    finally:
        stop.set()
        stack.stop_all()
        if receiver is not None:
            receiver.close()
        _say("layerwatch demo: stopped every process it started.")
        if temporary and not settings.keep_workdir and not failed:
            shutil.rmtree(workdir, ignore_errors=True)
        else:  # the failed demo's logs say why
            _say(f"layerwatch demo: logs and configs kept in {workdir}")
        if interrupted and drill_run is not None:  # its time to page, if it paged, before the exit by the signal
            _drill_verdict(drill_run, interrupted)
    return 0 if drill_run is None else _drill_verdict(drill_run, interrupted)


def vllm_serve(model: DemoModel, python: Path) -> VllmServe:
    """How vLLM serves `model`: its folder and gates, at the τ of the profile the rules judge it by."""
    folder = checkpoint_folder(model, model_cache(), _say)
    assert folder is not None  # run() refused the embedded model
    by_name = {profile.model_name: profile for profile in load_profiles(PROFILES_DIR)}
    if config.VLLM_SERVED_MODEL_NAME not in by_name:
        raise RuntimeError(f"no profile of {config.VLLM_SERVED_MODEL_NAME} in {PROFILES_DIR}: its τ is unknown")
    gates = model.gates or folder / "gates.safetensors"
    return VllmServe(python, folder, gates, by_name[config.VLLM_SERVED_MODEL_NAME].threshold)


def taken_port(settings: DemoSettings, monitoring: bool) -> str | None:
    """Which of the demo's ports another process holds, naming the demo's flag for it, or None. Found
    by its processes, a taken port failed the demo after they started, in the words of the shim's or
    the exporter's own flags (`--http`, which the demo refuses), and left a workdir behind."""
    wanted = [(settings.port, "the shim's API", "--port"), (settings.exporter_port, "the exporter", "--exporter-port")]
    if monitoring:
        wanted += [
            (settings.prometheus_port, "Prometheus", "--prometheus-port"),
            (settings.alertmanager_port, "Alertmanager", "--alertmanager-port"),
        ]
    for port, what, flag in wanted:
        try:
            ports.reserve((ports.LOOPBACK, port), what, flag).close()
        except OSError as exc:
            return exc.strerror
    return None


def _say(line: str, stream: TextIO = sys.stdout) -> None:
    """Print, unless the terminal is gone (a hang-up): the clean-up goes on without it."""
    with contextlib.suppress(OSError):
        print(line, file=stream, flush=True)


def _drill_verdict(drill_run: DrillRun, interrupted: bool) -> int:
    """The drill's time to page; 1 when it ran its course (--duration) without paging."""
    drill_run.check_page()
    name, page, notified = drill_run.drill.name, drill_run.drill.page, drill_run.drill.notified
    if drill_run.time_to_page is not None:
        _say(f"layerwatch demo: drill {name}: {page} {notified} {drill_run.time_to_page:.1f}s after the fault")
        return 0
    if interrupted:
        return 0
    _say(f"layerwatch demo: drill {name}: {page} was not {notified} before --duration ran out", sys.stderr)
    return 1


def shadow_line(samples: Samples) -> str:
    """The shim's shadow check since it started, from its /metrics (docs/service.md, "Quality guard")."""
    tokens = total(samples, "layerwatch_shadow_tokens_total")
    checked = total(samples, "layerwatch_shadow_requests_total", outcome="checked")
    if not tokens:
        return f"shadow check: {checked:.0f} requests checked, no token yet"
    return (
        f"shadow check: {checked:.0f} requests, {tokens:.0f} tokens compared with full depth; agreement "
        f"{total(samples, 'layerwatch_shadow_agreements_total') / tokens:.3f}, quality cost "
        f"{total(samples, 'layerwatch_shadow_kl_nats_total') / tokens:.4f} nats/token, estimated perplexity "
        f"increase {100 * math.expm1(total(samples, 'layerwatch_shadow_reverse_kl_nats_total') / tokens):+.1f} %"
    )


def _show(
    engine_url: str,
    exporter_url: str,
    banner: str,
    settings: DemoSettings,
    stack: DemoStack,
    view: AlertView | None,
    drill_run: DrillRun | None,
) -> None:
    deadline = time.monotonic() + settings.duration if settings.duration > 0 else float("inf")
    interactive = sys.stdout.isatty()
    while time.monotonic() < deadline:
        stack.check_alive()
        status = ""
        if drill_run is not None:
            drill_run.poll()
            status = "\n".join(drill_run.status()) + "\n\n"
            if view is not None and drill_run.injected_at is not None and drill_run.drill.restarts:
                view.restarting(host_port(engine_url), drill_run.injected_at)
        size = shutil.get_terminal_size()
        try:
            screen = exporter_screen(stack.guard_url or engine_url, exporter_url, view, size.columns)
            if interactive:
                text = frame(banner, status, screen, size.columns, size.lines)
            else:
                text = status + screen(False) + "\n"
        except (OSError, ScrapeError) as exc:  # a drill's restarted shim may close a page mid-body
            text = f"shim or exporter not readable yet: {exc}\n"
        sys.stdout.write((CLEAR_SCREEN if interactive else "") + text + "\n")
        sys.stdout.flush()
        time.sleep(min(settings.interval, max(0.0, deadline - time.monotonic())))


def exporter_screen(quality_url: str, exporter_url: str, view: AlertView | None, columns: int) -> Callable[[bool], str]:
    """The model's part of the screen, read once: rendered with the histogram in place, or
    (`histogram_last`) below the alert state, for a short terminal. `quality_url`: the shim's, or vLLM's guard."""
    samples = scrape(exporter_url)
    clock = time.strftime("%H:%M:%S")
    if view is None:  # no Prometheus: the figures come from the shim or the guard itself
        shadow = shadow_line(scrape(quality_url)) + "\n\n"
        return lambda histogram_last: (
            shadow + render_samples(samples, exporter_url, clock, width=columns, histogram_last=histogram_last)
        )
    snapshot = view.snapshot()
    return lambda histogram_last: render_samples(
        samples,
        exporter_url,
        clock,
        snapshot.compact_lines if histogram_last else snapshot.lines,
        columns,
        expected_static=view.expected_static,
        histogram_last=histogram_last,
    )


def frame(banner: str, status: str, screen: Callable[[bool], str], columns: int, rows: int) -> str:
    """One refresh of a terminal of `columns` × `rows`; in a small one (80 × 24) the banner goes (it
    was printed once at the start) and the drill's status and the alert state stay in sight."""
    whole = banner + "\n\n" + status + screen(False) + "\n\n" + STOP_HINT
    return fit_view(whole, lambda: status + screen(True), columns, rows)
