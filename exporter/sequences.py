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


class SequenceVerdict(NamedTuple):
    lost: int  # frames missing between this frame and the previous one of its stream
    interleaved: bool  # the frame switched to another live stream of its shim id: two senders share the id


@dataclass
class _Stream:
    last: int


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
        lost = sequence - best.last - 1
        best.last = sequence
        interleaved = best is not shim.current
        shim.current = best
        return SequenceVerdict(lost, interleaved)
