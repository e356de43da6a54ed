"""StreamingSwitchGLU: drop-in for mlx-lm's ``SwitchGLU`` whose experts live on disk.

Same call, ``(x, indices) -> y``, so mlx-lm's routers, shared experts and mixing run unchanged. Each
call is one schedule, picked by ``schedules.choose`` (from the bank's state, the call's size and the
model call's verified step, if any) and run: the router's indices straight to the kernel where every
expert is resident in its own slot (``StockGraph``), slot ids mapped on the device inside a
verified step (``Verified``), or one host sync to read the router's expert ids and then all
host work for the layer at once: make the experts resident in the layer's slot bank, map expert ids
to slot ids, and hand both to the kernel the selector picks (the other schedules). The host sync
also evaluates the next MoE layer's router applied to this layer's input (lookahead): its predicted
experts are read in the background while this layer computes (``prefetch``). Every (token, expert)
row is computed exactly once, by the same kernel, so each schedule gives stock's bits.
"""

import threading

import mlx.core as mx
import mlx.nn as nn

from . import layer_pass, schedules


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
        across = layer_pass.this_thread.layer  # (an attribute: no call on the hot path)
        if across is not None:  # a layer of a long prompt's chunks, its experts read once
            return across.moe_call(self, x, indices)
        bank = self.bank
        complete = bank.stock_call  # a complete bank: stock's graph, nothing to choose
        if complete is not None:
            return complete(x, indices)
        cache = bank.cache
        steps = cache.steps  # the verified step this thread's model call runs, if any
        step = steps.this_thread.step if steps is not None else None
        # (a verified step entered the cache once, before its forward; ``enter_call``'s checks
        # inline: once a thread has entered a planned cache, nothing is left to do)
        if step is None and (not cache.planned or threading.get_ident() not in cache.callers):
            cache.enter_call()  # before the choice: a second calling thread turns direct reads off
        return schedules.choose(self, x, indices, step).run()
