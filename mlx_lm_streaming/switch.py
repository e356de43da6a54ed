"""StreamingSwitchGLU: drop-in for mlx-lm's ``SwitchGLU`` whose experts live on disk.

Same call, ``(x, indices) -> y``, so mlx-lm's routers, shared experts and mixing run unchanged. Per call:
one host sync to read the router's expert ids, then all host work for the layer at once: make the
experts resident in the layer's slot bank, map expert ids to slot ids, and hand both to the kernel the
selector picks. The host sync also evaluates the next MoE layer's router applied to this layer's input
(lookahead): its predicted experts are read in the background while this layer computes (``prefetch``).

Six execution paths, each kept for a measured gain (its docstring says which; docs/design.md lists
them): a complete bank skips the host sync (``_stock_graph``); with direct reads, each read expert's
rows are computed as it lands (``_as_they_land``), big experts a projection at a time
(``_by_projection``), prefill-sized calls a wave's read experts in one call; without direct reads, one
load and one kernel call (``_in_one_call``), or waves when a call needs more experts than the bank has
slots (``_waves``). Every (token, expert) row is computed exactly once, by the same kernel, so each
path gives stock's bits.
"""

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from . import mlx_compat
from .bank_io import install_finished
from .mlx_compat import SORT_THRESHOLD
from .prefetch import LOOKAHEAD, WAVE, predict


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
        cache = bank.cache
        cache.ensure_planned()
        if bank.complete and cache.tuning.skip_sync:
            y = self._stock_graph(x, indices)
            if y is not None:
                return y
        step = cache.steps.current() if cache.steps is not None else None
        if step is not None:
            y = self._verified(x, indices, step)
            if y is not None:
                return y
        cache.note_caller()
        tl = cache.timeline
        start = tl.now() if tl else 0
        misses = cache.stats.misses
        indices = mx.stop_gradient(indices)
        ahead = self._lookahead(x, indices)
        if ahead is not None:
            mx.eval(indices, *[g for _, g in ahead])  # one sync for the ids and the guesses
        idx = np.array(indices, copy=False).astype(np.int64)  # the one host sync
        if tl:
            tl.span("host sync", start, "sync", layer=bank.path)
        if cache.recorder is not None:
            cache.recorder.record(bank, idx)
        experts = np.unique(idx)
        try:
            with bank.lock:
                if bank.direct:
                    y = self._as_they_land(x, idx, experts, ahead)
                    # submitted before the lock is let go: a later call's host sync on this stream
                    # then waits for it, so no pending work reads a slot that call rewrites
                    _submit(bank, y)
                    bank.last_stream = mx.default_stream(mx.default_device())
                    return y
                if len(experts) <= bank.slots:
                    return self._in_one_call(x, indices, idx, experts, ahead)
            return self._waves(x, idx, experts, ahead)
        finally:
            bank.drop_staged()
            if tl:
                tokens, read = idx.size // idx.shape[-1], cache.stats.misses - misses
                tl.layer(start, bank.path, tokens, experts=len(experts), misses=read)

    def _stock_graph(self, x, indices):
        """Every expert in its own slot (a complete identity bank): expert ids are slot ids, so the
        router's indices go straight to the kernel, with no host sync: stock's graph, and mlx-lm's
        ``async_eval`` pipelining kept. None where the kernel needs the ids on the host.
        Measured: H200 warm 1.30x stock, 0.84x with the host sync (``warm_sync``); CPU: noise."""
        kernel = self._selector.select(self._bank, indices.size)
        if kernel.needs_host_slots:
            return None
        return kernel(x, indices, None, self._bank)

    def _verified(self, x, indices, step):
        """In a verified step (``verified_step.py``): the router's ids mapped to slot ids on the
        device, with no host sync, and the count of the call's missing experts handed to the step,
        which checks every layer's at once after the forward. None where the kernel needs the ids on
        the host or reads into this bank are still in flight."""
        bank = self._bank
        if bank.slots == 0:
            return None
        kernel = self._selector.select(bank, indices.size)
        if kernel.needs_host_slots:
            return None
        indices = mx.stop_gradient(indices)
        with bank.lock:
            if bank.identity and bank.staged:
                # the fill's reads that landed: into slots no resident expert has, which no pending
                # work reads but for rows a miss makes wrong anyway (dropped at the check)
                install_finished(bank)
                bank.complete = bool((bank.slot_of >= 0).all())
            slots, missing = bank.device_map()
            y = kernel(x, slots[indices], None, bank)
        step.add(bank, indices, missing[indices].sum())
        bank.last_stream = mx.default_stream(mx.default_device())
        return y

    def _in_one_call(self, x, indices, idx, experts, ahead):
        """Without direct reads (no host view of the bank, or several calling threads): load the
        call's experts (through staging buffers), then one kernel call over all rows.
        Measured (staged reads, the GPU default before 2026-12-01): H200 Qwen3-shape cold 11.20
        tok/s, ``seed_stack`` 8.12."""
        bank = self._bank
        bank.load(experts)
        if ahead is not None:
            _stage_all(ahead)
        if bank.identity and not bank.complete:
            bank.cache.request_fill(bank)
        kernel = self._selector.select(bank, idx.size)
        if bank.identity:
            return kernel(x, indices, idx, bank)
        slots_np = bank.slot_of[idx]
        slots = mx.array(slots_np.astype(np.uint32))
        return kernel(x, slots, slots_np, bank)

    def _rows(self, x, idx, rows):
        """The kernel over the (token, expert) rows ``rows`` of the flattened call, ``(n, D)``.

        Where the kernel's per-row results depend on how many rows it is given (``subset_exact``),
        the rows are padded to the whole call's count with copies of the first one (dropped after),
        so that every partial call has stock's shapes."""
        bank = self._bank
        k = idx.shape[-1]
        flat = idx.reshape(-1)
        n = rows.size
        kernel = self._selector.select(bank, flat.size)
        if n < flat.size and not kernel.subset_exact(self._selector.backend):
            rows = np.concatenate([rows, np.full(flat.size - n, rows[0], dtype=rows.dtype)])
        else:
            kernel = self._selector.select(bank, n)
        slots_np = bank.slot_of[flat[rows]][:, None]
        slots = mx.array(slots_np.astype(np.uint32))
        xw = x.reshape(-1, x.shape[-1])[mx.array(rows // k)]
        y = kernel(xw, slots, slots_np, bank)[:, 0]
        return y if rows.size == n else y[:n]

    def _as_they_land(self, x, idx, experts, ahead):
        """Direct reads (``LayerBank.direct``): the resident experts' rows first, then each read
        expert's rows as soon as its bytes land, while the others are still read. With more
        experts than slots, waves of at most half the slots, so that a wave's reads go into the
        other half while the wave before computes. Prefill-sized calls (``SORT_THRESHOLD`` rows and
        more) where partial calls are padded (each then costs as much as the whole call) compute a
        wave's read experts in one call once they landed; where they are exact (MLX's CPU backend),
        as they land, which keeps fewer and smaller temporaries (a call per wave there measured +5
        points of peak RSS, 0.17 against 0.12 over the budget). Each row is computed once, by the same kernel.
        Measured: cold decode 1.08-1.23x staged reads on the H200, 1.18-1.45x on the CPU (noise 1.06).
        Measured (a call per wave): H200 Qwen3-shape cold prefill 0.76 of its limit, 0.31 per landing."""
        bank = self._bank
        flat = idx.reshape(-1)
        rows_done, outs = [], []

        def compute(ids):
            rows = np.nonzero(_member(flat, ids, bank.num_experts))[0]
            y = self._rows(x, idx, rows)
            _submit(bank, y)
            rows_done.append(rows)
            outs.append(y)

        landed = []
        part_ready = None
        if flat.size >= SORT_THRESHOLD and self._padded(flat.size):
            ready = landed.extend
        elif flat.size < SORT_THRESHOLD and self._phased(flat.size):
            ready, part_ready = self._by_projection(x, idx, compute, rows_done, outs)
        elif flat.size < SORT_THRESHOLD:
            ready = compute  # the experts that landed together, in one call
        else:
            # prefill-sized: each read expert alone (fewer and smaller temporaries: peak RSS)
            def ready(ids):
                for e in ids:
                    compute(np.array([e]))

        def rest():
            if landed:
                compute(np.array(landed))
                landed.clear()

        if len(experts) <= bank.slots:
            waves, overlap = [experts], False
        else:
            # resident experts first (no read), then those read in the background (installed with
            # the first wave, before any of this call's work is pending), then the rest
            resident = bank.slot_of[experts] >= 0
            staged = np.array([e in bank.staged for e in experts.tolist()], dtype=bool) & ~resident
            ordered = np.concatenate(
                [experts[resident], experts[staged], experts[~resident & ~staged]]
            )
            size = max(1, bank.slots // 2)
            overlap = 2 * size <= bank.slots  # room for a wave next to the one computing
            waves = [ordered[i : i + size] for i in range(0, len(ordered), size)]
        ends = []  # len(outs) after each wave
        for w, wave in enumerate(waves):
            # the wave whose slots this one may take has finished computing
            back = w - 2 if overlap else w - 1
            if back >= 0:
                _wait(bank, outs[: ends[back]])
            keep = np.concatenate([waves[w - 1], wave]) if overlap and w > 0 else wave
            if w == 0:
                self._take_staged(wave, keep)
            elif bank.staged:
                # installing them now (an MLX update of a bank that pending work reads) would
                # copy the whole bank: read them again directly instead
                bank._drop_staged()
            hit = wave[bank.slot_of[wave] >= 0]
            started = None
            if len(hit):
                started = lambda hit=hit: compute(hit)  # noqa: E731 (while they are read)
            bank.load(wave, ready=ready, keep=keep, part_ready=part_ready, started=started)
            rest()
            ends.append(len(outs))
        if ahead is not None:
            _stage_all(ahead)
        if bank.identity and not bank.complete:
            bank.cache.request_fill(bank)
        if len(outs) == 1 and len(rows_done[0]) == flat.size:
            y = outs[0]  # every row, in order
        else:
            order = np.argsort(np.concatenate(rows_done), kind="stable")
            y = mx.concatenate(outs, axis=0)[mx.array(order)]
        return y.reshape(*idx.shape, y.shape[-1])

    def _padded(self, rows: int) -> bool:
        """Whether partial calls of a call of ``rows`` rows are padded to all its rows (GPUs)."""
        kernel = self._selector.select(self._bank, rows)
        return not kernel.subset_exact(self._selector.backend)

    def _phased(self, rows: int) -> bool:
        """Whether this decode-sized call's direct reads go a projection at a time
        (``_by_projection``): experts of ``CacheTuning.phase_min_bytes`` and more, a kernel that runs
        the layer's own stock ``SwitchGLU`` code, on a backend where a call over some rows gives those
        rows' stock bits (partial calls not padded)."""
        bank = self._bank
        least = bank.cache.tuning.phase_min_bytes
        if least is None or bank.layer.expert_nbytes < least:
            return False
        kernel = self._selector.select(bank, rows)
        return (
            kernel.runs_switch_glu
            and kernel.subset_exact(self._selector.backend)
            and mlx_compat.is_stock_switch_glu(bank.glu)
        )

    def _by_projection(self, x, idx, compute, rows_done, outs):
        """``(ready, part_ready)`` for ``LayerBank.load``: as an expert's gate and up projections
        land, their rows of this call are computed (``async_eval``); when its down projection lands,
        the rest. The ops are those of mlx-lm's ``SwitchGLU.__call__`` below ``SORT_THRESHOLD``
        indices (``mlx_compat.switch_glu_*``), over the same rows and slots as ``_rows`` would give
        it, so the result is the same bits.
        Measured: CPU Mixtral-shape cold 1.14 of its limit vs 1.07 whole (noise 1.06; before: 1.07, 0.89)."""
        bank = self._bank
        glu = bank.glu
        k = idx.shape[-1]
        flat = idx.reshape(-1)
        x2 = x.reshape(-1, x.shape[-1])
        partial = {}  # expert -> (rows, slots, input rows, {proj: output})

        def part_ready(e, slot, proj):
            if e not in partial:
                rows = np.nonzero(flat == e)[0]
                slots = mx.array(np.full((len(rows), 1), slot, dtype=np.uint32))
                xe = mlx_compat.switch_glu_input(x2[mx.array(rows // k)])
                partial[e] = (rows, slots, xe, {})
            _, slots, xe, done = partial[e]
            done[proj] = mlx_compat.switch_glu_projection(glu, proj, xe, slots)
            _submit(bank, done[proj])

        def ready(ids):
            for e in ids:
                if e not in partial:  # installed from staging: no projection landed on its own
                    compute(np.array([e]))
                    continue
                rows, slots, _, done = partial.pop(e)
                up, gate = done["up_proj"], done["gate_proj"]
                y = mlx_compat.switch_glu_output(glu, up, gate, slots)[:, 0]
                _submit(bank, y)
                rows_done.append(rows)
                outs.append(y)

        return ready, part_ready

    def _take_staged(self, experts, keep):
        """Before any of this call's work is pending: write the experts read in the background into
        their slots (an MLX update, which would copy a bank that pending work reads)."""
        bank = self._bank
        if bank.identity and bank.staged:
            install_finished(bank)
        staged = [e for e in experts.tolist() if e in bank.staged]
        if staged:
            # counted once, as misses, by the call's own load of ``experts`` (not as a miss here
            # and a hit there), and one call to the policy
            bank.load(np.array(staged, dtype=np.int64), keep=keep, guessed=True)

    def _lookahead(self, x, indices):
        """((next MoE layer's bank, its predicted expert ids, lazy),), from its router applied to
        this layer's input, or None."""
        cache = self._bank.cache
        if not cache.tuning.lookahead:
            return None
        nxt = cache.next_bank(self._bank)
        # identity banks are filled in the background instead
        if nxt is None or nxt.identity or nxt.router is None or nxt.slots == 0:
            return None
        guess = predict(nxt.router, x, indices.shape[-1])
        return None if guess is None else ((nxt, guess),)

    def _waves(self, x, idx, experts, ahead):
        """Without direct reads, a call that needs more experts than the bank has slots (prefill
        with a small budget): waves of ``slots`` experts, each loaded (never evicting one the wave
        uses), computed and evaluated before the next, whose experts are read in the background
        meanwhile. Expert-major: each expert is read at most once per call.
        Measured: CPU Qwen3-shape cold prefill 0.90 of its limit (256 tokens, before direct reads)."""
        bank = self._bank
        flat = idx.reshape(-1)
        size = bank.slots
        waves = [experts[i : i + size] for i in range(0, len(experts), size)]
        outs, rows_done = [], []
        for w, wave in enumerate(waves):
            rows = np.nonzero(_member(flat, wave, bank.num_experts))[0]
            with bank.lock:
                bank.load(wave)
                # read ahead while this wave computes: the next wave, or after the last one the
                # next layer's guess
                if w + 1 < len(waves):
                    bank.stage(waves[w + 1], "wave", WAVE, fit=True)
                elif ahead is not None:
                    _stage_all(ahead)
                yw = self._rows(x, idx, rows)
                # finish this wave before the next one reuses the slots
                _wait(bank, yw)
            outs.append(yw)
            rows_done.append(rows)
        order = np.argsort(np.concatenate(rows_done), kind="stable")
        y = mx.concatenate(outs, axis=0)[mx.array(order)]
        return y.reshape(*idx.shape, y.shape[-1])


def _member(ids: np.ndarray, of: np.ndarray, num_experts: int) -> np.ndarray:
    """``np.isin(ids, of)`` for expert ids, by a mask over the experts: ~10x faster on the few
    ids of a decode call (numpy's ``isin`` sorts)."""
    mask = np.zeros(num_experts, dtype=bool)
    mask[of] = True
    return mask[ids]


def _timed(bank, run, y, name: str, cat: str) -> None:
    """``run(y)``, recorded on the timeline as ``name`` if there is one."""
    tl = bank.cache.timeline
    start = tl.now() if tl else 0
    run(y)
    if tl:
        tl.span(name, start, cat, layer=bank.path)


def _submit(bank, y) -> None:
    """``mx.async_eval(y)``: the layer's compute handed to MLX."""
    _timed(bank, mx.async_eval, y, "submit", "compute")


def _wait(bank, y) -> None:
    """``mx.eval(y)`` where the layer waits for its own compute."""
    _timed(bank, mx.eval, y, "wait compute", "wait")


def _stage_all(ahead) -> None:
    """``_stage_ahead`` for each (bank, guess) of a lookahead, nearest layer first."""
    for bank, guess in ahead:
        _stage_ahead(bank, guess)


def _stage_ahead(bank, guess) -> None:
    """Read the experts the next layer is predicted to miss (most wanted first), if its recent
    guesses were good enough; score the guess either way."""
    ids, counts = np.unique(np.array(guess, copy=False), return_counts=True)
    if len(ids) > bank.slots:
        # more than fit at once (prefill): the lowest ids, which the first wave takes
        ids = ids[: bank.slots]
    else:
        ids = ids[np.argsort(-counts, kind="stable")]
    with bank.lock:
        ids = [e for e in ids.tolist() if bank.slot_of[e] < 0 and e not in bank.staged]
        bank.predicted = set(ids)
        good = bank.ahead_precision >= bank.cache.tuning.lookahead_min_precision
    if not ids or not good:
        return
    bank.stage(np.array(ids), "lookahead", LOOKAHEAD, fit=True)
