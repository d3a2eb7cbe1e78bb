"""The gate-frame format: round trips, every rejection reason, and a fuzz test of the parser."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import hmac
import math
import re
import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from layerwatch.secret_file import SecretFileError
from layerwatch.wire import (
    HEADER_BYTES,
    HEADER_BYTES_V2,
    HEADER_BYTES_V3,
    MAX_FRAME_BYTES,
    TAG_BYTES,
    FrameTooLarge,
    GateFrame,
    MalformedFrame,
    UnauthenticatedFrame,
    decode_frame,
    encode_frame,
    frame_bytes,
    load_frame_key,
    parse_address,
)
from tests.exporter.support import random_frame

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def gate_frames(draw: st.DrawFn) -> GateFrame:
    rows = draw(st.integers(1, 12))
    layers = draw(st.integers(1, 40))
    entropies = draw(hnp.arrays(np.float32, (rows, layers), elements=st.floats(0, 1, width=32, allow_subnormal=False)))
    skipped = draw(hnp.arrays(np.bool_, (rows, layers)))
    # Any printable text (what a name may hold); the other categories are refused (test_malformed_...).
    printable = st.characters(exclude_categories=("Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp", "Zs")) | st.just(" ")
    name = st.text(printable, min_size=1, max_size=20).filter(lambda s: len(s.encode()) <= 255)
    # None: a version-1 frame (no threshold); else version 2 with a float32 threshold, or version 3: some of
    # a larger model's layers.
    threshold = draw(st.none() | st.floats(0, 1, width=32, allow_subnormal=False))
    first_layer, model_layers = 0, None
    if threshold is not None and draw(st.booleans()):
        first_layer = draw(st.integers(0, 300))
        model_layers = first_layer + layers + draw(st.integers(0 if first_layer else 1, 300))
    sequence = draw(st.integers(0, 2**64 - 1))
    fallbacks = draw(st.just(0) | st.integers(1, 2**16 - 1))  # 0: no count, flag bit 1 clear
    return GateFrame(
        draw(name), draw(name), sequence, entropies, skipped, threshold, first_layer, model_layers, fallbacks
    )


def frame(
    rows: int = 3,
    layers: int = 10,
    model: str = "demo",
    shim: str = "shim-1",
    sequence: int = 7,
    threshold: float | None = None,
) -> GateFrame:
    rng = np.random.default_rng(rows * 1000 + layers)
    entropies = rng.random((rows, layers), dtype=np.float32)
    return GateFrame(model, shim, sequence, entropies, entropies < 0.3, threshold)


@FUZZ
@given(gate_frames())
def test_round_trip_keeps_every_field(original: GateFrame) -> None:
    data = encode_frame(original)
    assert len(data) == frame_bytes(
        *original.entropies.shape,
        original.model_name,
        original.shim_id,
        original.threshold,
        partial=original.partial,
        fallbacks=original.fallbacks > 0,
    )
    assert data[4] == (3 if original.partial else 1 if original.threshold is None else 2)
    assert data[5] == (2 if original.fallbacks else 0)
    decoded = decode_frame(data)
    assert (decoded.model_name, decoded.shim_id, decoded.sequence, decoded.threshold, decoded.fallbacks) == (
        original.model_name,
        original.shim_id,
        original.sequence,
        original.threshold,
        original.fallbacks,
    )
    assert (decoded.first_layer, decoded.total_layers) == (original.first_layer, original.total_layers)
    assert decoded.entropies.dtype == np.float32 and decoded.skipped.dtype == np.bool_
    np.testing.assert_array_equal(decoded.entropies, original.entropies)
    np.testing.assert_array_equal(decoded.skipped, original.skipped)


@FUZZ
@given(st.binary(max_size=2048))
def test_arbitrary_bytes_decode_or_raise_malformed(data: bytes) -> None:
    with contextlib.suppress(MalformedFrame):
        decode_frame(data)


@FUZZ
@given(gate_frames(), st.data())
def test_mutated_frames_decode_canonically_or_raise_malformed(original: GateFrame, data: st.DataObject) -> None:
    raw = bytearray(encode_frame(original))
    mutation = data.draw(st.sampled_from(["flip", "truncate", "extend", "header"]))
    if mutation == "flip":
        for _ in range(data.draw(st.integers(1, 4))):
            raw[data.draw(st.integers(0, len(raw) - 1))] ^= 1 << data.draw(st.integers(0, 7))
    elif mutation == "truncate":
        del raw[data.draw(st.integers(0, len(raw) - 1)) :]
    elif mutation == "extend":
        raw += data.draw(st.binary(min_size=1, max_size=64))
    else:  # rewrite a header field with any value of its width
        # version 1 <-> 2 rewrites shift the names by the 4 threshold bytes; (20, 4) is v2's threshold
        # (24, 2) and (26, 2) are v3's first layer and model layers
        fields = [(4, 1), (5, 1), (6, 2), (8, 2), (18, 1), (19, 1), (20, 4), (24, 2), (26, 2)]
        offset, width = data.draw(st.sampled_from([(o, w) for o, w in fields if o + w <= len(raw)]))
        raw[offset : offset + width] = data.draw(st.binary(min_size=width, max_size=width))
    try:
        decoded = decode_frame(bytes(raw))
    except MalformedFrame:
        return
    # Whatever decodes is a well-formed frame that encodes back to exactly these bytes.
    assert encode_frame(decoded) == bytes(raw)
    assert ((decoded.entropies >= 0) & (decoded.entropies <= 1)).all()
    assert decoded.threshold is None or 0 <= decoded.threshold <= 1


def test_layout_matches_the_documented_header() -> None:
    data = encode_frame(frame(rows=2, layers=9, model="m", shim="s", sequence=2**40 + 5, threshold=0.18))
    assert data[:4] == b"LWGF"
    assert struct.unpack_from("<BBHHQBBf", data, 4) == (2, 0, 2, 9, 2**40 + 5, 1, 1, np.float32(0.18))
    assert HEADER_BYTES_V2 == 24 and data[HEADER_BYTES_V2 : HEADER_BYTES_V2 + 2] == b"ms"
    # 9 layers pack into 2 bytes per row; the first layer is the most significant bit.
    assert len(data) == HEADER_BYTES_V2 + 2 + 2 * 9 * 4 + 2 * 2


def test_version_1_layout_has_no_threshold() -> None:
    data = encode_frame(frame(rows=2, layers=9, model="m", shim="s", sequence=2**40 + 5))
    assert struct.unpack_from("<BBHHQBB", data, 4) == (1, 0, 2, 9, 2**40 + 5, 1, 1)
    assert data[HEADER_BYTES : HEADER_BYTES + 2] == b"ms"
    assert len(data) == HEADER_BYTES + 2 + 2 * 9 * 4 + 2 * 2


def test_version_1_frames_from_an_older_shim_still_decode_without_a_threshold() -> None:
    # Built by hand as a version-1 shim writes it, not by this encoder.
    entropies = np.array([[0.1, 0.5, 0.9]], np.float32)
    old = struct.pack("<4sBBHHQBB", b"LWGF", 1, 0, 1, 3, 42, 4, 3) + b"demoold" + entropies.tobytes() + b"\x40"
    decoded = decode_frame(old)
    assert decoded.threshold is None and (decoded.model_name, decoded.shim_id, decoded.sequence) == ("demo", "old", 42)
    np.testing.assert_array_equal(decoded.entropies, entropies)
    assert decoded.skipped.tolist() == [[False, True, False]]
    new = decode_frame(encode_frame(GateFrame("demo", "old", 42, entropies, decoded.skipped, 0.18)))
    assert new.threshold == np.float32(0.18)
    np.testing.assert_array_equal(new.entropies, entropies)


def test_a_partial_frame_is_version_3_with_its_layers_place_and_a_whole_one_stays_version_2() -> None:
    whole = frame(rows=2, layers=9, model="m", shim="s", threshold=0.18)
    part = dataclasses.replace(whole, first_layer=7, model_layers=16)
    data = encode_frame(part)
    assert struct.unpack_from("<BBHHQBBfHH", data, 4) == (3, 0, 2, 9, 7, 1, 1, np.float32(0.18), 7, 16)
    assert HEADER_BYTES_V3 == 28 and data[HEADER_BYTES_V3 : HEADER_BYTES_V3 + 2] == b"ms"
    assert len(data) == HEADER_BYTES_V3 + 2 + 2 * 9 * 4 + 2 * 2
    decoded = decode_frame(data)
    assert (decoded.partial, decoded.first_layer, decoded.total_layers) == (True, 7, 16)
    # A frame that names the whole model as its span is written, byte for byte, as the same frame without it.
    assert encode_frame(dataclasses.replace(whole, model_layers=9)) == encode_frame(whole)
    assert encode_frame(whole)[4] == 2 and decode_frame(encode_frame(whole)).total_layers == 9


@pytest.mark.parametrize(
    "change, reason",
    [
        ({"first_layer": 3}, "first layer 3 without the model's layer count"),
        ({"first_layer": 10, "model_layers": 15}, r"layers 10..19 are not inside a model of 15 layers"),
        ({"model_layers": 9}, r"layers 0..9 are not inside a model of 9 layers"),
        ({"first_layer": 2, "model_layers": 20}, "a partial frame .* carries a threshold"),
    ],
)
def test_encode_refuses_a_layer_span_outside_the_model(change: dict, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        encode_frame(dataclasses.replace(frame(layers=10), **change))


def test_a_fallback_count_follows_the_skip_bits_under_flag_bit_1_and_none_leaves_the_frame_as_it_was() -> None:
    plain = frame(rows=2, layers=9, model="m", shim="s", threshold=0.18)
    counted = dataclasses.replace(plain, fallbacks=513)
    key = b"k" * 32
    for tag_key in (None, key):
        data, before = encode_frame(counted, tag_key), encode_frame(plain, tag_key)
        tag = TAG_BYTES if tag_key else 0
        assert data[5] == (2 | (1 if tag_key else 0)) and before[5] == (1 if tag_key else 0)
        assert data[6 : len(before) - tag] == before[6 : len(before) - tag]  # the same bytes up to the skip bits
        assert data[len(before) - tag : len(before) - tag + 2] == struct.pack("<H", 513)
        assert decode_frame(data, tag_key).fallbacks == 513 and decode_frame(before, tag_key).fallbacks == 0
    assert encode_frame(dataclasses.replace(plain, fallbacks=0)) == encode_frame(plain)


def test_the_threshold_survives_as_float32() -> None:
    for threshold in (0.0, 0.18, 0.5, 1.0):
        decoded = decode_frame(encode_frame(frame(threshold=threshold)))
        assert decoded.threshold == float(np.float32(threshold))


def _header(
    rows: int = 1,
    layers: int = 1,
    version: int = 1,
    flags: int = 0,
    model_len: int = 1,
    shim_len: int = 1,
    magic: bytes = b"LWGF",
) -> bytes:
    return struct.pack("<4sBBHHQBB", magic, version, flags, rows, layers, 0, model_len, shim_len)


def _valid_body(entropy: float = 0.5) -> bytes:
    return b"ms" + struct.pack("<f", entropy) + b"\x80"


def _v2(threshold: float = 0.18, **header) -> bytes:
    return _header(version=2, **header) + struct.pack("<f", threshold)


def _v3(first_layer: int, model_layers: int, **header) -> bytes:
    return _header(version=3, **header) + struct.pack("<fHH", 0.18, first_layer, model_layers)


@pytest.mark.parametrize(
    "data, reason",
    [
        (b"", "shorter than the 20-byte header"),
        (_header()[:19], "shorter than the 20-byte header"),
        (_header(magic=b"XXXX") + _valid_body(), "bad magic"),
        (_header(version=0) + _valid_body(), "unsupported version 0"),
        (_header(version=4) + _valid_body(), "unsupported version 4"),
        (_v3(0, 1)[:27], "describes 35"),
        (_v3(0, 1) + _valid_body(), "version-3 frame of all 1 layers"),  # whole: version 2's encoding
        (_v3(2, 2) + _valid_body(), r"layers 2..2 are not inside a model of 2 layers"),
        (_v3(0, 0) + _valid_body(), r"layers 0..0 are not inside a model of 0 layers"),
        (_v3(65535, 65535) + _valid_body(), r"layers 65535..65535 are not inside"),
        (_v3(1, 3, rows=65535, layers=65535) + _valid_body(), "describes"),  # hostile sizes: no allocation
        (_header(version=2) + _valid_body(), "describes 31"),  # a version-1 body under a version-2 header
        (_v2()[:23], "describes 31"),
        (_v2(float("nan")) + _valid_body(), r"threshold nan is not in [0, 1]"),
        (_v2(float("inf")) + _valid_body(), "threshold inf is not in"),
        (_v2(1.5) + _valid_body(), "threshold 1.5 is not in"),
        (_v2(-0.25) + _valid_body(), "threshold -0.25 is not in"),
        (_v2() + _valid_body(1.5), "outside [0, 1]"),
        (_header(flags=4) + _valid_body(), "unknown flags"),
        (_header(flags=2) + _valid_body(), "describes 29"),  # flag bit 1 without its count
        (_header(flags=2) + _valid_body() + b"\x00\x00", "a fallback count of 0"),
        (_header(flags=1) + _valid_body(), "too short for a tagged frame"),
        (
            _header(flags=1) + _valid_body() + b"t" * 16 + b"\x00",
            "28 bytes before the tag, but the header .* describes 27",
        ),
        (_header(rows=0) + _valid_body(), "empty frame"),
        (_header(layers=0) + _valid_body(), "empty frame"),
        (_header(model_len=0) + _valid_body(), "must not be empty"),
        (_header() + _valid_body()[:-1], "describes 27"),
        (_header() + _valid_body() + b"\x00", "describes 27"),
        (_header(rows=65535, layers=65535) + _valid_body(), "describes"),  # hostile sizes: no allocation
        (_header() + _valid_body(float("nan")), "NaN or infinity"),
        (_header() + _valid_body(float("inf")), "NaN or infinity"),
        (_header() + _valid_body(1.5), "outside [0, 1]"),
        (_header() + _valid_body(-0.25), "outside [0, 1]"),
        (_header() + b"\xffs" + struct.pack("<f", 0.5) + b"\x80", "model_name is not valid UTF-8"),
        # Names reach label values, `top` and `replay`: an escape sequence would reach a terminal.
        (_header() + b"\x1bs" + struct.pack("<f", 0.5) + b"\x80", r"model_name holds '\\x1b', which is not printable"),
        (_header() + b"m\n" + struct.pack("<f", 0.5) + b"\x80", r"shim_id holds '\\n', which is not printable"),
        (_header() + _valid_body()[:-1] + b"\x81", "padding bits"),
        (b"\x00" * (MAX_FRAME_BYTES + 1), "exceeds the frame limit"),
    ],
)
def test_malformed_frames_are_rejected_with_the_reason(data: bytes, reason: str) -> None:
    with pytest.raises(MalformedFrame, match=reason.replace("[", r"\[").replace("]", r"\]")):
        decode_frame(data)


def test_the_smallest_valid_frame_decodes() -> None:
    decoded = decode_frame(_header() + _valid_body(0.25))
    assert decoded.entropies.tolist() == [[0.25]] and decoded.skipped.tolist() == [[True]]
    assert decoded.threshold is None
    decoded = decode_frame(_v2(0.25) + _valid_body(0.25))
    assert decoded.threshold == 0.25 and decoded.entropies.tolist() == [[0.25]]


def test_encode_refuses_frames_over_the_limit() -> None:
    layers = 80
    fitting = (MAX_FRAME_BYTES - HEADER_BYTES - 10) // (layers * 4 + 10)
    assert len(encode_frame(frame(rows=fitting, layers=layers))) <= MAX_FRAME_BYTES
    with pytest.raises(FrameTooLarge, match="send fewer rows"):
        encode_frame(frame(rows=fitting + 1, layers=layers))


@pytest.mark.parametrize(
    "change, reason",
    [
        (dict(entropies=np.full((2, 3), np.nan, np.float32)), "NaN"),
        (dict(entropies=np.full((2, 3), 1.01, np.float32)), r"outside \[0, 1\]"),
        (dict(skipped=np.zeros((3, 2), bool)), "shape"),
        (dict(entropies=np.zeros((0, 3), np.float32), skipped=np.zeros((0, 3), bool)), "non-empty"),
        (dict(model_name=""), "model_name must be 1..255"),
        (dict(shim_id="é" * 128), "shim_id must be 1..255"),
        (dict(model_name="demo\x1b]0;title\x07"), "model_name holds '\\\\x1b', which is not printable"),
        (dict(shim_id="s\u202e"), "shim_id holds '\\\\u202e', which is not printable"),
        (dict(sequence=-1), "not a u64"),
        (dict(threshold=1.5), r"threshold 1.5 is not in \[0, 1\]"),
        (dict(threshold=float("nan")), "threshold nan"),
        (dict(fallbacks=-1), "fallbacks -1 is not a u16"),
        (dict(fallbacks=2**16), "fallbacks 65536 is not a u16"),
        (dict(fallbacks=True), "fallbacks True is not a u16"),
    ],
)
def test_encode_refuses_invalid_frames(change: dict, reason: str) -> None:
    fields = dict(
        model_name="demo",
        shim_id="s",
        sequence=0,
        entropies=np.full((2, 3), 0.5, np.float32),
        skipped=np.zeros((2, 3), bool),
    )
    with pytest.raises(ValueError, match=reason):
        encode_frame(GateFrame(**(fields | change)))


@pytest.mark.parametrize(
    "text, expected",
    [
        ("127.0.0.1:9410", ("127.0.0.1", 9410)),
        ("localhost:1", ("localhost", 1)),
        ("[::1]:65535", ("::1", 65535)),
        ("exporter:9410", ("exporter", 9410)),
    ],
)
def test_addresses_parse_for_listeners_and_destinations_alike(text: str, expected: tuple[str, int]) -> None:
    assert parse_address(text) == parse_address(text, listening=True) == expected


@pytest.mark.parametrize(
    "text", ["127.0.0.1", ":9410", "127.0.0.1:", "127.0.0.1:65536", "127.0.0.1:-1", "127.0.0.1:http", ""]
)
def test_malformed_addresses_are_refused(text: str) -> None:
    for listening in (False, True):
        with pytest.raises(ValueError, match="is not HOST:PORT"):
            parse_address(text, listening=listening)


def test_port_zero_is_for_listeners_only() -> None:
    """The exporter may bind port 0 (any free port: `--listen 127.0.0.1:0`, as its tests start it); the shim's
    `--exporter-address` is a destination, and a datagram cannot be sent to port 0."""
    assert parse_address("127.0.0.1:0", listening=True) == ("127.0.0.1", 0)
    with pytest.raises(ValueError, match="port 0"):
        parse_address("127.0.0.1:0")


def test_a_bool_threshold_is_refused_and_negative_zero_travels_as_zero() -> None:
    rng = np.random.default_rng(3)
    frame = random_frame(rng, 0)
    with pytest.raises(ValueError, match="not a number"):
        encode_frame(dataclasses.replace(frame, threshold=True))
    decoded = decode_frame(encode_frame(dataclasses.replace(frame, threshold=-0.0)))
    assert decoded.threshold == 0.0 and math.copysign(1.0, decoded.threshold) == 1.0


# --- authentication (flag bit 0: an HMAC tag ends the frame) ------------------------------------

KEY = b"0123456789abcdef0123456789abcdef"


def test_a_tagged_frame_ends_with_the_truncated_hmac_of_everything_before_it() -> None:
    original = frame(rows=2, layers=9, threshold=0.18)
    data = encode_frame(original, KEY)
    assert data[5] == 1  # flags: tagged
    assert len(data) == len(encode_frame(original)) + TAG_BYTES == frame_bytes(2, 9, "demo", "shim-1", 0.18, True)
    assert data[-TAG_BYTES:] == hmac.new(KEY, data[:-TAG_BYTES], hashlib.sha256).digest()[:16]
    decoded = decode_frame(data, KEY)
    np.testing.assert_array_equal(decoded.entropies, original.entropies)
    assert encode_frame(decoded, KEY) == data


def test_a_tagged_frame_decodes_without_a_key_so_shims_can_get_the_key_first() -> None:
    data = encode_frame(frame(threshold=0.18), KEY)
    assert decode_frame(data).sequence == 7


@pytest.mark.parametrize(
    "data, reason",
    [
        (encode_frame(frame(threshold=0.18)), "missing_tag"),
        (encode_frame(frame(threshold=0.18), b"another key, just as long as KEY"), "bad_tag"),
        (encode_frame(frame(threshold=0.18), KEY)[:-1] + b"\x00", "bad_tag"),
    ],
)
def test_with_a_key_untagged_and_mistagged_frames_are_unauthenticated(data: bytes, reason: str) -> None:
    with pytest.raises(UnauthenticatedFrame) as raised:
        decode_frame(data, KEY)
    assert raised.value.reason == reason


@FUZZ
@given(gate_frames(), st.data())
def test_any_altered_tagged_frame_is_refused(original: GateFrame, data: st.DataObject) -> None:
    raw = bytearray(encode_frame(original, KEY))
    raw[data.draw(st.integers(0, len(raw) - 1))] ^= 1 << data.draw(st.integers(0, 7))
    with pytest.raises((UnauthenticatedFrame, MalformedFrame)):
        decode_frame(bytes(raw), KEY)


def _key_file(tmp_path: Path, content: bytes, mode: int = 0o600) -> Path:
    path = tmp_path / "frame.key"
    path.write_bytes(content)
    path.chmod(mode)
    return path


def test_the_frame_key_is_the_file_without_surrounding_whitespace(tmp_path: Path) -> None:
    assert load_frame_key(_key_file(tmp_path, KEY + b"\n")) == KEY
    assert load_frame_key(_key_file(tmp_path, KEY, 0o400)) == KEY


@pytest.mark.parametrize(
    "content, mode, reason",
    [
        (KEY, 0o644, "group or others may access it (mode 0644); run chmod 600"),
        (KEY, 0o604, "mode 0604"),
        (KEY[:31] + b"\n", 0o600, "31 bytes, at least 32 needed"),
        (b"k" * 5000, 0o600, "larger than 4096 bytes"),
    ],
)
def test_unusable_frame_key_files_are_refused_naming_the_file(
    tmp_path: Path, content: bytes, mode: int, reason: str
) -> None:
    path = _key_file(tmp_path, content, mode)
    with pytest.raises(SecretFileError, match=re.escape(f"frame key file {path}: ") + ".*" + re.escape(reason)):
        load_frame_key(path)


def test_a_missing_frame_key_file_or_a_folder_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SecretFileError, match=f"frame key file {tmp_path / 'absent'}: No such file"):
        load_frame_key(tmp_path / "absent")
    with pytest.raises(SecretFileError, match="Is a directory|not a regular file"):
        load_frame_key(tmp_path)
