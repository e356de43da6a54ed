"""Slot table: which expert each slot of one layer's bank holds, and which slots to give up.

A layer's bank has ``slots`` slots; ``slot_of[expert]`` is the expert's slot (-1: not resident) and
``expert_of[slot]`` the slot's expert (-1: free). ``last_used[slot]`` is the tick of the last call that
used the slot, for the victim choice: free slots first, then the least recently used; a pinned slot
(an expert the call computes from, or one it keeps) is never given up. ``victims`` is that whole
choice, in one method, so that an eviction policy can take it over.

Pure numpy: no threads (the bank's lock guards the table), no MLX, no bytes.
"""

from typing import Sequence

import numpy as np

_PINNED = np.iinfo(np.int64).max


class SlotTable:
    """Expert <-> slot maps of one bank, with the least-recently-used victim choice."""

    def __init__(self, num_experts: int, name: str = ""):
        self.num_experts = num_experts
        self.name = name  # the layer's path, for messages
        self.slot_of = np.full(num_experts, -1, dtype=np.int64)
        self.expert_of = np.zeros(0, dtype=np.int64)
        self.last_used = np.zeros(0, dtype=np.int64)

    @property
    def slots(self) -> int:
        return len(self.expert_of)

    def reset(self, slots: int) -> None:
        """Empty, with ``slots`` slots."""
        self.slot_of[:] = -1
        self.expert_of = np.full(slots, -1, dtype=np.int64)
        self.last_used = np.full(slots, -1, dtype=np.int64)

    def use(self, experts: np.ndarray, tick: int) -> np.ndarray:
        """Mark the resident ones of ``experts`` used at ``tick``; returns which are resident."""
        slots = self.slot_of[experts]
        hit = slots >= 0
        self.last_used[slots[hit]] = tick
        return hit

    def victims(self, n: int, pinned: Sequence[int] = ()) -> np.ndarray:
        """``n`` slots to read experts into: free slots first, then least recently used (lowest slot
        first among equals); never the slot of an expert in ``pinned``. Raises ValueError if fewer
        than ``n`` slots are not pinned."""
        priority = self.last_used.copy()
        if len(pinned):
            held = self.slot_of[np.asarray(pinned, dtype=np.int64)]
            priority[held[held >= 0]] = _PINNED
        victims = np.argsort(priority, kind="stable")[:n]
        if (priority[victims] == _PINNED).any():
            raise ValueError(
                f"{self.name}: {n} experts to read but fewer slots are free of pinned and kept "
                "experts"
            )
        return victims

    def free(self, slots: np.ndarray) -> int:
        """Unmap whatever ``slots`` hold; returns how many experts that evicted."""
        old = self.expert_of[slots]
        evicted = int((old >= 0).sum())
        self.slot_of[old[old >= 0]] = -1
        self.expert_of[slots] = -1
        self.last_used[slots] = -1
        return evicted

    def assign(self, experts, slots, tick: int) -> None:
        """``experts`` are now resident in ``slots`` (free ones), used at ``tick``."""
        self.slot_of[experts] = slots
        self.expert_of[slots] = experts
        self.last_used[slots] = tick
