"""What the schedules share: the ``Schedule`` base, the per-layer schedules' ``PerLayer`` (the
layer's one host sync, then its work), and the kernel over some of a call's rows."""

import mlx.core as mx
import numpy as np

from .. import lookahead


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


def submit(bank, y) -> None:
    """``mx.async_eval(y)``: the layer's compute handed to MLX (a timeline span if recorded)."""
    tl = bank.cache.timeline
    start = tl.now()
    mx.async_eval(y)
    tl.span("submit", start, "compute", layer=bank.path)


def wait(bank, y) -> None:
    """``mx.eval(y)`` where the layer waits for its own compute (a timeline span if recorded)."""
    tl = bank.cache.timeline
    start = tl.now()
    mx.eval(y)
    tl.span("wait compute", start, "wait", layer=bank.path)
