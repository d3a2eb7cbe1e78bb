"""The entry point: subcommands import only what they need, flags fall back to LAYERWATCH_* variables."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

from layerwatch.cli.main import COMMANDS, apply_environment, build_parser


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument("--max-batch-size", type=int, default=8)
    p.add_argument("--allow-debug", action="store_true")
    p.add_argument("--protected-layers", type=int, nargs="*", default=None)
    p.add_argument("trace")
    return p


def test_environment_supplies_defaults_and_the_command_line_wins():
    p = _parser()
    apply_environment(
        p, {"LAYERWATCH_MAX_BATCH_SIZE": "16", "LAYERWATCH_ALLOW_DEBUG": "yes", "LAYERWATCH_PROTECTED_LAYERS": "0,5"}
    )
    args = p.parse_args(["t.jsonl"])
    assert (args.max_batch_size, args.allow_debug, args.protected_layers) == (16, True, [0, 5])
    assert p.parse_args(["t.jsonl", "--max-batch-size", "2"]).max_batch_size == 2
    assert "[env: LAYERWATCH_MAX_BATCH_SIZE]" in p.format_help()


def test_environment_values_are_validated_like_flags_naming_the_variable(capsys):
    for environ, message in [
        ({"LAYERWATCH_MAX_BATCH_SIZE": "many"}, "LAYERWATCH_MAX_BATCH_SIZE='many': invalid int value"),
        ({"LAYERWATCH_ALLOW_DEBUG": "maybe"}, "LAYERWATCH_ALLOW_DEBUG='maybe'"),
        # argparse checks choices only of what the command line gives: a default got through whole.
        ({"LAYERWATCH_LOG_LEVEL": "loud"}, "LAYERWATCH_LOG_LEVEL='loud': expected one of debug, info"),
        ({"LAYERWATCH_PROTECTED_LAYERS": "0,x"}, "LAYERWATCH_PROTECTED_LAYERS='x': invalid int value"),
    ]:
        p = _parser()
        p.add_argument("--log-level", default="info", choices=["debug", "info"])
        with pytest.raises(SystemExit):
            apply_environment(p, environ)
        assert message in capsys.readouterr().err


def test_a_bad_environment_value_does_not_hide_the_help(capsys):
    """LAYERWATCH_PORT=abc must not make `serve -h` exit 2 with the error, the help that explains the
    variable out of reach. The help names the variable and why it is left
    out; without -h the value is still refused."""
    environ = {"LAYERWATCH_PORT": "abc"}
    with pytest.raises(SystemExit) as shown:
        build_parser(["serve", "-h"], environ).parse_args(["serve", "-h"])
    assert shown.value.code == 0
    out = capsys.readouterr().out
    assert "[env: LAYERWATCH_PORT, ignored: LAYERWATCH_PORT='abc': invalid" in " ".join(out.split())
    with pytest.raises(SystemExit) as refused:
        build_parser(["serve"], environ).parse_args(["serve"])
    assert refused.value.code == 2 and "LAYERWATCH_PORT='abc'" in capsys.readouterr().err


def test_a_variable_the_command_does_not_read_is_named(capsys):
    """A misspelt LAYERWATCH_* variable is named, not ignored without a word."""
    environ = {"LAYERWATCH_THRESHHOLD": "0.1", "LAYERWATCH_PORT": "9000"}
    args = build_parser(["serve"], environ).parse_args(["serve"])
    assert args.port == 9000 and args.threshold is None
    err = capsys.readouterr().err
    assert "LAYERWATCH_THRESHHOLD is not a setting of this command: ignored (did you mean LAYERWATCH_THRESHOLD?)" in err
    assert "LAYERWATCH_PORT" not in err
    # `demo` passes its environment on to the serve it starts, which reads LAYERWATCH_THRESHOLD.
    build_parser(["demo"], {"LAYERWATCH_THRESHOLD": "0.1"}).parse_args(["demo"])
    assert "not a setting" not in capsys.readouterr().err


def test_an_empty_bind_host_is_refused_not_read_as_every_interface(capsys):
    # bind(("", port)) listens on every interface: services bind to loopback unless told otherwise.
    for argv, environ in [(["serve", "--host", ""], {}), (["serve"], {"LAYERWATCH_HOST": " "})]:
        with pytest.raises(SystemExit):
            build_parser(argv, environ).parse_args(argv)
        assert "must name a host or address (0.0.0.0 for every interface)" in capsys.readouterr().err
    assert build_parser(["serve"], {}).parse_args(["serve", "--host", "0.0.0.0"]).host == "0.0.0.0"


def test_positionals_are_not_read_from_the_environment():
    p = _parser()
    apply_environment(p, {"LAYERWATCH_TRACE": "x.jsonl"})
    with pytest.raises(SystemExit):
        p.parse_args([])


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_has_help(command):
    parser = build_parser([command])
    sub = parser._subparsers._group_actions[0].choices[command]  # argparse keeps subparsers here
    assert sub.format_help().startswith("usage: layerwatch " + command)


@pytest.mark.parametrize("command", ["exporter", "replay", "top", "generate", "calibrate-trace", "vllm-guard"])
def test_light_commands_never_import_torch(command):
    code = (
        f"import sys; from layerwatch.cli.main import build_parser; build_parser([{command!r}]); "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_serve_flags_take_their_defaults_and_choices_from_the_service():
    """One source per default: `serve` derives every flag default from ServeSettings."""
    import dataclasses
    from pathlib import Path

    from layerwatch.cli.serve import settings_from_arguments
    from layerwatch.inference_shim.runtime.checkpoint import DTYPES
    from layerwatch.inference_shim.runtime.demo_model import served_model_name
    from layerwatch.inference_shim.runtime.model import KV_POLICIES
    from layerwatch.inference_shim.service.shim import ServeSettings

    parser = build_parser(["serve"], environ={})
    serve = parser._subparsers._group_actions[0].choices["serve"]
    actions = {a.dest: a for a in serve._actions}
    for field in dataclasses.fields(ServeSettings):
        assert field.name in actions, f"no serve flag sets ServeSettings.{field.name}"
        if field.default is not dataclasses.MISSING:
            assert actions[field.name].default == field.default, field.name
    assert tuple(actions["kv_policy"].choices) == KV_POLICIES and tuple(actions["dtype"].choices) == tuple(DTYPES)
    assert settings_from_arguments(serve.parse_args(["--model", "m"])) == ServeSettings(model_dir=Path("m"))
    demo = settings_from_arguments(serve.parse_args([]))
    assert served_model_name(demo.model_dir, demo.model_name) == "layerwatch-demo"
    assert demo.model_dir.name == "demo_model"


@pytest.mark.parametrize(
    ("flag", "value"),
    [("--window-seconds", "nan"), ("--model-idle-seconds", "nan"), ("--statistics-cache-seconds", "nan")],
)
def test_numeric_flags_refuse_nan(flag, value, capsys):
    # NaN compares false with everything: a bound written as `value <= 0` would let it through.
    argv = ["exporter", flag, value]
    with pytest.raises(SystemExit):
        build_parser(argv, environ={}).parse_args(argv)
    assert f"argument {flag}: must" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        # Unguarded, time.sleep(1e300) raises OverflowError (a traceback).
        (["top", "--interval", "1e300"], "argument --interval: must be at most 86400"),
        (["demo", "--interval", "nan"], "argument --interval: must be positive"),
        (["serve", "--port", "70000"], "argument --port: must be 0..65535"),
        (["demo", "--exporter-port", "-1"], "argument --exporter-port: must be 0..65535"),
        # Unguarded, accepted, then Prometheus fails once the shim has started.
        (["demo", "--prometheus-port", "70000"], "argument --prometheus-port: must be 0..65535"),
    ],
)
def test_intervals_and_ports_out_of_range_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exit:
        build_parser(argv, environ={}).parse_args(argv)
    assert exit.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "unknown", "hint"),
    [
        # Abbreviations would run each of these, as --drill, --static-gates and --threshold.
        (["demo", "--dril", "static"], "--dril static", "(did you mean --drill?)"),
        (["serve", "--static-gate"], "--static-gate", "(did you mean --static-gates?)"),
        (["eval", "--data", "t.txt", "--thresh", "0.2"], "--thresh 0.2", "(did you mean --threshold?)"),
        # A misspelling, not an abbreviation: the nearest flags are named.
        (["eval", "--data", "t.txt", "--treshold", "0.2"], "--treshold 0.2", "(did you mean --threshold?)"),
    ],
)
def test_an_abbreviated_or_unknown_flag_is_refused_with_the_subcommands_usage(argv, unknown, hint, capsys):
    with pytest.raises(SystemExit) as exit:
        build_parser(argv, environ={}).parse_args(argv)
    err = capsys.readouterr().err
    assert exit.value.code == 2 and err.startswith(f"usage: layerwatch {argv[0]} "), err
    assert err.splitlines()[-1].startswith(f"layerwatch {argv[0]}: error: unrecognized arguments: {unknown} {hint}")


@pytest.mark.parametrize(
    "argv",
    [
        ["top", "--htp", "127.0.0.1:9411"],  # was 'did you mean --help?': no flag of top is like it
        ["top", "--drill", "static"],  # demo's flag; was 'did you mean --url?' (the dashes matched)
    ],
)
def test_an_unknown_flag_like_none_of_the_commands_gets_no_guess(argv, capsys):
    with pytest.raises(SystemExit) as exit:
        build_parser(argv, environ={}).parse_args(argv)
    err = capsys.readouterr().err
    assert exit.value.code == 2 and err.startswith("usage: layerwatch top "), err
    assert err.splitlines()[-1] == f"layerwatch top: error: unrecognized arguments: {' '.join(argv[1:])}"


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        # argparse checks the required arguments first: each was refused as 'the following arguments are
        # required', the typo unnamed (`--ot`: the --out the user meant to give).
        (
            ["calibrate-trace", "t.jsonl", "--ot", "p.yaml"],
            "unrecognized arguments: --ot (did you mean --out?); the following arguments are required: --out",
        ),
        (
            ["replay", "--jsn"],
            "unrecognized arguments: --jsn (did you mean --json?); the following arguments are required: TRACE.jsonl",
        ),
        # A bare `--` where nothing follows: was 'did you mean --help or --url or' ... every flag of top.
        (["top", "--once", "--"], "unrecognized arguments: --"),
        # Known, but after `--`: was 'did you mean --json?'.
        (
            ["replay", "--", "t.jsonl", "--json"],
            "unrecognized arguments: --json (after `--` every argument is a positional one)",
        ),
    ],
)
def test_a_misspelt_flag_is_named_before_the_arguments_it_leaves_missing(argv, error, capsys):
    with pytest.raises(SystemExit) as exit:
        build_parser(argv, environ={}).parse_args(argv)
    err = capsys.readouterr().err
    assert exit.value.code == 2 and err.splitlines()[-1] == f"layerwatch {argv[0]}: error: {error}", err


@pytest.mark.parametrize(
    ("argv", "usage", "error"),
    [
        (["tpo"], "layerwatch", "argument COMMAND: invalid choice: 'tpo' (choose from 'serve', "),
        (["demo", "--drill", "statc"], "layerwatch demo", "argument --drill: invalid choice: 'statc' (choose from "),
    ],
)
def test_a_misspelt_command_or_choice_is_answered_with_the_nearest(argv, usage, error, capsys):
    with pytest.raises(SystemExit) as exit:
        build_parser(argv, environ={}).parse_args(argv)
    last = capsys.readouterr().err.splitlines()[-1]
    assert exit.value.code == 2 and last.startswith(f"{usage}: error: {error}"), last
    assert last.endswith(f") (did you mean {'top' if argv == ['tpo'] else 'static'}?)"), last


@pytest.mark.parametrize(
    ("flag", "given", "read"),
    [
        # The demo prints its exporter as http://127.0.0.1:9411/metrics and its Prometheus as .../alerts:
        # copied into top, they were read as .../metrics/metrics (404: 'Is an exporter running there?')
        # and .../alerts/api/v1/alerts.
        ("--url", "http://127.0.0.1:9411/metrics", "http://127.0.0.1:9411"),
        ("--prometheus", "http://127.0.0.1:9090/alerts/", "http://127.0.0.1:9090"),
        # HOST:PORT, as the exporter's --http takes it, was 'unknown url type: 127.0.0.1' at every refresh.
        ("--url", "127.0.0.1:9411", "http://127.0.0.1:9411"),
        ("--prometheus", "https://prometheus.internal/prefix", "https://prometheus.internal/prefix"),
    ],
)
def test_top_reads_a_server_given_as_the_demo_prints_it_or_as_host_and_port(flag, given, read):
    args = build_parser(["top"], environ={}).parse_args(["top", flag, given])
    assert getattr(args, flag[2:]) == read


@pytest.mark.parametrize("url", ["ftp://127.0.0.1:9411", "http://", "file:///etc/passwd"])
def test_top_refuses_an_address_that_is_not_http(url, capsys):
    with pytest.raises(SystemExit) as exit:
        build_parser(["top"], environ={}).parse_args(["top", "--url", url])
    assert exit.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"layerwatch top: error: argument --url: expected http://HOST:PORT (or HOST:PORT), got {url!r}"
    )


@pytest.mark.parametrize("url", ["http://127.0.0.1:abc", "127.0.0.1:99999", "http://:9411"])
def test_top_refuses_a_port_that_is_not_one(url, capsys):
    """Unguarded, ':abc' is http.client's InvalidURL traceback at the first read,
    ':99999' reads port 34463 (99999 - 65536) and says to start an exporter on 99999."""
    with pytest.raises(SystemExit) as exit:
        build_parser(["top"], environ={}).parse_args(["top", "--prometheus", url])
    assert exit.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].startswith("layerwatch top: error: argument --prometheus: expected")


def test_the_demo_refuses_a_taken_port_by_its_own_flag_before_it_starts_anything(tmp_path):
    """A taken --exporter-port failed the demo once its exporter had started, as 'the exporter's HTTP cannot
    listen on ... (--http)', a flag the demo refuses, and left its workdir behind (exit 1)."""
    import socket

    from layerwatch.demo.processes import LAYERWATCH_COMMAND

    with socket.create_server(("127.0.0.1", 0)) as holder:
        taken = holder.getsockname()[1]
        demo = subprocess.run(
            [*LAYERWATCH_COMMAND, "demo", "--no-prometheus", "--port", "0", "--exporter-port", str(taken)],
            capture_output=True,
            text=True,
            env={**os.environ, "TMPDIR": str(tmp_path)},
            timeout=60,
        )
    assert demo.returncode == 2 and demo.stderr == (
        f"layerwatch demo: the exporter cannot listen on 127.0.0.1:{taken} (--exporter-port): Address already in "
        "use: stop what holds it, or give the demo another\n"
    )
    assert list(tmp_path.iterdir()) == []  # no workdir made


def test_every_argument_parser_of_the_repository_refuses_abbreviations():
    """The benchmarks' and examples' too: `--dur 5` silently read as `--duration 5` hides a typo."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    packages = [d for d in root.iterdir() if d.is_dir() and not d.name.startswith(".") and d.name != "tests"]
    lenient = []
    for path in sorted(p for package in packages for p in package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "argparse.ArgumentParser":
                keywords = {k.arg: ast.unparse(k.value) for k in node.keywords}
                if keywords.get("allow_abbrev") != "False":
                    lenient.append(f"{path.relative_to(root)}:{node.lineno}")
    assert lenient == []


def test_top_without_an_exporter_says_what_to_start():
    """`top` must not retry forever, 'Connection refused (retrying)', naming nothing
    to start. A bound socket that does not listen refuses connections, as a port nobody serves does."""
    import signal
    import socket

    from layerwatch.demo.processes import LAYERWATCH_COMMAND

    with socket.socket() as unserved:
        unserved.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{unserved.getsockname()[1]}"
        once = subprocess.run([*LAYERWATCH_COMMAND, "top", "--once", "--url", url], capture_output=True, text=True)
        running = subprocess.Popen(
            [*LAYERWATCH_COMMAND, "top", "--url", url, "--interval", "0.2"], stdout=subprocess.PIPE, text=True
        )
        try:
            screen = running.stdout.readline() + running.stdout.readline()  # type: ignore[union-attr]
        finally:
            running.send_signal(signal.SIGTERM)
            running.communicate(timeout=30)
    # The command that serves the address read (`--http` is the exporter's flag, not top's).
    start = f"Start one with `layerwatch exporter --http 127.0.0.1:{url.rsplit(':', 1)[1]}`, or the whole demo with "
    assert once.returncode == 1 and once.stderr.count("\n") == 1, once.stderr
    assert f"cannot read {url}/metrics: [Errno 111] Connection refused. " in once.stderr and start in once.stderr
    assert start in screen and screen.rstrip().endswith("`scripts/demo.sh` (retrying every 0.2 s)"), screen
    assert "\x1b" not in screen  # into a pipe: no terminal control codes (they cleared a screen that was not there)


def test_every_commands_flags_are_declared_as_settings():
    """A command's flag is a `setting` of a dataclass (layerwatch/settings.py), its flag, type and help
    written once: no hand-written add_argument in a command module."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    by_hand = []
    for path in sorted((root / "layerwatch" / "cli").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument":
                by_hand.append(f"{path.relative_to(root)}:{node.lineno}")
    assert by_hand == []
