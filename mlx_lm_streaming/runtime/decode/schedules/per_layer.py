"""The per-layer schedules without direct reads: experts loaded through staging buffers (MLX
updates of the bank), then computed."""

import mlx.core as mx
import numpy as np

from ...reads import lookahead
from .base import ExpertRows, PerLayer


class OneCall(PerLayer):
    """Chosen without direct reads (no host view of the bank, a second calling thread, or
    ``direct_reads`` off) when the call's experts surely fit the bank's slots (no more rows than
    slots, or a slot for every expert): load them (through staging buffers), then one kernel call
    over all rows. Measured faster than the seed designs (docs/benchmarks/README.md, "What won,
    what lost")."""

    def compute(self, idx, experts, ahead):
        bank = self.bank
        bank.load(experts)
        if ahead is not None:
            lookahead.stage(*ahead)
        if bank.identity:
            if not bank.complete:
                bank.cache.request_fill(bank)
            return self.kernel(self.x, self.indices, idx, bank)
        slots_np = bank.slot_of[idx]
        slots = mx.array(slots_np.astype(np.uint32))
        return self.kernel(self.x, slots, slots_np, bank)


class Waves(ExpertRows):
    """Chosen without direct reads when the call's experts may not fit the bank's slots (prefill
    with a small budget): waves of ``slots`` experts (``bank.waves.staged``), each loaded (never
    evicting one the wave uses), computed and evaluated before the next, whose experts are read in
    the background meanwhile. Expert-major: each expert is read at most once per call. Runs
    outside the bank's lock but for each wave. Measured: CPU cold prefill near its I/O limit."""

    locked = False
    staged_reads = True
