"""The schedules of one MoE layer call, and ``choose``, the one function that picks among them.

A MoE layer call outside a verified step (``modes``: each layer on its own, layer-major prefill's
calls that routing did not foresee) is ``choose(layer, x, indices).run()``. ``choose`` is the whole
dispatch condition and does nothing else: no host sync, no lock, no read. It picks the kernel once
for the call (``kernel_of``), and a schedule class by the bank's state, the kernel and the call's
row count. Each schedule's ``run`` then does the call top to
bottom: the host sync, the reads issued, the hits submitted, the read experts taken as they land
(``LayerBank.reads``: a generator of landings, as ``concurrent.futures.as_completed``), the
compute. Each computes every (token, expert) row exactly once, by the call's kernel, over the same
slot bank, so each gives stock's bits. Each is kept for a measured reason
(docs/benchmarks/README.md; docs/design.md's table lists them, with the figures).

``choose`` takes, in order: ``StockGraph`` (a complete identity bank; where its kernel runs stock's
``SwitchGLU`` code, the layer's later calls skip ``choose``: ``LayerBank.stock_call``; with a
routing recorder, only a prompt's call over two tiers, its ids recorded after it); otherwise a
per-layer schedule (one host sync per call):
with direct reads ``PrefillWaves``, ``PrefillAsTheyLand``, ``ByProjection`` or ``AsTheyLand`` by
the call's size, the experts' size and the kernel; without, ``OneCall`` where the call's experts
surely fit the slots, else ``Waves``.

(A verified step's calls, with no host sync, are its own: ``verified_step.VerifiedStep.moe_call``.)
The schedules, by the host work they start from: ``sync_free.py`` (none), ``per_layer.py`` (the
layer's one host sync; staged reads without direct ones), ``direct.py`` (direct reads, taken as
they land); what they share, ``base.py``.
"""

import mlx.core as mx

from ... import mlx_shims
from ...bank import device_copy
from ...bank.waves import submit, wait
from ...mlx_compat import SORT_THRESHOLD
from .base import ExpertRows, PerLayer, Schedule, kernel_rows, member
from .direct import AsTheyLand, ByProjection, Direct, PrefillAsTheyLand, PrefillWaves
from .per_layer import OneCall, Waves
from .sync_free import StockGraph

__all__ = [
    "choose", "kernel_of", "names", "kernel_rows", "member", "submit", "wait", "Schedule",
    "PerLayer", "ExpertRows", "StockGraph", "OneCall", "Waves", "Direct", "AsTheyLand", "ByProjection",
    "PrefillAsTheyLand", "PrefillWaves",
]  # fmt: skip


def kernel_of(layer, rows: int) -> tuple:
    """``(kernel, whether its rows are subset_exact)``: the selector's kernel for ``layer``'s calls
    of ``rows`` rows, kept on the layer (``layer.kernels``) for decode-sized calls."""
    selector = layer.selector
    kernel = selector.select(layer.bank, rows)
    chosen = (kernel, kernel.subset_exact(selector.backend))
    if rows < SORT_THRESHOLD:  # decode-sized: a few row counts
        layer.kernels[rows] = chosen
    return chosen


def choose(layer, x: mx.array, indices: mx.array) -> "Schedule":
    """The schedule of ``layer``'s call on ``x`` with the router's ``indices``: the whole dispatch
    condition."""
    bank = layer.bank
    rows = indices.size
    # (the selector's choice, kept on the layer for decode)
    kernel, exact_rows = layer.kernels.get(rows) or kernel_of(layer, rows)
    if not kernel.needs_host_slots and bank.complete:
        cache = bank.cache
        if cache.recorder is None:  # (a recorder gets every call's ids)
            if kernel.runs_switch_glu:  # stock's code: the layer's later calls go straight to it
                bank.stock_call = bank.complete_call()
            return StockGraph(layer, x, indices, kernel)
        if cache.tiers is not None and device_copy.is_prompt(bank, indices):
            # a prompt's call over two tiers that a recorder wants: stock's graph over a device
            # copy all the same (run in place, over host pages, it took a 4K prompt 19x stock's),
            # its ids recorded once the copy's call was evaluated
            return StockGraph(layer, x, indices, kernel)
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
