"""The gate-frame wire format: one UDP datagram per decode step, all rows of the batch.

The shim encodes and sends to `--exporter-address`, the exporter receives on `--listen` and decodes;
both addresses are read by `parse_address`. The byte layout is documented in docs/wire-format.md;
everything is little-endian:

    offset  size  field
    0       4     magic b"LWGF"
    4       1     version (2; 3 for a partial frame; 1 is still read)
    5       1     flags (bit 0: an authentication tag ends the frame; bit 1: a fallback count follows
                  the skip bits; a decoder rejects unknown bits)
    6       2     rows   (u16, > 0)
    8       2     layers (u16, > 0)
    10      8     sequence (u64, +1 per frame sent by one shim)
    18      1     model_name length in bytes (u8, > 0)
    19      1     shim_id length in bytes (u8, > 0)
    20      4     threshold τ, float32 in [0, 1] (versions 2 and 3; version 1 has no such field)
    24      2     first layer (u16, version 3 only): the model's layer the frame's first column is
    26      2     model layers (u16, version 3 only): the layers of the whole model
    28 (24, 20) n model_name (UTF-8), then shim_id (UTF-8)
    ...     4·R·L entropies, float32, row-major
    ...     R·⌈L/8⌉ skip bits, np.packbits of each row (first layer = most significant bit),
                  padding bits zero
    ...     2     with flag bit 1 only: fallbacks (u16, > 0): the fallback episodes the sender's breaker
                  started at this step (docs/model.md, "Fallback breaker")
    ...     16    with flag bit 0 only: HMAC-SHA256 of every byte before it under the frame key,
                  truncated to 16 bytes

Version 2 adds the skip policy's threshold τ, so the exporter can tell below-τ scores from the
rest (routing statistics, layerwatch/routing.py). A version-1 frame (an older shim) decodes with
`threshold=None` and the exporter falls back to its default τ. Version 3 is a *partial* frame: the
scores of a contiguous run of the model's layers (a pipeline stage's), with where they start and how
many layers the whole model has, so that the exporter folds the stages into one model. Flag bit 1
adds the step's fallback count, written only when there is one: a frame without fallbacks is the same
bytes as before it existed, and an exporter that reads no engine's own metrics (vLLM's plugin) still
counts them. `encode_frame`
writes version 3 for a partial frame, version 2 for a whole one with a threshold and version 1 for one
without, so every frame has exactly one encoding (a version-3 header naming the whole model is refused).

The decoder trusts nothing: it checks the total size against the header before touching the
payload, so a hostile header cannot make it allocate, and every entropy must be finite and in [0, 1].
Given the frame key, it checks the tag first, before reading anything past the fixed header.

The frame key is shared by the shim and the exporter through a file (`load_frame_key`): without it,
frames are untagged and anyone who can reach the exporter's port can forge them.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from dataclasses import dataclass

import numpy as np

from layerwatch.ports import EXPORTER_FRAMES_PORT, LOOPBACK
from layerwatch.secret_file import read_secret_file
from layerwatch.skip_policy import is_threshold

MAGIC = b"LWGF"
VERSION = 2  # what a frame of the whole model with a threshold is written as
VERSION_WITHOUT_THRESHOLD = 1  # the previous version: still decoded, written for frames without one
VERSION_PARTIAL = 3  # a frame of some of the model's layers (a pipeline stage's), with a threshold
SUPPORTED_VERSIONS = (VERSION_WITHOUT_THRESHOLD, VERSION, VERSION_PARTIAL)
# One UDP datagram on loopback carries at most 65,507 bytes; stay clear of it.
MAX_FRAME_BYTES = 65_000
MAX_NAME_BYTES = 255
# Where the shim sends frames and the exporter listens for them, unless told otherwise.
DEFAULT_FRAMES_ADDRESS = f"{LOOPBACK}:{EXPORTER_FRAMES_PORT}"
FLAG_TAGGED = 0x01  # the frame ends with an authentication tag
FLAG_FALLBACKS = 0x02  # a u16 fallback count follows the skip bits
KNOWN_FLAGS = FLAG_TAGGED | FLAG_FALLBACKS
# HMAC-SHA256 truncated to 128 bits, as IPsec's HMAC-SHA-256-128 (RFC 4868) authenticates each packet:
# a forger gets one guess per datagram, so 2^-128 per try is out of reach, and it saves 16 bytes.
TAG_BYTES = 16

_HEADER = struct.Struct("<4sBBHHQBB")
HEADER_BYTES = _HEADER.size  # 20: the fields every version starts with (all of version 1's header)
_THRESHOLD = struct.Struct("<f")
HEADER_BYTES_V2 = HEADER_BYTES + _THRESHOLD.size  # 24: version 2 adds the threshold
_LAYER_SPAN = struct.Struct("<HH")  # first layer, model layers
HEADER_BYTES_V3 = HEADER_BYTES_V2 + _LAYER_SPAN.size  # 28: version 3 adds where its layers sit
_HEADER_BYTES = {VERSION_WITHOUT_THRESHOLD: HEADER_BYTES, VERSION: HEADER_BYTES_V2, VERSION_PARTIAL: HEADER_BYTES_V3}
_FALLBACKS = struct.Struct("<H")
MAX_FALLBACKS = 0xFFFF
_ENTROPY_DTYPE = np.dtype("<f4")


class FrameTooLarge(ValueError):
    """The frame does not fit in MAX_FRAME_BYTES; send fewer rows per frame."""


class MalformedFrame(ValueError):
    """The bytes are not a valid gate frame; the message says why."""


class UnauthenticatedFrame(ValueError):
    """The frame does not prove it was sent by a holder of the frame key.

    `reason` is "missing_tag" (an untagged frame) or "bad_tag" (the tag does not match: forged,
    altered, or tagged under another key).
    """

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True, eq=False)  # eq=False: ndarray fields have no single truth value
class GateFrame:
    model_name: str  # ≤ 255 UTF-8 bytes, printable (`unprintable`)
    shim_id: str  # ≤ 255 UTF-8 bytes, printable; identifies one shim process (its sequence space)
    sequence: int  # u64, +1 per frame sent by that shim
    entropies: np.ndarray  # float32 [rows, layers], values in [0, 1]
    skipped: np.ndarray  # bool [rows, layers]; True = the skip rule skipped the layer for that row's token
    # The skip policy's τ (an entropy below it counts toward skipping), float32 in [0, 1];
    # None for a version-1 frame, which does not carry it.
    threshold: float | None = None
    # A partial frame (version 3): its columns are the model's layers first_layer.., of model_layers.
    # model_layers None: the columns are the whole model (and first_layer is 0).
    first_layer: int = 0
    model_layers: int | None = None
    # Fallback episodes the sender's breaker started at this step (flag bit 1 when > 0).
    fallbacks: int = 0

    @property
    def partial(self) -> bool:
        """The frame holds some of the model's layers, not all (version 3)."""
        return self.model_layers is not None and (self.first_layer, self.entropies.shape[1]) != (0, self.model_layers)

    @property
    def total_layers(self) -> int:
        """The layers of the whole model the frame belongs to."""
        return self.entropies.shape[1] if self.model_layers is None else self.model_layers


def parse_address(text: str, *, listening: bool = False) -> tuple[str, int]:
    """`host:port` (IPv6 as `[::1]:port`) -> (host, port); raises ValueError.

    Port 0 asks the kernel for any free port: a listener may bind it (`listening=True`, as the
    exporter's `--listen` and `--http` do in tests), but nothing can be sent to it, so a destination
    (the shim's `--exporter-address`) needs a real port.
    """
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"{text!r} is not HOST:PORT")
    if int(port) == 0 and not listening:
        raise ValueError(f"{text!r}: port 0 can only be listened on, not sent to")
    return host.strip("[]"), int(port)


def load_frame_key(path: str | os.PathLike[str]) -> bytes:
    """The frame key: the file's bytes without surrounding whitespace (layerwatch/secret_file.py's
    rules: owner-only, at least MIN_SECRET_BYTES). Raises SecretFileError."""
    return read_secret_file(path, "frame key file")


def frame_bytes(
    rows: int,
    layers: int,
    model_name: str,
    shim_id: str,
    threshold: float | None = None,
    tagged: bool = False,
    partial: bool = False,
    fallbacks: bool = False,
) -> int:
    """Encoded size of a frame, so a sender can split a batch before encoding.

    A frame with a threshold (version 2) is 4 bytes longer than one without (version 1), a partial one
    (version 3) 4 more; a tagged one TAG_BYTES longer than an untagged one, one with fallbacks 2.
    """
    names = len(model_name.encode("utf-8")) + len(shim_id.encode("utf-8"))
    header = HEADER_BYTES_V3 if partial else HEADER_BYTES if threshold is None else HEADER_BYTES_V2
    tag = TAG_BYTES if tagged else 0
    count = _FALLBACKS.size if fallbacks else 0
    return header + names + rows * layers * 4 + rows * _packed_row_bytes(layers) + count + tag


def check_gate_arrays(entropies: np.ndarray, skipped: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Validate a batch of gate outputs; return them as (float32 [R, L], bool [R, L]).

    Raises ValueError naming the problem. Shared by the frame encoder and the trace writer.
    """
    entropies = np.asarray(entropies, dtype=np.float32)
    skipped = np.asarray(skipped)
    if entropies.ndim != 2 or entropies.shape[0] == 0 or entropies.shape[1] == 0:
        raise ValueError(f"entropies must be a non-empty [rows, layers] array, got shape {entropies.shape}")
    if skipped.shape != entropies.shape:
        raise ValueError(f"skipped has shape {skipped.shape}, entropies {entropies.shape}")
    if skipped.dtype != np.bool_:
        # Numbers only: np.isin raises TypeError on a structured array, and an object array compares
        # by its elements' own __eq__, which may raise anything (GateFrameSender.send never raises).
        if skipped.dtype.kind not in "iuf":
            raise ValueError(f"skipped must hold booleans or 0/1 numbers, got dtype {skipped.dtype}")
        if not np.isin(skipped, (0, 1)).all():
            raise ValueError("skipped must hold only 0/1 or booleans")
        skipped = skipped.astype(bool)
    _check_entropy_values(entropies, ValueError)
    return entropies, skipped


def encode_frame(frame: GateFrame, key: bytes | None = None) -> bytes:
    """The frame's datagram; with `key`, tagged (flag bit 0 and an HMAC tag at the end)."""
    entropies, skipped = check_gate_arrays(frame.entropies, frame.skipped)
    rows, layers = entropies.shape
    if rows > 0xFFFF or layers > 0xFFFF:
        raise FrameTooLarge(f"{rows} rows x {layers} layers exceeds the u16 header fields")
    model = _encode_name("model_name", frame.model_name)
    shim = _encode_name("shim_id", frame.shim_id)
    if not 0 <= frame.sequence < 2**64:
        raise ValueError(f"sequence {frame.sequence} is not a u64")
    threshold = b"" if frame.threshold is None else _THRESHOLD.pack(_check_threshold(frame.threshold, ValueError))
    span = b""
    if frame.model_layers is not None:
        _check_layer_span(frame.first_layer, layers, frame.model_layers, ValueError)
    elif frame.first_layer != 0:
        raise ValueError(f"first layer {frame.first_layer} without the model's layer count")
    if frame.partial:
        if frame.threshold is None:
            raise ValueError("a partial frame (version 3) carries a threshold")
        span = _LAYER_SPAN.pack(frame.first_layer, frame.model_layers)
    count = frame.fallbacks
    if isinstance(count, bool) or not isinstance(count, (int, np.integer)) or not 0 <= count <= MAX_FALLBACKS:
        raise ValueError(f"fallbacks {frame.fallbacks!r} is not a u16")
    fallbacks = _FALLBACKS.pack(frame.fallbacks) if frame.fallbacks else b""
    size = frame_bytes(
        rows,
        layers,
        frame.model_name,
        frame.shim_id,
        frame.threshold,
        key is not None,
        partial=frame.partial,
        fallbacks=bool(fallbacks),
    )
    if size > MAX_FRAME_BYTES:
        raise FrameTooLarge(
            f"frame of {rows} rows x {layers} layers needs {size} bytes, "
            f"limit {MAX_FRAME_BYTES}: send fewer rows per frame"
        )
    version = VERSION_PARTIAL if frame.partial else VERSION_WITHOUT_THRESHOLD if frame.threshold is None else VERSION
    flags = (0 if key is None else FLAG_TAGGED) | (FLAG_FALLBACKS if fallbacks else 0)
    header = _HEADER.pack(MAGIC, version, flags, rows, layers, frame.sequence, len(model), len(shim))
    bits = np.packbits(skipped, axis=1)
    data = b"".join(
        (
            header,
            threshold,
            span,
            model,
            shim,
            entropies.astype(_ENTROPY_DTYPE, copy=False).tobytes(),
            bits.tobytes(),
            fallbacks,
        )
    )
    return data if key is None else data + _tag(key, data)


def decode_frame(data: bytes, key: bytes | None = None) -> GateFrame:
    """Decode one datagram. Raises MalformedFrame with the reason for anything wrong.

    With `key`, only a frame tagged under that key decodes: anything else raises UnauthenticatedFrame
    before the payload is read. Without a key, a tagged frame decodes too (its tag unchecked), so
    shims can be given the key before the exporter is.
    The arrays are read-only views of `data` (no copy on the ingest path).
    """
    if len(data) > MAX_FRAME_BYTES:
        raise MalformedFrame(f"{len(data)} bytes exceeds the frame limit of {MAX_FRAME_BYTES}")
    if len(data) < HEADER_BYTES:
        raise MalformedFrame(f"{len(data)} bytes is shorter than the {HEADER_BYTES}-byte header")
    magic, version, flags, rows, layers, sequence, model_len, shim_len = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise MalformedFrame(f"bad magic {magic!r}, expected {MAGIC!r}")
    if version not in SUPPORTED_VERSIONS:
        raise MalformedFrame(
            f"unsupported version {version}, this decoder reads {', '.join(map(str, SUPPORTED_VERSIONS))}"
        )
    if flags & ~KNOWN_FLAGS:
        raise MalformedFrame(f"unknown flags 0x{flags:02x}")
    tagged = bool(flags & FLAG_TAGGED)
    if tagged:
        if len(data) < HEADER_BYTES + TAG_BYTES:
            raise MalformedFrame(f"{len(data)} bytes is too short for a tagged frame")
        data, tag = data[:-TAG_BYTES], data[-TAG_BYTES:]
    if key is not None:
        if not tagged:
            raise UnauthenticatedFrame("missing_tag", "the frame carries no authentication tag")
        if not hmac.compare_digest(tag, _tag(key, data)):
            raise UnauthenticatedFrame("bad_tag", "the authentication tag does not match the frame key")
    if rows == 0 or layers == 0:
        raise MalformedFrame(f"empty frame: {rows} rows x {layers} layers")
    if model_len == 0 or shim_len == 0:
        raise MalformedFrame("model_name and shim_id must not be empty")
    header_bytes = _HEADER_BYTES[version]
    row_bits = _packed_row_bytes(layers)
    counted = flags & FLAG_FALLBACKS
    expected = header_bytes + model_len + shim_len + rows * layers * 4 + rows * row_bits
    expected += _FALLBACKS.size if counted else 0
    if len(data) != expected:
        raise MalformedFrame(
            f"{len(data)} bytes{' before the tag' if tagged else ''}, but the header (version {version}, "
            f"{rows} rows x {layers} layers, names {model_len}+{shim_len} bytes) describes {expected}"
        )

    threshold = None
    if version != VERSION_WITHOUT_THRESHOLD:
        (threshold,) = _THRESHOLD.unpack_from(data, HEADER_BYTES)
        _check_threshold(threshold, MalformedFrame)
    first_layer, model_layers = 0, None
    if version == VERSION_PARTIAL:
        first_layer, model_layers = _LAYER_SPAN.unpack_from(data, HEADER_BYTES_V2)
        _check_layer_span(first_layer, layers, model_layers, MalformedFrame)
        if (first_layer, layers) == (0, model_layers):
            raise MalformedFrame(f"a version-3 frame of all {layers} layers (a whole frame is version 2)")
    offset = header_bytes
    model_name = _decode_name("model_name", data[offset : offset + model_len])
    offset += model_len
    shim_id = _decode_name("shim_id", data[offset : offset + shim_len])
    offset += shim_len
    entropies = np.frombuffer(data, dtype=_ENTROPY_DTYPE, count=rows * layers, offset=offset)
    entropies = entropies.reshape(rows, layers)
    _check_entropy_values(entropies, MalformedFrame)
    offset += rows * layers * 4
    packed = np.frombuffer(data, dtype=np.uint8, count=rows * row_bits, offset=offset)
    bits = np.unpackbits(packed.reshape(rows, row_bits), axis=1)
    if bits[:, layers:].any():
        raise MalformedFrame("padding bits after the last layer are set")
    skipped = bits[:, :layers].view(bool)
    fallbacks = 0
    if counted:
        (fallbacks,) = _FALLBACKS.unpack_from(data, offset + rows * row_bits)
        if fallbacks == 0:
            raise MalformedFrame("flag bit 1 with a fallback count of 0 (a frame without fallbacks has no count)")
    return GateFrame(model_name, shim_id, sequence, entropies, skipped, threshold, first_layer, model_layers, fallbacks)


def _tag(key: bytes, data: bytes) -> bytes:
    return hmac.new(key, data, hashlib.sha256).digest()[:TAG_BYTES]


def _packed_row_bytes(layers: int) -> int:
    return (layers + 7) // 8


def _check_entropy_values(entropies: np.ndarray, error: type[ValueError]) -> None:
    # One pass for the common case; the slower diagnosis only runs when something is wrong.
    if ((entropies >= 0) & (entropies <= 1)).all():
        return
    if not np.isfinite(entropies).all():
        raise error("entropies contain NaN or infinity")
    raise error(f"entropies outside [0, 1]: min {entropies.min()}, max {entropies.max()}")


def _check_layer_span(first_layer: int, layers: int, model_layers: int, error: type[ValueError]) -> None:
    if not 0 <= first_layer < first_layer + layers <= model_layers <= 0xFFFF:
        raise error(f"layers {first_layer}..{first_layer + layers - 1} are not inside a model of {model_layers} layers")


def _check_threshold(threshold: float, error: type[ValueError]) -> float:
    """τ as it travels: a float32 in [0, 1] (NaN fails the comparison; -0.0 becomes 0.0)."""
    if isinstance(threshold, bool):
        raise error(f"threshold {threshold} is not a number")
    value = float(np.float32(threshold)) + 0.0
    if not is_threshold(value):
        raise error(f"threshold {threshold} is not in [0, 1]")
    return value


def unprintable(name: str) -> str | None:
    """The first character of a model name or shim id that is not printable (`str.isprintable`:
    control, format and separator characters other than the space), as `repr` writes it; None when
    there is none. Names become label values and lines of `top` and `replay`: an escape sequence or a
    newline in one would reach an operator's terminal as one, so frames and trace lines refuse them."""
    return next((repr(c) for c in name if not c.isprintable()), None)


def _encode_name(field: str, value: str) -> bytes:
    raw = value.encode("utf-8")
    if not 0 < len(raw) <= MAX_NAME_BYTES:
        raise ValueError(f"{field} must be 1..{MAX_NAME_BYTES} UTF-8 bytes, got {len(raw)}")
    if (character := unprintable(value)) is not None:
        raise ValueError(f"{field} holds {character}, which is not printable")
    return raw


def _decode_name(field: str, raw: bytes) -> str:
    try:
        name = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise MalformedFrame(f"{field} is not valid UTF-8: {exc.reason} at byte {exc.start}") from None
    if (character := unprintable(name)) is not None:
        raise MalformedFrame(f"{field} holds {character}, which is not printable")
    return name
