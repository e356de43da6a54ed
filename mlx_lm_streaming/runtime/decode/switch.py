"""StreamingSwitchGLU: drop-in for mlx-lm's ``SwitchGLU`` whose experts live on disk.

Same call, ``(x, indices) -> y``, so mlx-lm's routers, shared experts and mixing run unchanged. Each
call goes to the running model call's mode (``modes``: ``cache.mode.moe_call``), chosen once for
that call: each layer on its own (its schedule picked by ``schedules.choose`` from the bank's state
and the call's size: the router's indices straight to the kernel where every expert is resident in
its own slot, or one host sync to read the router's expert ids and then all host work for the layer
at once: make the experts resident in the layer's slot bank, map expert ids to slot ids, and hand
both to the kernel the selector picks), a verified step (slot ids mapped on the device, no host
sync), stock's graph over complete banks, or a layer of layer-major prefill. Every (token, expert)
row is computed exactly once, by the same kernel, so each mode gives stock's bits.
"""

from threading import get_ident

import mlx.core as mx
import mlx.nn as nn

from .modes import PER_LAYER


class StreamingSwitchGLU(nn.Module):
    """Routed experts read on demand through an ``ExpertCache`` slot bank."""

    def __init__(self, bank, selector):
        super().__init__()
        # plain attributes, not parameters: the banks never appear in model.parameters()
        object.__setattr__(self, "bank", bank)
        object.__setattr__(self, "selector", selector)
        # rows -> (the selector's kernel for this bank, whether its rows are ``subset_exact``),
        # for calls of fewer than ``SORT_THRESHOLD`` rows (decode): a plain dict read by ``choose``
        object.__setattr__(self, "kernels", {})

    @property
    def num_experts(self) -> int:
        return self.bank.num_experts

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        mode = self.bank.cache.mode  # the running model call's (an attribute: no call)
        owner = mode.owner
        if owner is not None and owner != get_ident():  # another thread's call holds it
            mode = PER_LAYER
        return mode.moe_call(self, x, indices)
