"""The schedules of one MoE layer call, and ``choose``, the one function that picks among them.

A ``StreamingSwitchGLU`` call is ``choose(layer, x, indices, step).run()``. ``choose`` is the whole
dispatch condition and does nothing else: no host sync, no lock, no read. It picks the kernel once
for the call, and a schedule class by the bank's state, the kernel, the call's row count and whether
the model call is a verified step (``step``). Each schedule's ``run`` then does the call top to
bottom: the host sync, the reads issued, the hits submitted, the read experts taken as they land
(``LayerBank.reads``: a generator of landings, as ``concurrent.futures.as_completed``), the
compute. Each computes every (token, expert) row exactly once, by the call's kernel, over the same
slot bank, so each gives stock's bits. Each is kept for a measured reason
(docs/benchmarks/README.md; docs/design.md's table lists them, with the figures).

``choose`` takes, in order: ``StockGraph`` (a complete identity bank; where its kernel runs stock's
``SwitchGLU`` code, the layer's later calls skip ``choose``: ``LayerBank.stock_call``),
``Verified`` (inside a verified step); otherwise a per-layer schedule (one host sync per call):
with direct reads ``PrefillWaves``, ``PrefillAsTheyLand``, ``ByProjection`` or ``AsTheyLand`` by
the call's size, the experts' size and the kernel; without, ``OneCall`` where the call's experts
surely fit the slots, else ``Waves``.

The schedules, by the host work they start from: ``sync_free.py`` (none), ``per_layer.py`` (the
layer's one host sync; staged reads without direct ones), ``direct.py`` (direct reads, taken as
they land); what they share, ``base.py``.
"""

import mlx.core as mx

from .. import mlx_shims
from ..mlx_compat import SORT_THRESHOLD
from .base import PerLayer, Schedule, kernel_rows, member, submit, wait
from .direct import AsTheyLand, ByProjection, Direct, PrefillAsTheyLand, PrefillWaves
from .per_layer import OneCall, Waves
from .sync_free import StockGraph, Verified

__all__ = [
    "choose", "names", "kernel_rows", "member", "submit", "wait", "Schedule", "PerLayer",
    "StockGraph", "Verified", "OneCall", "Waves", "Direct", "AsTheyLand", "ByProjection",
    "PrefillAsTheyLand", "PrefillWaves",
]  # fmt: skip


def choose(layer, x: mx.array, indices: mx.array, step=None) -> "Schedule":
    """The schedule of ``layer``'s call on ``x`` with the router's ``indices``, inside the verified
    step ``step`` (None: outside one): the whole dispatch condition."""
    bank = layer.bank
    selector = layer.selector
    rows = indices.size
    chosen = layer.kernels.get(rows)  # (the selector's choice, kept on the layer for decode)
    if chosen is None:
        kernel = selector.select(bank, rows)
        chosen = (kernel, kernel.subset_exact(selector.backend))
        if rows < SORT_THRESHOLD:  # decode-sized: a few row counts
            layer.kernels[rows] = chosen
    kernel, exact_rows = chosen
    if not kernel.needs_host_slots:
        if bank.complete and bank.cache.recorder is None:  # (a recorder gets every call's ids)
            if kernel.runs_switch_glu:  # stock's code: the layer's later calls go straight to it
                bank.stock_call = bank.complete_call()
            return StockGraph(layer, x, indices, kernel)
        if step is not None and bank.slots > 0:
            return Verified(layer, x, indices, kernel, step)
    if bank.direct:
        least = bank.cache.tuning.phase_min_bytes  # (``CacheTuning.phase_min_bytes``)
        if rows >= SORT_THRESHOLD:
            cls = PrefillAsTheyLand if exact_rows else PrefillWaves
        elif (
            # read a projection at a time: big experts, a kernel that runs the layer's own stock
            # ``SwitchGLU`` code, where a call over some rows gives those rows' stock bits
            exact_rows
            and least is not None
            and bank.layer.expert_nbytes >= least
            and kernel.runs_switch_glu
            and mlx_shims.is_stock_switch_glu(bank.glu)
        ):
            cls = ByProjection
        else:
            cls = AsTheyLand
        return cls(layer, x, indices, kernel, pad=not exact_rows)
    if min(rows, bank.num_experts) <= bank.slots:  # (a call's distinct experts: at most its rows)
        return OneCall(layer, x, indices, kernel)
    return Waves(layer, x, indices, kernel)


def names() -> set:
    """The names of every schedule class ``choose`` may return (each subclass of ``Schedule`` that
    is not ``abstract``)."""
    found, todo = set(), [Schedule]
    while todo:
        cls = todo.pop()
        for sub in cls.__subclasses__():
            todo.append(sub)
            if not vars(sub).get("abstract", False):
                found.add(sub.__name__)
    return found
