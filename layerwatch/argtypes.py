"""argparse types of the commands' flags and of the settings declared for them (layerwatch/settings.py):
each parses one flag's text or raises ArgumentTypeError, which argparse reports as
`argument --flag: <message>` with exit code 2."""

from __future__ import annotations

import argparse
import os
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from layerwatch.wire import parse_address

T = TypeVar("T")


def parsed_by(parse: Callable[[str], T]) -> Callable[[str], T]:
    """A parser raising ValueError as an argparse type: its message becomes the flag's error."""

    def parsed(text: str) -> T:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parsed


def fraction(text: str) -> float:
    """A number in [0, 1] (thresholds, rates)."""
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {text}")
    return value


def positive_fraction(text: str) -> float:
    """A number in (0, 1] (a share that must be above zero)."""
    value = float(text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def open_fraction(text: str) -> float:
    """A number strictly between 0 and 1 (a probability whose logit must be finite)."""
    value = float(text)
    if not 0.0 < value < 1.0:  # written so that NaN fails too
        raise argparse.ArgumentTypeError(f"must be in (0, 1), got {text}")
    return value


def share_or_off(text: str) -> float | None:
    """A share in (0, 1], or "off" (None)."""
    return None if text == "off" else positive_fraction(text)


def positive_ints(text: str) -> list[int]:
    """Comma-separated distinct integers above zero, at least one, no entry empty."""
    if not all(part.strip() for part in text.split(",")):
        raise argparse.ArgumentTypeError(f"an empty entry in {text!r}")
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated whole numbers, got {text!r}") from None
    if min(values) < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text!r}")
    if len(set(values)) < len(values):
        raise argparse.ArgumentTypeError(f"an entry given twice in {text!r}")
    return values


def fractions(text: str) -> list[float]:
    """Comma-separated numbers in [0, 1], at least one."""
    try:
        values = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values or not all(0.0 <= v <= 1.0 for v in values):
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {text!r}")
    return values


def layer_numbers(text: str) -> tuple[int, ...]:
    """Comma-separated layer indices."""
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer numbers, got {text!r}") from None


def positive(
    kind: Callable[[str], int] | Callable[[str], float], at_most: float | None = None
) -> Callable[[str], float]:
    """A number of `kind` (int or float) above zero, and at most `at_most` if given."""

    def parse(text: str) -> float:
        value = kind(text)
        if not value > 0:  # written so that NaN fails too
            raise argparse.ArgumentTypeError(f"must be positive, got {text}")
        if at_most is not None and not value <= at_most:
            raise argparse.ArgumentTypeError(f"must be at most {at_most:g}, got {text}")
        return value

    parse.__name__ = getattr(kind, "__name__", "number")  # argparse names the type in its error messages
    return parse


# A screen refresh interval: time.sleep raises OverflowError beyond ~292 years (1e300 was a
# traceback); a day is more than any refresh needs.
MAX_INTERVAL_SECONDS = 86_400.0


def interval(text: str) -> float:
    """Seconds between refreshes: positive, at most MAX_INTERVAL_SECONDS."""
    return positive(float, at_most=MAX_INTERVAL_SECONDS)(text)


def non_negative(text: str) -> float:
    value = float(text)
    if not value >= 0:  # written so that NaN fails too
        raise argparse.ArgumentTypeError(f"must not be negative, got {text}")
    return value


def output_file(text: str) -> Path:
    """A file a command writes when it is done: in an existing folder it may write to, and not a folder
    itself, so that a long run does not end in an error it could have been told at the start."""
    path = Path(text)
    folder = path.parent
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a folder, not a file")
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(f"cannot write {text}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise argparse.ArgumentTypeError(f"cannot write {text}: permission denied")
    return path


def port(text: str) -> int:
    """A TCP port, 0..65535 (0: any free one); bind() raised OverflowError beyond."""
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be 0..65535, got {text}")
    return value


def bind_host(text: str) -> str:
    """A host or address to bind; an empty one would mean every interface (0.0.0.0), which must be
    asked for by name."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must name a host or address (0.0.0.0 for every interface), got ''")
    return text


def listen_address(text: str) -> tuple[str, int]:
    """HOST:PORT to bind; port 0 asks for any free port."""
    try:
        return parse_address(text, listening=True)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def server_url(page: str) -> Callable[[str], str]:
    """A server's base URL, to which a command appends its paths. Given as the demo prints it (the
    page `http://127.0.0.1:9411/metrics`), the page is dropped; `HOST:PORT` alone is read as
    http://HOST:PORT, as the address flags write it. Anything else but an http(s) URL is refused: it
    was read at every refresh as 'unknown url type', with a hint to start an exporter."""

    def parse(text: str) -> str:
        url = (text if "://" in text else "http://" + text).rstrip("/")
        parts = urllib.parse.urlsplit(url)
        try:
            parts.port  # noqa: B018 -- read for its check: http.client's traceback otherwise, at the first read
        except ValueError:  # 'abc', 99999 (which connected to port 99999 - 65536)
            raise argparse.ArgumentTypeError(f"expected a port 0..65535 in {text!r}") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise argparse.ArgumentTypeError(f"expected http://HOST:PORT (or HOST:PORT), got {text!r}")
        return url.removesuffix("/" + page)

    parse.__name__ = "URL"
    return parse
