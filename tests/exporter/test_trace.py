"""Trace files: writer and reader round trip, the size cap, concurrency, and clear errors."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from layerwatch.trace import TraceError, TraceWriter, read_trace, read_trace_batches


def test_written_rows_read_back_exactly(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    entropies = rng.random((5, 7), dtype=np.float32)
    entropies[0, :3] = [0.0, 1.0, 1e-8]
    skipped = entropies < 0.3
    path = tmp_path / "t.jsonl"
    with TraceWriter(path, max_bytes=1 << 20) as writer:
        writer.write_rows("demo", entropies, skipped)
    records = list(read_trace(path))
    assert [r.line_number for r in records] == [1, 2, 3, 4, 5]
    assert all(r.model_name == "demo" for r in records)
    np.testing.assert_array_equal(np.stack([r.scores for r in records]), entropies)
    np.testing.assert_array_equal(np.stack([r.skipped for r in records]), skipped)
    first = json.loads(path.read_text().splitlines()[0])
    assert set(first) == {"model_name", "scores", "skipped"} and first["skipped"][0] in (0, 1)


def test_writer_stops_at_the_cap_and_counts_what_it_dropped(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    one_line = len(b'{"model_name": "m", "scores": [0.5, 0.25], "skipped": [0, 1]}\n')
    writer = TraceWriter(path, max_bytes=3 * one_line + 5)
    for _ in range(5):
        writer.write_rows("m", np.array([[0.5, 0.25]]), np.array([[0, 1]]))
    writer.close()
    assert path.stat().st_size == 3 * one_line
    assert writer.dropped == {"max_bytes": 2, "write_error": 0} and writer.written == 3
    assert len(list(read_trace(path))) == 3


def test_writer_appends_and_counts_the_existing_size(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text('{"model_name": "old", "scores": [0.1], "skipped": [0]}\n')
    existing = path.stat().st_size
    with TraceWriter(path, max_bytes=existing + 10) as writer:
        writer.write_rows("new", np.array([[0.5]]), np.array([[1]]))
    assert [r.model_name for r in read_trace(path)] == ["old"]
    assert writer.dropped == {"max_bytes": 1, "write_error": 0} and writer.written == 0


def test_concurrent_writers_produce_whole_lines(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    writer = TraceWriter(path, max_bytes=1 << 24)
    rows = np.full((3, 16), 0.125, np.float32)

    def write(model: str) -> None:
        for _ in range(100):
            writer.write_rows(model, rows, rows < 0.2)

    threads = [threading.Thread(target=write, args=(f"m{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    writer.close()
    records = list(read_trace(path))
    assert len(records) == 4 * 100 * 3
    assert {r.model_name for r in records} == {"m0", "m1", "m2", "m3"}


def test_writer_refuses_invalid_rows(tmp_path: Path) -> None:
    with TraceWriter(tmp_path / "t.jsonl", max_bytes=1000) as writer:
        with pytest.raises(ValueError, match="outside"):
            writer.write_rows("m", np.array([[1.5]]), np.array([[0]]))
        with pytest.raises(ValueError, match="0/1"):
            writer.write_rows("m", np.array([[0.5]]), np.array([[2]]))


def test_unknown_keys_and_blank_lines_are_ignored(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text('{"model_name": "m", "scores": [0.5], "skipped": [1], "request": "x"}\n\n')
    (record,) = read_trace(path)
    assert record.scores.tolist() == [0.5] and record.skipped.tolist() == [True]


@pytest.mark.parametrize(
    "line, reason",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        # "missing key(s) skipped" would read as if keys had been skipped; the key is named skipped.
        ('{"model_name": "m", "scores": [0.5]}', 'missing the key "skipped"'),
        ('{"model_name": "m"}', 'missing the keys "scores", "skipped"'),
        ('{"model_name": "", "scores": [0.5], "skipped": [0]}', "model_name must be a non-empty string"),
        (
            '{"model_name": "m\\u001b[2J", "scores": [0.5], "skipped": [0]}',
            "model_name holds '\\x1b', which is not printable",
        ),
        ('{"model_name": "m", "scores": [], "skipped": []}', "scores must be a non-empty list"),
        ('{"model_name": "m", "scores": ["0.5"], "skipped": [0]}', "scores must be a non-empty list of numbers"),
        ('{"model_name": "m", "scores": [[0.5]], "skipped": [0]}', "scores must be a non-empty list of numbers"),
        ('{"model_name": "m", "scores": [0.5, null], "skipped": [0, 0]}', "scores must be"),
        ('{"model_name": "m", "scores": [0.5, 0.1], "skipped": [0]}', "2 scores but 1 skipped flags"),
        ('{"model_name": "m", "scores": [1.5], "skipped": [0]}', "scores outside [0, 1]"),
        ('{"model_name": "m", "scores": [-0.1], "skipped": [0]}', "scores outside [0, 1]"),
        ('{"model_name": "m", "scores": [0.5], "skipped": [2]}', "skipped must hold only 0 and 1"),
        ('{"model_name": "m", "scores": [0.5], "skipped": "1"}', "skipped must be a list"),
        (
            '{"model_name": "m", "scores": [0.5], "skipped": [0], "threshold": 1.5}',
            "threshold must be a number in [0, 1]",
        ),
        ('{"model_name": "m", "scores": [0.5], "skipped": [0], "threshold": "0.18"}', "threshold must be a number"),
        ('{"model_name": "m", "scores": [0.5], "skipped": [0], "threshold": true}', "threshold must be a number"),
        ('{"model_name": "m", "scores": [0.5], "skipped": [0], "threshold": NaN}', "threshold must be a number"),
        # JSON booleans are not scores (numpy reads true as 1.0); skipped does accept them.
        ('{"model_name": "m", "scores": [true, 0.1], "skipped": [0, 0]}', "scores must be a non-empty list of numbers"),
        # Input that makes the JSON parser itself raise something other than a decode error.
        ("[" * 100_000, "not valid JSON (nested too deeply)"),
        (
            '{"model_name": "m", "scores": [0.5], "skipped": [0], "threshold": ' + "9" * 5000 + "}",
            "not valid JSON (Exceeds the limit",
        ),
    ],
)
def test_bad_lines_name_file_and_line(tmp_path: Path, line: str, reason: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"model_name": "m", "scores": [0.5], "skipped": [0]}\n' + line + "\n")
    with pytest.raises(TraceError) as error:
        list(read_trace(path))
    assert str(error.value).startswith(f"{path}:2: ")
    assert reason in str(error.value)


@pytest.mark.parametrize(
    "line",
    [b"\xff\xfe", b"\xff", '{"model_name": "m", "scores": [0.5], "skipped": [0]}'.encode("utf-16")],
    ids=["utf-16-bom", "not-utf-8", "utf-16-line"],
)
def test_a_line_that_is_not_utf8_says_so(tmp_path: Path, line: bytes) -> None:
    """json.loads reads bytes that start with a UTF-16 BOM as UTF-16, so such a
    line failed as "not valid JSON ('utf-16-le' codec can't decode ...)", or was read."""
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"model_name": "m", "scores": [0.5], "skipped": [0]}\n' + line + b"\n")
    with pytest.raises(
        TraceError, match=f"^{re.escape(str(path))}:2: not UTF-8 text \\(invalid start byte at byte 0\\)$"
    ):
        list(read_trace(path))


def test_batches_group_consecutive_rows_of_one_model(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    lines = [("a", 2), ("a", 2), ("b", 2), ("a", 2), ("a", 3), ("a", 3), ("a", 3)]
    path.write_text(
        "".join(json.dumps({"model_name": m, "scores": [0.5] * n, "skipped": [0] * n}) + "\n" for m, n in lines)
    )
    batches = list(read_trace_batches(path, max_rows=2))
    assert [(b.model_name, b.entropies.shape) for b in batches] == [
        ("a", (2, 2)),
        ("b", (1, 2)),
        ("a", (1, 2)),
        ("a", (2, 3)),
        ("a", (1, 3)),
    ]


def test_the_optional_threshold_is_written_and_read_back(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    with TraceWriter(path, max_bytes=1 << 20, threshold=0.18) as writer:
        writer.write_rows("demo", np.array([[0.1, 0.5]], np.float32), np.array([[0, 1]]))
    with TraceWriter(path, max_bytes=1 << 20) as writer:  # a shim that does not know τ
        writer.write_rows("demo", np.array([[0.1, 0.5]], np.float32), np.array([[0, 1]]))
    first, second = path.read_text().splitlines()
    assert json.loads(first)["threshold"] == 0.18 and "threshold" not in json.loads(second)
    assert [r.threshold for r in read_trace(path)] == [0.18, None]
    with pytest.raises(ValueError, match="threshold must be in"):
        TraceWriter(path, max_bytes=100, threshold=1.2)


def test_batches_break_where_the_threshold_changes(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    thresholds = [0.18, 0.18, None, 0.2, 0.2]
    path.write_text(
        "".join(
            json.dumps({"model_name": "a", "scores": [0.5], "skipped": [0]} | ({} if t is None else {"threshold": t}))
            + "\n"
            for t in thresholds
        )
    )
    assert [(b.threshold, len(b.entropies)) for b in read_trace_batches(path)] == [(0.18, 2), (None, 1), (0.2, 2)]


LINE = b'{"model_name": "m", "scores": [0.5, 0.25], "skipped": [0, 1]}\n'
# A child that writes a trace under a file-size limit (RLIMIT_FSIZE; Python ignores SIGXFSZ, so a write
# past the limit writes what fits and the next fails with EFBIG): a full disk, for real, without root.
WRITE_UNDER_A_SIZE_LIMIT = """
import json, resource, sys
import numpy as np
from layerwatch.trace import TraceWriter
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[2]), int(sys.argv[2])))
writer = TraceWriter(sys.argv[1], max_bytes=1 << 20)
errors = []
for _ in range(20):
    try:
        writer.write_rows("m", np.array([[0.5, 0.25]] * 3), np.array([[0, 1]] * 3))
    except OSError as exc:
        errors.append(exc.strerror)
writer.close()
print(json.dumps({"errors": errors, "written": writer.written, "dropped": writer.dropped}))
"""


def test_a_write_past_a_file_size_limit_leaves_whole_lines_and_stops_writing(tmp_path: Path) -> None:
    """The limit falls inside the second batch of 3 lines: that batch is cut back off whole, the
    failure is raised once, and every later line is counted as dropped."""
    path = tmp_path / "t.jsonl"
    limit = 3 * len(LINE) + 100
    child = subprocess.run(
        [sys.executable, "-c", WRITE_UNDER_A_SIZE_LIMIT, str(path), str(limit)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    assert child.returncode == 0, child.stderr
    result = json.loads(child.stdout)
    assert result == {"errors": ["File too large"], "written": 3, "dropped": {"max_bytes": 0, "write_error": 57}}
    assert path.read_bytes() == LINE * 3  # nothing of the failed batch is left behind


def test_a_full_disk_stops_writing_once_and_close_does_not_fail() -> None:
    writer = TraceWriter("/dev/full", max_bytes=1 << 20)
    with pytest.raises(OSError, match="No space left on device"):
        writer.write_rows("m", np.array([[0.5, 0.25]]), np.array([[0, 1]]))
    for _ in range(3):  # stopped for good: counted, not raised again
        writer.write_rows("m", np.array([[0.5, 0.25]] * 2), np.array([[0, 1]] * 2))
    writer.close()
    assert writer.written == 0 and writer.dropped == {"max_bytes": 0, "write_error": 7}


def test_a_torn_last_line_is_handed_over_and_skipped_when_asked(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_bytes(LINE * 3 + LINE[:20])
    with pytest.raises(TraceError, match=f"{path}:4: not valid JSON"):
        list(read_trace(path))  # strict by default
    torn: list[TraceError] = []
    assert len(list(read_trace(path, on_torn_line=torn.append))) == 3
    assert [str(e).split(": ")[0] for e in torn] == [f"{path}:4"]
    batches = list(read_trace_batches(path, on_torn_line=torn.append))
    assert [len(b.entropies) for b in batches] == [3] and len(torn) == 2


def test_only_a_last_line_without_newline_counts_as_torn(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_bytes(LINE + LINE[:20] + b"\n" + LINE)  # a bad line in the middle is a bad trace
    with pytest.raises(TraceError, match=f"{path}:2: "):
        list(read_trace(path, on_torn_line=lambda exc: None))
    path.write_bytes(LINE + LINE[:-1])  # a whole last line without its newline is a good line
    assert len(list(read_trace(path, on_torn_line=lambda exc: pytest.fail(str(exc))))) == 2


# A FIFO as --trace-file would block serve's start in open() for ever, holding its port; trace
# files must not be created 0644: they hold the token-level routing of user traffic.
@pytest.mark.parametrize("reader", [False, True], ids=["no-reader", "a-reader"])
def test_a_fifo_is_refused_at_once_not_waited_on(tmp_path: Path, reader: bool) -> None:
    fifo = tmp_path / "trace.fifo"
    os.mkfifo(fifo)
    held = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK) if reader else None
    outcome: list[BaseException | None] = []

    def open_writer() -> None:
        try:
            TraceWriter(fifo, max_bytes=1 << 20).close()
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    opening = threading.Thread(target=open_writer, daemon=True)
    opening.start()
    opening.join(5)
    blocked = opening.is_alive()
    if blocked:  # the old code: let its open() return, so that the thread ends
        os.close(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))
    if held is not None:
        os.close(held)
    assert not blocked, "TraceWriter waited in open() on a FIFO"
    assert isinstance(outcome[0], ValueError) and f"trace file {fifo}: not a regular file" in str(outcome[0])


def test_a_new_trace_file_is_owner_only_and_an_existing_one_keeps_its_mode(tmp_path: Path, caplog) -> None:
    new = tmp_path / "new.jsonl"
    umask = os.umask(0o022)
    try:
        TraceWriter(new, max_bytes=1 << 20).close()
    finally:
        os.umask(umask)
    assert new.stat().st_mode & 0o777 == 0o600
    shared = tmp_path / "shared.jsonl"
    shared.write_text("")
    shared.chmod(0o640)
    with caplog.at_level("WARNING", logger="layerwatch.trace"):
        TraceWriter(shared, max_bytes=1 << 20).close()
    assert shared.stat().st_mode & 0o777 == 0o640  # the operator's choice, left as it is, and said
    assert f"trace file {shared}: group or others may read it (mode 0640)" in caplog.text
