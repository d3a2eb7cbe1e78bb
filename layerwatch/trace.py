"""Trace files: JSON Lines, one line per decoded token of one sequence (docs/interfaces.md, "Trace format").

    {"model_name": "demo", "scores": [0.91, 0.07, ...], "skipped": [0, 1, ...]}

`scores` holds one gate entropy in [0, 1] per layer, `skipped` 0/1 per layer (1 = the layer did not
run). Optional `"threshold"`: the skip policy's τ in [0, 1] that the line was decided with (the shim
writes it; `layerwatch replay --threshold` stands in for lines without it). Unknown keys are
ignored. `layerwatch serve --trace-file` writes it, `layerwatch replay` reads it.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import stat
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from layerwatch.skip_policy import check_threshold, is_threshold
from layerwatch.wire import check_gate_arrays, unprintable

log = logging.getLogger(__name__)


class TraceError(ValueError):
    """A trace line is not valid; the message names the file and line."""


# The longest line read: 4 MiB holds 200,000 layers of the widest numbers the writer formats
# ("1.2345678e-05, " and "0, "), far beyond any model, while what one line costs to parse stays
# bounded (~16 bytes of Python objects per byte of JSON: a 160 MB line took 2.5 GB).
MAX_LINE_BYTES = 4 << 20
# read_trace_batches stacks at most this many entropies per batch (4 MiB of float32).
MAX_BATCH_VALUES = 1 << 20


@dataclass(frozen=True, eq=False)
class TraceRecord:
    line_number: int
    model_name: str
    scores: np.ndarray  # float32 [layers]
    skipped: np.ndarray  # bool [layers]
    threshold: float | None = None  # the optional "threshold" key


@dataclass(frozen=True, eq=False)
class TraceBatch:
    """Consecutive records of one model with the same layer count and threshold, stacked."""

    model_name: str
    entropies: np.ndarray  # float32 [rows, layers]
    skipped: np.ndarray  # bool [rows, layers]
    threshold: float | None = None
    first_line: int = 0  # the line number of its first record


DROP_REASONS = ("max_bytes", "write_error")


class TraceWriter:
    """Appends trace lines to `path`, whole lines or nothing.

    Writing stops for good once a line would take the file past `max_bytes`, or once a write fails
    (disk full, file-size limit, I/O error): a trace with holes would misrepresent the sequences it
    holds. A failed write is cut back off the file, so the file always ends with a whole line; the
    write that failed raises its OSError, the calls after it drop their lines silently. Lines written
    are counted in `written`, lines not written in `dropped[reason]`. Safe to call from several
    threads. Appends to an existing file, whose size counts toward the cap. With a `threshold`, every
    line carries it (the optional "threshold" key).
    """

    def __init__(self, path: str | os.PathLike[str], max_bytes: int, threshold: float | None = None) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        if threshold is not None:
            check_threshold(threshold)
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.threshold = threshold
        self.written = 0
        self.dropped = dict.fromkeys(DROP_REASONS, 0)
        self._lock = threading.Lock()
        self._fd: int | None = _open_for_appending(self.path)
        self._size = os.fstat(self._fd).st_size
        self._stopped: str | None = None  # the drop reason once writing stopped

    def write_rows(self, model_name: str, entropies: np.ndarray, skipped: np.ndarray) -> None:
        """Write one line per row: entropies float [rows, layers], skipped 0/1 [rows, layers]."""
        with self._lock:
            if self._stopped is not None and self._fd is not None:
                # Writing stopped for good: count the rows without formatting them (the engine thread
                # calls this every decode step).
                self.dropped[self._stopped] += len(entropies)
                return
        entropies, skipped = check_gate_arrays(entropies, skipped)
        lines = [_format_line(model_name, e, s, self.threshold) for e, s in zip(entropies, skipped)]
        with self._lock:
            if self._fd is None:
                raise ValueError(f"trace writer for {self.path} is closed")
            kept = self._fitting(lines) if self._stopped is None else []
            if len(kept) < len(lines) and self._stopped is None:
                self._stopped = "max_bytes"
            if kept:
                data = b"".join(kept)
                try:
                    _append_whole(self._fd, data)
                except OSError:
                    self._stopped = "write_error"
                    self.dropped["write_error"] += len(lines)
                    raise
                self._size += len(data)
                self.written += len(kept)
            if self._stopped is not None:
                self.dropped[self._stopped] += len(lines) - len(kept)

    def _fitting(self, lines: list[bytes]) -> list[bytes]:
        """The leading lines that keep the file within max_bytes."""
        size = self._size
        for count, line in enumerate(lines):
            size += len(line)
            if size > self.max_bytes:
                return lines[:count]
        return lines

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                fd, self._fd = self._fd, None
                os.close(fd)

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _open_for_appending(path: Path) -> int:
    """An unbuffered descriptor appending to `path`, a file created owner-only (0600: a trace holds the
    token-level routing of user traffic). ValueError for anything but a regular file or a character
    device (/dev/null, /dev/full): a FIFO blocked `serve`'s start in open() for ever, holding its port,
    and a block device is a disk. An existing file keeps its mode; one that group or others may read
    is logged at WARNING.

    Unbuffered, so that a failed write leaves nothing behind in a buffer for close() to retry.
    """
    # O_NONBLOCK: a FIFO opens at once (or fails, ENXIO, without a reader), to be refused by fstat
    # rather than waited on; the check is on what was opened, so a file swapped in between cannot slip by.
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NONBLOCK, 0o600)
    except OSError as exc:
        if exc.errno == errno.ENXIO:
            raise ValueError(f"trace file {path}: not a regular file (a FIFO or socket nothing reads)") from None
        raise
    try:
        mode = os.fstat(fd).st_mode
        if not (stat.S_ISREG(mode) or stat.S_ISCHR(mode)):
            raise ValueError(f"trace file {path}: not a regular file")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    if stat.S_ISREG(mode) and mode & 0o044:
        log.warning(
            "trace file %s: group or others may read it (mode %04o), and it holds the token-level routing of "
            "user traffic: chmod 600 %s",
            path,
            stat.S_IMODE(mode),
            path,
        )
    return fd


def _append_whole(fd: int, data: bytes) -> None:
    """All of `data` at the end of the file or, when a write fails, nothing: a write cut short (a
    file-size limit, a full disk) is truncated back off, so the file still ends with a whole line."""
    start = os.lseek(fd, 0, os.SEEK_END)  # the file's real end, even if someone else truncated it
    done = 0
    try:
        while done < len(data):
            done += os.write(fd, data[done:])
    except OSError:
        with contextlib.suppress(OSError):  # should this fail too, readers skip a torn last line
            os.ftruncate(fd, start)
        raise


def _format_line(model_name: str, scores: np.ndarray, skipped: np.ndarray, threshold: float | None) -> bytes:
    # str(np.float32) is the shortest text that reads back to the same float32.
    numbers = ", ".join(map(str, scores))
    bits = ", ".join("1" if s else "0" for s in skipped)
    name = json.dumps(model_name)
    tau = "" if threshold is None else f', "threshold": {json.dumps(float(threshold))}'
    return f'{{"model_name": {name}, "scores": [{numbers}], "skipped": [{bits}]{tau}}}\n'.encode()


def read_trace(
    path: str | os.PathLike[str], on_torn_line: Callable[[TraceError], None] | None = None
) -> Iterator[TraceRecord]:
    """Yield the records of a trace file; raise TraceError naming file and line for a bad line.

    A bad last line without its newline is a write cut short (a crash, a full disk, a file-size
    limit), not a bad trace: with `on_torn_line` it is handed there and skipped, so the whole lines
    before it still count; without, it raises like any bad line.
    """
    with open(path, "rb") as file:
        # readline with a limit: a line is never held whole before its length is checked.
        for line_number, raw in enumerate(iter(lambda: file.readline(MAX_LINE_BYTES + 1), b""), start=1):
            if len(raw) > MAX_LINE_BYTES:
                raise TraceError(f"{path}:{line_number}: longer than {MAX_LINE_BYTES} bytes (MAX_LINE_BYTES)")
            if not raw.strip():
                continue
            try:
                record = _parse_line(path, line_number, raw)
            except TraceError as exc:
                if on_torn_line is None or raw.endswith(b"\n"):  # only the last line can lack it
                    raise
                on_torn_line(exc)
                continue
            yield record


def read_trace_batches(
    path: str | os.PathLike[str], max_rows: int = 4096, on_torn_line: Callable[[TraceError], None] | None = None
) -> Iterator[TraceBatch]:
    """Like read_trace, stacked into per-model arrays so statistics run vectorised: at most `max_rows`
    rows and MAX_BATCH_VALUES entropies per batch."""
    model = ""  # set from the first record, before any batch is yielded
    threshold: float | None = None
    first_line = 0
    scores: list[np.ndarray] = []
    skipped: list[np.ndarray] = []
    for record in read_trace(path, on_torn_line):
        key_changed = (
            model != record.model_name
            or threshold != record.threshold
            or (scores and len(scores[0]) != len(record.scores))
        )
        full = len(scores) == max_rows or (len(scores) + 1) * len(record.scores) > MAX_BATCH_VALUES
        if scores and (key_changed or full):
            yield TraceBatch(model, np.stack(scores), np.stack(skipped), threshold, first_line)
            scores, skipped = [], []
        if not scores:
            first_line = record.line_number
        model, threshold = record.model_name, record.threshold
        scores.append(record.scores)
        skipped.append(record.skipped)
    if scores:
        yield TraceBatch(model, np.stack(scores), np.stack(skipped), threshold, first_line)


def _parse_line(path: str | os.PathLike[str], line_number: int, raw: bytes) -> TraceRecord:
    def fail(reason: str) -> TraceError:
        return TraceError(f"{path}:{line_number}: {reason}")

    try:  # decoded here: json.loads would read bytes starting with a UTF-16 or UTF-32 BOM as such
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise fail(f"not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    try:
        obj = json.loads(text)
    except RecursionError:  # e.g. a line of 100,000 "["
        raise fail("not valid JSON (nested too deeply)") from None
    except ValueError as exc:  # JSONDecodeError, an integer of more than 4,300 digits
        raise fail(f"not valid JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise fail(f"expected a JSON object, got {type(obj).__name__}")
    missing = [key for key in ("model_name", "scores", "skipped") if key not in obj]
    if missing:
        raise fail(f"missing the key{'s' if len(missing) > 1 else ''} {', '.join(map(json.dumps, missing))}")
    model_name = obj["model_name"]
    if not isinstance(model_name, str) or not model_name:
        raise fail("model_name must be a non-empty string")
    if (character := unprintable(model_name)) is not None:  # as a frame's (layerwatch/wire.py)
        raise fail(f"model_name holds {character}, which is not printable")
    scores = _number_array(obj["scores"], kinds="if")
    if scores is None or scores.ndim != 1 or scores.size == 0:
        raise fail("scores must be a non-empty list of numbers")
    skipped = _number_array(obj["skipped"], kinds="bif")
    if skipped is None or skipped.ndim != 1:
        raise fail("skipped must be a list of 0/1")
    if len(skipped) != len(scores):
        raise fail(f"{len(scores)} scores but {len(skipped)} skipped flags")
    if not np.isin(skipped, (0, 1)).all():
        raise fail("skipped must hold only 0 and 1")
    if not ((scores >= 0) & (scores <= 1)).all():
        raise fail(f"scores outside [0, 1]: min {scores.min()}, max {scores.max()}")
    threshold = obj.get("threshold")
    if threshold is not None:
        if not is_threshold(threshold):
            raise fail(f"threshold must be a number in [0, 1], got {json.dumps(threshold)}")
        threshold = float(threshold)
    return TraceRecord(line_number, model_name, scores.astype(np.float32), skipped.astype(bool), threshold)


def _number_array(value: object, kinds: str) -> np.ndarray | None:
    """A flat list of JSON numbers as an array, or None (strings, null, ragged lists are refused).

    `kinds` are the numpy dtype kinds accepted: "i" int, "f" float, "b" bool (JSON true/false).
    """
    if not isinstance(value, list):
        return None
    # numpy would read true/false mixed with numbers as 1.0/0.0.
    if "b" not in kinds and any(isinstance(item, bool) for item in value):
        return None
    try:
        array = np.asarray(value) if value else np.zeros(0)
    except (ValueError, OverflowError):  # ragged nesting, integers beyond int64
        return None
    return array if array.dtype.kind in kinds else None
