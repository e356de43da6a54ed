"""What the schedules share: the ``Schedule`` base, the per-layer schedules' ``PerLayer`` (the
layer's one host sync, then its work), ``ExpertRows`` (the rows of a call, expert by expert, through
the bank's wave engine), and the kernel over some of a call's rows."""

import mlx.core as mx
import numpy as np

from ...bank import waves
from ...bank.waves import submit
from ...reads import lookahead


class Schedule:
    """One layer call's way of computing its rows: ``run()`` gives the layer's output. (A
    ``with`` block may hold it: entering and leaving it do nothing.) ``abstract``: a base of
    schedules, never chosen itself."""

    abstract = True

    def __init__(self, layer, x, indices, kernel, pad=None):
        self.layer, self.bank, self.x, self.indices = layer, layer.bank, x, indices
        # ``pad``: partial calls padded to the call's rows (the kernel's rows are not
        # ``subset_exact`` here; None: not known yet)
        self.kernel, self.pad = kernel, pad

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> bool:
        return False

    def run(self) -> mx.array:
        raise NotImplementedError


class PerLayer(Schedule):
    """A schedule that starts from the layer's one host sync: the call's experts made resident on
    the host's word. ``run`` is the call top to bottom: the sync (the router's ids and the next
    layer's guess), the call's work (``compute(ids, the call's distinct experts, the guess or
    None)``: under the bank's lock where ``locked``), the bookkeeping after it."""

    abstract = True
    locked = True

    def run(self):
        bank = self.bank
        cache = bank.cache
        tl = cache.timeline
        start = tl.now()
        misses = cache.stats.misses
        # the layer's one host sync: the router's ids read back, with the next MoE layer's
        # lookahead guess evaluated in the same sync, and recorded
        self.indices = indices = mx.stop_gradient(self.indices)
        ahead = lookahead.guess(bank, self.x, indices)
        if ahead is not None:
            mx.eval(indices, ahead[1])  # one sync for the ids and the guess
        idx = np.array(indices, copy=False).astype(np.int64)  # the one host sync
        tl.span("host sync", start, "sync", layer=bank.path)
        if cache.recorder is not None:
            cache.recorder.record(bank, idx)
        experts = np.unique(idx)
        try:
            if self.locked:
                with bank.lock:
                    return self.compute(idx, experts, ahead)
            return self.compute(idx, experts, ahead)
        finally:  # (also after an error)
            if bank.staged and not bank.identity:
                bank.drop_staged()  # staged experts the call did not use
            tokens, read = idx.size // idx.shape[-1], cache.stats.misses - misses
            tl.layer(start, bank.path, tokens, experts=len(experts), misses=read)

    def compute(self, idx, experts, ahead) -> mx.array:
        raise NotImplementedError


class ExpertRows(PerLayer):
    """A per-layer schedule that computes the call's rows expert by expert through the bank's wave
    engine (``bank.waves``): this object is the engine's ``work`` (``rows``, ``landed``, ``outs``,
    ``waiting``). ``compute`` is the call's work top to bottom: the engine (``direct`` with direct
    reads, the experts ordered; ``staged`` without), then the rows put back in the call's
    order."""

    abstract = True
    staged_reads = False  # True: without direct reads (``bank.waves.staged``)
    by_projection = False  # landings a projection at a time (``ByProjection``)

    def compute(self, idx, experts, ahead):
        bank = self.bank
        self.idx, self.flat = idx, idx.reshape(-1)
        self.outs, self.rows_done = outs, rows_done = [], []
        self.waiting = []  # landed experts whose rows wait for the end of their wave
        if self.staged_reads:
            waves.staged(bank, experts, self, ahead)
        else:
            if not (bank.identity and bank.staged) and bank.slot_of[experts].min() >= 0:
                # a hit, every expert resident (none of them staged: staged ones are not): the
                # use told to the policy and counted (nothing to read), then the call's rows in
                # one kernel call in stock's shape, as ``OneCall``'s (exact: docs/design.md), not
                # through the wave engine (an identity bank's landed fill: ``take_staged``)
                bank.reads(experts)
                slots_np = bank.slot_of[idx]
                slots = mx.array(slots_np.astype(np.uint32))
                if self.kernel.calls_only_glu:  # (its call: the layer's own code)
                    y = bank.glu_call(self.x, slots)
                else:
                    y = self.kernel(self.x, slots, slots_np, bank)
                outs.append(y)
                rows_done.append(None)
                mx.async_eval(y)  # (``submit``, spelt out)
            elif len(experts) > bank.slots:
                # resident experts first (no read), then those read in the background (installed
                # with the first wave, before any of this call's work is pending), then the rest
                resident = bank.slot_of[experts] >= 0
                staged = np.array([e in bank.staged for e in experts.tolist()], dtype=bool)
                staged &= ~resident
                experts = np.concatenate(
                    [experts[resident], experts[staged], experts[~resident & ~staged]]
                )
            if not outs:
                waves.direct(bank, experts, self, self.by_projection)
            if ahead is not None:
                lookahead.stage(*ahead)
            if bank.identity and not bank.complete:
                bank.cache.request_fill(bank)
            bank.last_stream = mx.default_stream(mx.default_device())
        # every row submitted before the lock is let go: a later call's host sync on this stream
        # then waits for it, so no pending work reads a slot that call rewrites
        if rows_done and rows_done[0] is None:  # (the hit above: the call's own shape)
            return outs[0]
        if len(outs) == 1 and len(rows_done[0]) == self.flat.size:
            y = outs[0]  # every row, in order: submitted already (``rows``)
            return y.reshape(*idx.shape, y.shape[-1])
        order = np.argsort(np.concatenate(rows_done), kind="stable")
        y = mx.concatenate(outs, axis=0)[mx.array(order)]
        y = y.reshape(*idx.shape, y.shape[-1])
        submit(bank, y)
        return y

    def rows(self, ids) -> None:
        """The rows of experts ``ids`` computed and submitted."""
        bank = self.bank
        mask = np.zeros(bank.num_experts, dtype=bool)
        mask[ids] = True
        rows = np.nonzero(mask[self.flat])[0]
        y = kernel_rows(self.layer, self.x, self.idx, rows, self.kernel, self.pad)
        tl = bank.cache.timeline
        start = tl.now()
        mx.async_eval(y)  # (``submit``, spelt out: once per landing)
        tl.span("submit", start, "compute", layer=bank.path)
        self.rows_done.append(rows)
        self.outs.append(y)

    def landed(self, ids, proj, slot) -> None:
        """Experts ``ids`` landed (``proj`` None; else a projection of one: ``ByProjection``):
        their rows computed now (or, in a subclass, at the end of the wave: ``waiting``)."""
        self.rows(ids)


def kernel_rows(layer, x, idx, rows, kernel=None, pad=None):
    """The call's kernel (``kernel``; None: the selector's for the call) over the (token, expert)
    rows ``rows`` of the flattened call ``idx``, ``(n, D)``.

    Where the kernel's per-row results depend on how many rows it is given (``pad``; None: the
    kernel's ``subset_exact`` says), the rows are padded to the whole call's count with copies of
    the first one (dropped after), so that every partial call has stock's shapes."""
    bank = layer.bank
    k = idx.shape[-1]
    flat = idx.reshape(-1)
    n = rows.size
    if kernel is None:
        kernel = layer.selector.select(bank, flat.size)
    if n < flat.size and (
        pad if pad is not None else not kernel.subset_exact(layer.selector.backend)
    ):
        rows = np.concatenate([rows, np.full(flat.size - n, rows[0], dtype=rows.dtype)])
    slots_np = bank.slot_of[flat[rows]][:, None]
    slots = mx.array(slots_np.astype(np.uint32))
    xw = x.reshape(-1, x.shape[-1])[mx.array(rows // k)]
    y = kernel(xw, slots, slots_np, bank)[:, 0]
    return y if rows.size == n else y[:n]


def member(ids: np.ndarray, of: np.ndarray, num_experts: int) -> np.ndarray:
    """``np.isin(ids, of)`` for expert ids, by a mask over the experts: ~10x faster on the few
    ids of a decode call (numpy's ``isin`` sorts)."""
    mask = np.zeros(num_experts, dtype=bool)
    mask[of] = True
    return mask[ids]
