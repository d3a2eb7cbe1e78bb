"""Frame sequence numbers per shim id: frames lost in transit, restarts, shim id collisions, replays.

A shim numbers the frames it sends 0, 1, 2, ... under its shim id (docs/wire-format.md, "Sequence
numbers and loss"). Under one id the exporter keeps a few *streams*, each the last sequence number
of one run of frames, and attributes each frame to the stream it continues: the one whose last
number is the largest below the frame's (on a tie, the newest stream). Numbers skipped between the
two were lost in transit; a frame that continues no stream (its number is not above any of them)
starts a new stream: a restarted shim, whose old stream is never continued again.

Two processes sending under one id (a shared `--shim-id`, or hostname-pid where every container's
shim is PID 1) interleave two streams, so frames keep switching between them. Such a switch counts
as an *interleaved* frame; the jumps between the two numberings are never counted as loss, so a
collision is reported as one and does not raise LayerwatchTelemetryLoss. A real restart switches
once at most (if frames are lost just where the new numbering overtakes the old one).

UDP may also reorder datagrams (0, 1, 2, 4, 3, 5): 4 counts 3 as lost, and 3, below its stream's
last number, would start a new stream, and 5 then switch back to the old one. So each stream
remembers which of its last REORDER_WINDOW numbers it counted as lost; a frame that fills one of
those gaps of the current stream is *late*: it takes its loss back and stays in its stream.

Two kinds of frame are refused (the verdict's `rejected`, a reason of
layerwatch_exporter_frames_rejected_total):

- `sequence_jump`: a number more than MAX_SEQUENCE_GAP past its stream's last one. No shim loses
  that many frames between two that arrive; a forged number would otherwise count up to 2**64 lost
  frames at once, a counter no later loss could be seen on (float64 holds integers exactly only up
  to 2**53). The jump starts a stream of its own, so a shim that did lose that many is followed
  again from its next frame, and the stream it jumped from keeps its number.
- `replayed`, only when frames are authenticated (the exporter has the frame key): then a shim id
  is one sequence space, as an IPsec security association is, and the tracker keeps one stream per
  id with RFC 4303's anti-replay window (§3.4.3): a number above the last is new; one of the last
  REORDER_WINDOW numbers is accepted once, only if it was counted as lost (a late frame); anything
  else was already received, or is too old to tell, and is a replay. Without the key a replay
  cannot be told from a restart, and needs no telling: anyone can forge any frame.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import NamedTuple

# Sequence numbers are remembered for this many shim ids (least recently heard from is forgotten
# first), so a stream of made-up shim ids cannot grow memory without bound.
MAX_TRACKED_SHIMS = 4096
# Streams kept per shim id, newest last: a new stream beyond this forgets the oldest.
MAX_STREAMS_PER_SHIM = 4
# How far below its stream's last number a frame may arrive and still count as late, not as a new
# stream (UDP reorders by a few datagrams at most); with the frame key, the anti-replay window (64,
# the size RFC 4303 prefers).
REORDER_WINDOW = 64
# The most frames one gap between two frames of a stream may count as lost: about an hour of frames
# at 300 frames/s (a busy shim sends tens per second, docs/scaling.md). Far below 2**53, so the
# loss counter stays exact through millions of such gaps.
MAX_SEQUENCE_GAP = 2**20

SEQUENCE_JUMP = "sequence_jump"
REPLAYED = "replayed"
REJECT_REASONS = (SEQUENCE_JUMP, REPLAYED)


class SequenceVerdict(NamedTuple):
    # Frames missing between this frame and the previous one of its stream; -1 for a late frame,
    # which fills a gap counted as lost before.
    lost: int
    interleaved: bool  # the frame switched to another live stream of its shim id: two senders share the id
    rejected: str | None = None  # a REJECT_REASONS entry: the frame is to be dropped


_NEW = SequenceVerdict(0, False)
_LATE = SequenceVerdict(-1, False)


@dataclass
class _Stream:
    last: int
    # Bit k set: number last - 1 - k was counted as lost (k < REORDER_WINDOW). An int, not a set, so
    # that MAX_TRACKED_SHIMS × MAX_STREAMS_PER_SHIM streams stay small. The numbers below a stream's
    # first frame were never counted as lost: to the replay window, they were received.
    missing: int = 0

    def advance(self, sequence: int) -> int:
        """Continue with `sequence` (above `last`, at most MAX_SEQUENCE_GAP past it); the number of
        frames skipped."""
        skipped = sequence - self.last - 1
        older = self.missing << (skipped + 1) if skipped < REORDER_WINDOW else 0
        self.missing = (older | (1 << min(skipped, REORDER_WINDOW)) - 1) & ((1 << REORDER_WINDOW) - 1)
        self.last = sequence
        return skipped

    def fill(self, sequence: int) -> bool:
        """Whether `sequence` is a gap counted as lost (it no longer is after this)."""
        bit = self.last - 1 - sequence
        if not 0 <= bit < REORDER_WINDOW or not self.missing >> bit & 1:
            return False
        self.missing &= ~(1 << bit)
        return True


@dataclass
class _ShimStreams:
    streams: list[_Stream]  # oldest first
    current: _Stream  # the stream of the previous frame


class SequenceTracker:
    """`authenticated`: every frame observed was checked against the frame key, so a shim id is one
    sequence space and numbers it already sent are replays (see above)."""

    def __init__(self, authenticated: bool = False) -> None:
        self.authenticated = authenticated
        self._shims: collections.OrderedDict[str, _ShimStreams] = collections.OrderedDict()

    def observe(self, shim_id: str, sequence: int) -> SequenceVerdict:
        shim = self._shims.get(shim_id)
        if shim is None:
            first = _Stream(sequence)
            self._shims[shim_id] = _ShimStreams([first], first)
            if len(self._shims) > MAX_TRACKED_SHIMS:
                self._shims.popitem(last=False)  # least recently heard from
            return _NEW
        self._shims.move_to_end(shim_id)
        if shim.current.fill(sequence):
            return _LATE
        if self.authenticated:
            if sequence <= shim.current.last:
                return SequenceVerdict(0, False, REPLAYED)
            return self._continue(shim, shim.current, sequence)
        # The closest predecessor: the stream with the largest last number below this one (oldest
        # first, so `>=` keeps the newest among equals).
        best = None
        for stream in shim.streams:
            if stream.last < sequence and (best is None or stream.last >= best.last):
                best = stream
        if best is None:
            self._new_stream(shim, sequence)
            return _NEW
        return self._continue(shim, best, sequence)

    def _continue(self, shim: _ShimStreams, stream: _Stream, sequence: int) -> SequenceVerdict:
        if sequence - stream.last - 1 > MAX_SEQUENCE_GAP:
            # A stream of its own, as a restart's: the stream jumped from keeps its number, so a forged
            # jump under a real shim id does not carry the real numbering off.
            self._new_stream(shim, sequence)
            return SequenceVerdict(0, False, SEQUENCE_JUMP)
        interleaved = stream is not shim.current
        shim.current = stream
        return SequenceVerdict(stream.advance(sequence), interleaved)

    def _new_stream(self, shim: _ShimStreams, sequence: int) -> None:
        shim.current = _Stream(sequence)
        # Authenticated: one sequence space per shim id, which the new stream replaces.
        kept = [] if self.authenticated else shim.streams
        shim.streams = [*kept, shim.current][-MAX_STREAMS_PER_SHIM:]
