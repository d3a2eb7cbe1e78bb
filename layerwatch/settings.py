"""Settings declared once: a dataclass field with its default, flag, parsing type and help, from which
the command's flags and the settings object read back from them are derived.

The model is vLLM's EngineArgs: each field of a settings dataclass declared with `setting(...)` is one
flag, `--<field-name>` unless named otherwise, whose dest is the field's name and whose default is the
field's (a field without a default gets None: the command fills it in, unless it is `required`). A bool
field defaulting to False without a type is a switch (store_true); a `positional` field is a positional
argument named by the field. Its LAYERWATCH_<FLAG> variable comes from the flag's name
(layerwatch/cli/main.py). A new flag of any command is one such field; a command that reads a setting
another declares (`--model`, `--device`) declares it `same_as` that one, so that its flag, type and help
are written once.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from layerwatch import argtypes

_SETTING = "layerwatch.setting"


@dataclass(frozen=True)
class Flag:
    help: str | None
    type: Callable[[str], Any] | None = None  # None: the text itself (or a switch, for a bool)
    flag: str | None = None  # None: --<field-name>
    metavar: str | None = None
    choices: Sequence[str] | None = None
    # Applied to a value read from the flags (not to the default None): a key file's key, say. Its
    # ValueError reaches the command, which reports it as it reports the settings' own checks.
    convert: Callable[[Any], Any] | None = None
    required: bool = False
    positional: bool = False


def setting(
    default: Any = dataclasses.MISSING,
    *,
    help: str | None,
    type: Callable[[str], Any] | None = None,
    flag: str | None = None,
    metavar: str | None = None,
    choices: Sequence[str] | None = None,
    convert: Callable[[Any], Any] | None = None,
    required: bool = False,
    positional: bool = False,
    repr: bool = True,
) -> Any:
    """A dataclass field that is also a flag (module doc); repr=False keeps a secret out of its repr."""
    spec = Flag(
        help, type, flag, metavar, tuple(choices) if choices is not None else None, convert, required, positional
    )
    return dataclasses.field(default=default, repr=repr, metadata={_SETTING: spec})


def log_level_setting() -> Any:
    """The log level of a torch-free service (the exporter, the vLLM guard): upper-case as `logging` names it,
    serve's lower-case names taken too, so that one LAYERWATCH_LOG_LEVEL serves every command."""
    return setting("INFO", type=str.upper, choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="(default %(default)s)")


# How long a stopping HTTP service (`serve`, the vLLM guard) lets its in-flight requests finish: under the
# orchestrator's grace period (Kubernetes: 30 s), so that the answers cut off then still go out.
DEFAULT_DRAIN_TIMEOUT_SECONDS = 25.0


def drain_timeout_setting() -> Any:
    return setting(
        DEFAULT_DRAIN_TIMEOUT_SECONDS,
        type=argtypes.non_negative,
        metavar="S",
        help="seconds in-flight requests get to finish after SIGTERM; keep under the orchestrator's kill grace "
        "period (default %(default)s)",
    )


def same_as(cls: type, name: str, default: Any = dataclasses.MISSING, **changes: Any) -> Any:
    """A field declared as `cls`'s field `name` is (its flag, type, help), with its own `default` (else
    that field's) and `changes` to the declaration (a `metavar`, `required`): one setting that two
    commands read, written once."""
    field = {f.name: f for f in dataclasses.fields(cls)}[name]
    spec = flag_of(field)
    assert spec is not None, f"{cls.__name__}.{name} is not a setting"
    spec = dataclasses.replace(spec, flag=flag_name(field), **changes)
    default = field.default if default is dataclasses.MISSING else default
    return dataclasses.field(default=default, repr=field.repr, metadata={_SETTING: spec})


def flag_of(field: dataclasses.Field[Any]) -> Flag | None:
    return field.metadata.get(_SETTING)


def flag_name(field: dataclasses.Field[Any]) -> str:
    """The flag a declared field is set by: its own name for it, else --<field-name>."""
    spec = flag_of(field)
    return (spec.flag if spec is not None else None) or "--" + field.name.replace("_", "-")


def _declared(cls: type, names: Iterable[str] | None) -> list[tuple[dataclasses.Field[Any], Flag]]:
    fields = {f.name: f for f in dataclasses.fields(cls)}
    chosen = [fields[name] for name in names] if names is not None else list(fields.values())
    return [(f, spec) for f in chosen if (spec := flag_of(f)) is not None]


def add_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    names: Iterable[str] | None = None,
    *,
    flags: Mapping[str, str] | None = None,
) -> None:
    """One flag per declared field of `cls` (or of those `names`, in that order). `flags` renames a
    flag where another command reads the same setting under its own name."""
    for field, spec in _declared(cls, names):
        if spec.positional:
            parser.add_argument(field.name, **_given(type=spec.type, metavar=spec.metavar, help=spec.help))
            continue
        name = (flags or {}).get(field.name) or flag_name(field)
        default = None if field.default is dataclasses.MISSING else field.default
        if spec.type is None and default is False:
            parser.add_argument(name, **_given(dest=field.name, action="store_true", help=spec.help))
            continue
        options = _given(type=spec.type, choices=spec.choices, metavar=spec.metavar, help=spec.help)
        if spec.required:
            options["required"] = True
        parser.add_argument(name, dest=field.name, default=default, **options)


def _given(**options: Any) -> dict[str, Any]:
    return {key: value for key, value in options.items() if value is not None}


def changed_from_default(settings: Any, names: Iterable[str]) -> list[str]:
    """The flags of those fields of a settings dataclass that are not at their declared default, in order."""
    fields = {f.name: f for f in dataclasses.fields(settings)}
    return [flag_name(fields[name]) for name in names if getattr(settings, name) != fields[name].default]


def from_flags(cls: type, args: argparse.Namespace, names: Iterable[str] | None = None, **values: Any) -> Any:
    """`cls` built from the flags `add_flags` added (each converted where its declaration says),
    with `values` on top."""
    read = {}
    for field, spec in _declared(cls, names):
        value = getattr(args, field.name)
        read[field.name] = spec.convert(value) if spec.convert is not None and value is not None else value
    return cls(**(read | values))
