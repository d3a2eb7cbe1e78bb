"""The `layerwatch` entry point.

Each subcommand lives in its own module, imported only when that subcommand runs, so that
`layerwatch exporter` or `layerwatch generate` never import torch. A command module exposes
`add_arguments(parser)` and `run(args) -> int`; its one-line help is listed here.

Every flag can also be set from the environment as `LAYERWATCH_<FLAG>` (upper case, dashes as
underscores): the environment supplies the default, the command line still wins.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import itertools
import logging
import os
import re
import signal
import sys
from typing import Any, NoReturn

from layerwatch.cli import signals

# command -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": (
        "layerwatch.cli.serve",
        "run the gated model behind an OpenAI-compatible API with metrics and gate frames",
    ),
    "exporter": ("layerwatch.cli.exporter", "receive gate frames and serve entropy histograms and bimodality checks"),
    "vllm-guard": (
        "layerwatch.cli.vllm_guard",
        "proxy vLLM's OpenAI API and check a sample of its answers against the full-depth model",
    ),
    "replay": ("layerwatch.cli.replay", "run the exporter's statistics offline over a trace file"),
    "top": ("layerwatch.cli.top", "live terminal view of an exporter: histogram, verdict, statistics"),
    "train-gates": ("layerwatch.cli.train_gates", "train gate heads for a frozen model on a text file"),
    "eval": ("layerwatch.cli.eval", "perplexity full vs gated, skip rates and speed on a text file"),
    "calibrate": ("layerwatch.cli.calibrate", "measure a healthy baseline run and write the model's profile YAML"),
    "calibrate-trace": (
        "layerwatch.cli.calibrate_trace",
        "write a model's profile YAML from a trace of its healthy traffic (any engine)",
    ),
    "train-demo": (
        "layerwatch.cli.train_demo",
        "train the embedded demo model (tokenizer, backbone) from the KJV text",
    ),
    "import-gguf": (
        "layerwatch.cli.import_gguf",
        "write a checkpoint folder serve, eval and train-gates take from a GGUF file (llama.cpp's format)",
    ),
    "generate": (
        "layerwatch.cli.generate",
        "write the rules, dashboards, deploy configs, docs/metrics.md and docs/flags.md from code (--check)",
    ),
    "demo": (
        "layerwatch.cli.demo",
        "run the whole stack on the demo model (or a real one) and show the live histogram",
    ),
}

# Commands that run until stopped, and import-gguf (minutes of writing, whose partial folder a signal
# must not leave behind): each signal they are sent has a documented effect (signals.py).
LONG_RUNNING = ("serve", "exporter", "vllm-guard", "top", "demo", "import-gguf")

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def env_var_for(action: argparse.Action) -> str | None:
    """`--max-batch-size` -> `LAYERWATCH_MAX_BATCH_SIZE`; positionals have none."""
    longs = [s for s in action.option_strings if s.startswith("--")]
    if not longs or action.dest == "help":
        return None
    return "LAYERWATCH_" + longs[0][2:].upper().replace("-", "_")


def apply_environment(
    parser: argparse.ArgumentParser, environ: dict[str, str], *, command: str | None = None, strict: bool = True
) -> None:
    """Turn `LAYERWATCH_<FLAG>` variables into defaults, parsed and checked as the flags are.

    A bad value is refused naming the variable; with `strict` off (the user asked for `--help`) it is
    left out and the help says so, so that a wrong environment never hides the help that explains it.
    A `LAYERWATCH_*` variable `command` does not read is named on stderr: a misspelt one would
    otherwise be ignored without a word (one shell or compose file may set variables for several
    commands, so it is a warning, not an error)."""
    read: set[str] = set()
    for action in parser._actions:  # argparse offers no public iterator over actions
        name = env_var_for(action)
        if name is None:
            continue
        read.add(name)
        if name not in environ:
            continue
        try:
            _apply_variable(parser, action, name, environ[name])
        except _EnvironmentValueError as exc:
            if strict:
                parser.error(str(exc))
            action.help = (action.help or "") + f" [env: {name}, ignored: {exc}]"
            continue
        action.required = False
        action.help = (action.help or "") + f" [env: {name}]"
    if command is not None:
        for name in sorted(n for n in environ if n.startswith("LAYERWATCH_") and n not in read):
            near = difflib.get_close_matches(name, sorted(read), n=1)
            hint = f" (did you mean {near[0]}?)" if near else ""
            print(
                f"layerwatch {command}: warning: {name} is not a setting of this command: ignored{hint}",
                file=sys.stderr,
            )


class _EnvironmentValueError(ValueError):
    """A LAYERWATCH_* variable whose value its flag would refuse."""


def _apply_variable(parser: argparse.ArgumentParser, action: argparse.Action, name: str, raw: str) -> None:
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        value = raw.strip().lower()
        if value not in _TRUE | _FALSE:
            raise _EnvironmentValueError(f"{name}={raw!r}: expected one of 1/0, true/false, yes/no, on/off")
        enabled = value in _TRUE
        action.default = enabled if isinstance(action, argparse._StoreTrueAction) else not enabled
    elif action.nargs in ("*", "+"):
        action.default = [_environment_value(name, v, action) for v in raw.split(",") if v]
    else:
        action.default = _environment_value(name, raw, action)


def _environment_value(name: str, raw: str, action: argparse.Action) -> object:
    """`raw` parsed as the flag would parse it, type and choices both (argparse checks neither
    against a default); a bad value is refused naming the variable."""
    try:
        value = action.type(raw) if callable(action.type) else raw
    except argparse.ArgumentTypeError as exc:
        raise _EnvironmentValueError(f"{name}={raw!r}: {exc}") from None
    except (TypeError, ValueError):
        raise _EnvironmentValueError(
            f"{name}={raw!r}: invalid {getattr(action.type, '__name__', 'value')} value"
        ) from None
    if action.choices is not None and value not in action.choices:
        raise _EnvironmentValueError(f"{name}={raw!r}: expected one of {', '.join(map(str, action.choices))}")
    return value


class Parser(argparse.ArgumentParser):
    """A parser that takes flags only as written in full (`--dril` once ran `--drill`, `--static-gate`
    served static gates) and refuses a flag it does not know with its own usage, the subcommand's,
    and the flags it is closest to. argparse hands a subcommand's unknown flags up to the top-level
    parser, whose usage names no flag of the subcommand."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._unknown_flags: list[str] = []  # of the arguments being parsed

    def parse_known_args(self, *args: Any, **kwargs: Any) -> Any:  # argparse's own overloads, passed through
        given = args[0] if args else kwargs.get("args")
        self._unknown_flags = self._flags_unknown(sys.argv[1:] if given is None else list(given))
        namespace, unknown = super().parse_known_args(*args, **kwargs)
        if unknown:
            self.error(f"unrecognized arguments: {' '.join(unknown)}{self._did_you_mean(unknown)}")
        return namespace, unknown

    def error(self, message: str) -> NoReturn:
        """argparse checks the required arguments before it reports unknown ones: `train-gates --dta x`
        was refused as 'the following arguments are required: --data', the typo unnamed."""
        if message.startswith("the following arguments are required") and self._unknown_flags:
            unknown = self._unknown_flags
            message = f"unrecognized arguments: {' '.join(unknown)}{self._did_you_mean(unknown)}; {message}"
        # A misspelt command or choice (`layerwatch tpo`, `demo --drill statc`): the one it is closest to.
        choice = re.search(r"invalid choice: '(.*)' \(choose from (.*)\)$", message)
        if choice and (near := difflib.get_close_matches(choice[1], re.findall(r"'([^']*)'", choice[2]), n=1)):
            message += f" (did you mean {near[0]}?)"
        super().error(message)

    def _flags_unknown(self, given: list[str]) -> list[str]:
        """The `--flags` in `given` that this parser does not know (none for the top-level parser: the
        subcommand's are its parser's), up to a `--`. A word with a space is a value, as argparse reads it."""
        if self._subparsers is not None:
            return []
        known = {s for action in self._actions for s in action.option_strings}
        flags = [arg for arg in itertools.takewhile(lambda arg: arg != "--", given) if arg.startswith("--")]
        return [arg for arg in flags if " " not in arg and arg.split("=", 1)[0] not in known]

    def _did_you_mean(self, unknown: list[str]) -> str:
        flags = [s for action in self._actions for s in action.option_strings if s.startswith("--")]
        for arg in unknown:
            if not arg.startswith("--"):
                continue
            written = arg.split("=", 1)[0]
            if written == "--":  # a bare `--` every flag starts with (`top --once --` named all seven)
                continue
            if written in flags:  # known, so unrecognized where it stands (`replay -- t.jsonl --json`)
                return " (after `--` every argument is a positional one)"
            near = [f for f in flags if f.startswith(written)] or self._spelled_alike(written, flags)
            if near:
                return f" (did you mean {' or '.join(near)}?)"
        return ""

    @staticmethod
    def _spelled_alike(written: str, flags: list[str]) -> list[str]:
        """The flags `written` may be a misspelling of, compared without their dashes (which made
        `top --drill` look like `--url`), and never --help (`top --htp` was 'did you mean --help?')."""
        names = {f[2:]: f for f in flags if f != "--help"}
        return [names[n] for n in difflib.get_close_matches(written[2:], list(names), n=3)]


def build_parser(argv: list[str], environ: dict[str, str] | None = None) -> argparse.ArgumentParser:
    environ = dict(os.environ) if environ is None else environ
    parser = Parser(
        prog="layerwatch",
        description="Observability for LLM inference with dynamic layer skipping.",
        epilog="Every flag can also be set as LAYERWATCH_<FLAG> in the environment.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    wanted = _requested_command(argv)
    for name, (module_name, help_line) in COMMANDS.items():
        p = sub.add_parser(name, help=help_line, description=help_line)
        if name != wanted:
            continue  # only the command that runs is imported
        try:
            module = importlib.import_module(module_name)
            module.add_arguments(p)
        except ModuleNotFoundError as exc:
            # A slim install (the exporter's image ships no torch and no model code) lacks some commands.
            parser.error(f"`layerwatch {name}` is not available in this installation: {exc}")
        # `demo` hands its environment on to the serve and exporter it starts, which read their own.
        checked = None if name == "demo" else name
        apply_environment(p, environ, command=checked, strict=not _asks_for_help(argv))
        p.set_defaults(_module=module)
    return parser


def _asks_for_help(argv: list[str]) -> bool:
    return any(arg in ("-h", "--help") for arg in itertools.takewhile(lambda arg: arg != "--", argv))


def _requested_command(argv: list[str]) -> str | None:
    for arg in argv:
        if arg in COMMANDS:
            return arg
    return None


def _ignore_hangups_during_startup() -> None:
    """SIGHUP's default action ends a process at once, saying nothing. `serve` answers it itself once
    its server runs (layerwatch/inference_shim/service/server.py); until then (the imports of torch and the
    model code, loading the model: seconds) a hang-up is logged and ignored. Set before any of
    those imports, which are what takes the time."""
    log = logging.getLogger("layerwatch.serve")
    signal.signal(signal.SIGHUP, lambda *_: log.warning("SIGHUP received during start-up: ignored"))


def _stop_signals(command: str | None) -> tuple[int, ...]:
    """The signals that stop `command` from the start (layerwatch/cli/signals.py); `serve` hands
    SIGTERM and SIGINT over to its server once it runs (a drain), and reloads on SIGHUP."""
    if command == "serve":
        _ignore_hangups_during_startup()
        return (signal.SIGTERM, signal.SIGINT)
    return signals.STOP_SIGNALS if command in LONG_RUNNING else ()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = _requested_command(argv)
    stopping = _stop_signals(command)
    if stopping:  # before the imports: they are the slow part of a start
        while_doing = " during start-up" if command == "serve" else ""
        signals.stop_on(stopping, logging.getLogger(f"layerwatch.{command}"), while_doing)
    try:
        parser = build_parser(argv)
        args = parser.parse_args(argv)
        return int(args._module.run(args) or 0)
    except signals.Stopped as stopped:  # the command's clean-up has run on the way here
        signals.exit_by(stopped.signum)


if __name__ == "__main__":
    sys.exit(main())
