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
from dataclasses import dataclass, field

# Sequence numbers are remembered for this many shim ids (least recently heard from is forgotten
# first), so a stream of made-up shim ids cannot grow memory without bound.
MAX_TRACKED_SHIMS = 4096
# Streams kept per shim id, newest last: a new stream beyond this forgets the oldest.
MAX_STREAMS_PER_SHIM = 4


@dataclass(frozen=True)
class SequenceVerdict:
    lost: int  # frames missing between this frame and the previous one of its stream
    interleaved: bool  # the frame switched to another live stream of its shim id: two senders share the id


@dataclass
class _Stream:
    last: int


@dataclass
class _ShimStreams:
    streams: list[_Stream] = field(default_factory=list)  # oldest first
    current: _Stream | None = None  # the stream of the previous frame


class SequenceTracker:
    def __init__(self) -> None:
        self._shims: collections.OrderedDict[str, _ShimStreams] = collections.OrderedDict()

    def observe(self, shim_id: str, sequence: int) -> SequenceVerdict:
        shim = self._shims.pop(shim_id, None) or _ShimStreams()
        self._shims[shim_id] = shim  # most recently heard from: forgotten last
        if len(self._shims) > MAX_TRACKED_SHIMS:
            self._shims.popitem(last=False)

        # The closest predecessor; among equals the newest (max keeps the first maximum: scan newest first).
        predecessors = [stream for stream in reversed(shim.streams) if stream.last < sequence]
        if not predecessors:
            stream = _Stream(sequence)
            shim.streams = [*shim.streams, stream][-MAX_STREAMS_PER_SHIM:]
            shim.current = stream
            return SequenceVerdict(lost=0, interleaved=False)
        stream = max(predecessors, key=lambda s: s.last)
        lost = sequence - stream.last - 1
        stream.last = sequence
        interleaved = stream is not shim.current
        shim.current = stream
        return SequenceVerdict(lost=lost, interleaved=interleaved)
