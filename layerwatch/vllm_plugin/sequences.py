"""Which skip-policy state each row of a vLLM batch continues, keyed by the KV slot of its sequence's newest token.

vLLM passes the model no request ids: a forward is a flat batch of tokens with attention metadata. What
it does pass, for every scheduled sequence, is where each token's K/V goes (`slot_mapping`) and where the
sequence's earlier tokens are (`block_table`). A sequence's newest token has exactly one KV slot, and no
other live sequence writes that slot while it lives, so the slot is a name for the sequence that moves
with it: a decode row (one new token) finds its state under the slot of the token before it and leaves
it under its own token's slot. Every other row (a prefill, the last chunk of a chunked prefill, a
recompute after preemption, a row whose previous slot holds nothing) starts a fresh state, and so runs
full depth for `patience` steps (docs/vllm.md, "Which sequence a row is").

The states live in one SkipPolicy (the project's one rule), one of its slots per sequence: `rows` maps a
KV slot to the policy slot holding that sequence's state. States of finished sequences are never told
apart from live ones (vLLM does not say), so the pool is bounded and the least recently stepped state
is given up when a new one needs room; a live sequence is stepped at every step it is scheduled.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class BatchRows:
    """Where each sequence of a flat vLLM batch is, read from its attention metadata (host arrays)."""

    last_tokens: np.ndarray  # int [R]: the index, in the flat batch, of each sequence's last token this step
    decode: np.ndarray  # bool [R]: the sequence brings one token after earlier ones (a decode step)
    new_slots: np.ndarray  # int [R]: the KV slot of that last token
    previous_slots: np.ndarray  # int [R]: the KV slot of the token before it (-1 where there is none)

    @classmethod
    def from_metadata(
        cls,
        query_start_loc: np.ndarray,
        seq_lens: np.ndarray,
        slot_mapping: np.ndarray,
        block_table: np.ndarray,
        block_size: int,
    ) -> BatchRows:
        """query_start_loc int [R + 1], seq_lens int [R] (tokens of each sequence once this step ran),
        slot_mapping int [N] (each token's KV slot), block_table int [R, blocks] (each sequence's blocks)."""
        starts, ends = query_start_loc[:-1], query_start_loc[1:]
        last_tokens = ends - 1
        rows = np.arange(len(seq_lens))

        def slots(positions: np.ndarray) -> np.ndarray:  # each row's KV slot at a position of its own
            return block_table[rows, positions // block_size] * block_size + positions % block_size

        new_slots = slot_mapping[last_tokens]
        if not np.array_equal(slots(seq_lens - 1), new_slots):
            raise ValueError(f"the KV slots vLLM writes do not follow blocks of {block_size} tokens")
        previous_position = seq_lens - 2  # the position of the token before each sequence's last one
        decode = (ends - starts == 1) & (previous_position >= 0)
        previous_slots = np.where(decode, slots(np.maximum(previous_position, 0)), -1)
        return cls(last_tokens, decode, new_slots, previous_slots)


class SequenceStates:
    """KV slot of a sequence's newest token -> its policy slot, for at most `capacity` sequences."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._by_kv_slot: OrderedDict[int, int] = OrderedDict()  # least recently stepped first
        self._free = list(range(capacity - 1, -1, -1))

    def step(self, rows: BatchRows) -> tuple[np.ndarray, np.ndarray]:
        """The policy slot of each row this step -> (slots int [R], fresh bool [R]: a new sequence's state,
        which the caller resets). Each state is filed under its row's new KV slot."""
        taken = [
            self._by_kv_slot.pop(int(previous), None) if decode else None
            for previous, decode in zip(rows.previous_slots, rows.decode)
        ]
        fresh = np.array([slot is None for slot in taken], dtype=bool)
        slots = np.array([self._new_slot() if slot is None else slot for slot in taken], dtype=np.int64)
        for kv_slot, slot in zip(rows.new_slots.tolist(), slots.tolist()):
            stale = self._by_kv_slot.pop(kv_slot, None)  # a finished sequence's state under a reused slot
            if stale is not None:
                self._free.append(stale)
            self._by_kv_slot[kv_slot] = slot
        return slots, fresh

    def _new_slot(self) -> int:
        if not self._free:  # give up the state stepped longest ago
            _, slot = self._by_kv_slot.popitem(last=False)
            return slot
        return self._free.pop()
