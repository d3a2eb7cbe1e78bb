"""Frame sequence numbers per shim id: frames lost in transit, restarts, and shim id collisions.

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
# stream (UDP reorders by a few datagrams at most).
REORDER_WINDOW = 64


class SequenceVerdict(NamedTuple):
    # Frames missing between this frame and the previous one of its stream; -1 for a late frame,
    # which fills a gap counted as lost before.
    lost: int
    interleaved: bool  # the frame switched to another live stream of its shim id: two senders share the id


@dataclass
class _Stream:
    last: int
    # Bit k set: number last - 1 - k was counted as lost (k < REORDER_WINDOW). An int, not a set, so
    # that MAX_TRACKED_SHIMS × MAX_STREAMS_PER_SHIM streams stay small.
    missing: int = 0

    def advance(self, sequence: int) -> int:
        """Continue with `sequence` (above `last`); the number of frames skipped."""
        skipped = sequence - self.last - 1
        # Bounded shifts: a jump may be 2**63 numbers.
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
    def __init__(self) -> None:
        self._shims: collections.OrderedDict[str, _ShimStreams] = collections.OrderedDict()

    def observe(self, shim_id: str, sequence: int) -> SequenceVerdict:
        shim = self._shims.get(shim_id)
        if shim is None:
            first = _Stream(sequence)
            self._shims[shim_id] = _ShimStreams([first], first)
            if len(self._shims) > MAX_TRACKED_SHIMS:
                self._shims.popitem(last=False)  # least recently heard from
            return SequenceVerdict(0, False)
        self._shims.move_to_end(shim_id)
        if shim.current.fill(sequence):
            return SequenceVerdict(-1, False)
        # The closest predecessor: the stream with the largest last number below this one (oldest
        # first, so `>=` keeps the newest among equals).
        best = None
        for stream in shim.streams:
            if stream.last < sequence and (best is None or stream.last >= best.last):
                best = stream
        if best is None:
            shim.current = _Stream(sequence)
            shim.streams = [*shim.streams, shim.current][-MAX_STREAMS_PER_SHIM:]
            return SequenceVerdict(0, False)
        lost = best.advance(sequence)
        interleaved = best is not shim.current
        shim.current = best
        return SequenceVerdict(lost, interleaved)
