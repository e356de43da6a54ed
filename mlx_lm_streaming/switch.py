"""StreamingSwitchGLU: drop-in for mlx-lm's ``SwitchGLU`` whose experts live on disk.

Same call, ``(x, indices) -> y``, so mlx-lm's routers, shared experts and mixing run unchanged. Per call:
one host sync to read the router's expert ids, then all host work for the layer at once: make the
experts resident in the layer's slot bank, map expert ids to slot ids, and hand both to the kernel the
selector picks.

If a call needs more distinct experts than the bank has slots (prefill with a small budget), the experts
are processed in waves of at most ``slots``: each wave's experts are loaded (never evicting one the wave
uses), its rows computed and evaluated, then the next wave goes. Every (token, expert) row is computed
exactly once, so the result is the same as in one go.
"""

import mlx.core as mx
import mlx.nn as nn
import numpy as np


class StreamingSwitchGLU(nn.Module):
    """Routed experts read on demand through an ``ExpertCache`` slot bank."""

    def __init__(self, bank, selector):
        super().__init__()
        # plain attributes, not parameters: the banks never appear in model.parameters()
        object.__setattr__(self, "_bank", bank)
        object.__setattr__(self, "_selector", selector)

    @property
    def bank(self):
        return self._bank

    @property
    def num_experts(self) -> int:
        return self._bank.num_experts

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        bank = self._bank
        indices = mx.stop_gradient(indices)
        idx = np.array(indices, copy=False).astype(np.int64)  # the one host sync
        experts = np.unique(idx)
        bank.cache.ensure_planned()
        if len(experts) <= bank.slots:
            with bank.lock:
                bank.load(experts)
                slots_np = bank.slot_of[idx]
                slots = mx.array(slots_np.astype(np.uint32))
                kernel = self._selector.select(bank, idx.size)
                return kernel(x, slots, slots_np, bank)
        return self._waves(x, idx, experts)

    def _waves(self, x, idx, experts):
        bank = self._bank
        k = idx.shape[-1]
        flat = idx.reshape(-1)
        x_flat = x.reshape(-1, x.shape[-1])
        outs, rows_done = [], []
        for start in range(0, len(experts), bank.slots):
            wave = experts[start : start + bank.slots]
            rows = np.nonzero(np.isin(flat, wave))[0]
            with bank.lock:
                bank.load(wave)
                slots_np = bank.slot_of[flat[rows]][:, None]
                slots = mx.array(slots_np.astype(np.uint32))
                xw = x_flat[mx.array(rows // k)]
                kernel = self._selector.select(bank, rows.size)
                yw = kernel(xw, slots, slots_np, bank)[:, 0]
                # finish this wave before the next one reuses the slots
                mx.eval(yw)
            outs.append(yw)
            rows_done.append(rows)
        order = np.argsort(np.concatenate(rows_done), kind="stable")
        y = mx.concatenate(outs, axis=0)[mx.array(order)]
        return y.reshape(*idx.shape, y.shape[-1])
