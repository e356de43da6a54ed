"""The schedules of one MoE layer call, and ``choose``, the one place that picks among them.

A ``StreamingSwitchGLU`` call is ``with choose(layer, x, indices) as schedule: return
schedule.run()``. Each schedule below is one way of computing the call's (token, expert) rows; each
computes every row exactly once, by the same kernel, over the same slot bank, so each gives stock's
bits. Each is kept for a measured reason (docs/benchmarks/README.md; docs/design.md's table lists
them, with the figures).

``choose`` takes, in order: ``StockGraph`` (a complete identity bank), ``Verified`` (inside a
verified step); otherwise the layer's one host sync reads the router's ids (with the next layer's
lookahead guess), and under the bank's lock: with direct reads ``PrefillWaves``, ``ByProjection``,
``AsTheyLand`` or ``PrefillAsTheyLand`` by the call's size and the experts' size; without,
``OneCall`` where the call's experts fit the slots, else ``Waves``.
"""

import mlx.core as mx
import numpy as np

from . import mlx_compat
from .bank_io import install_finished
from .mlx_compat import SORT_THRESHOLD
from . import lookahead
from .prefetch import WAVE


def choose(layer, x: mx.array, indices: mx.array) -> "Schedule":
    """The schedule of ``layer``'s call on ``x`` with the router's ``indices``: the whole dispatch
    condition. A per-layer schedule comes back after the call's host sync, holding the bank's lock
    where it runs under it (its ``with`` block lets it go)."""
    bank = layer.bank
    cache = bank.cache
    cache.ensure_planned()
    kernel = layer.selector.select(bank, indices.size)
    if bank.complete and cache.tuning.skip_sync and not kernel.needs_host_slots:
        return StockGraph(layer, x, indices, kernel)
    step = cache.steps.current() if cache.steps is not None else None
    if step is not None and bank.slots > 0 and not kernel.needs_host_slots:
        return Verified(layer, x, indices, kernel, step)
    call = HostSync(layer, x, indices)
    rows = call.idx.size
    bank.lock.acquire()
    try:
        if bank.direct:
            if rows >= SORT_THRESHOLD and padded(layer, rows):
                return PrefillWaves(call)
            if rows >= SORT_THRESHOLD:
                return PrefillAsTheyLand(call)
            if phased(layer, rows):
                return ByProjection(call)
            return AsTheyLand(call)
        if len(call.experts) <= bank.slots:
            return OneCall(call)
    except BaseException:
        bank.lock.release()
        raise
    bank.lock.release()
    return Waves(call)


def padded(layer, rows: int) -> bool:
    """Whether partial calls of a call of ``rows`` rows are padded to all its rows (GPUs: the
    kernel's per-row bits depend on the row count)."""
    kernel = layer.selector.select(layer.bank, rows)
    return not kernel.subset_exact(layer.selector.backend)


def phased(layer, rows: int) -> bool:
    """Whether a decode-sized call's direct reads go a projection at a time (``ByProjection``):
    experts of ``CacheTuning.phase_min_bytes`` and more, a kernel that runs the layer's own stock
    ``SwitchGLU`` code, on a backend where a call over some rows gives those rows' stock bits
    (partial calls not padded)."""
    bank = layer.bank
    least = bank.cache.tuning.phase_min_bytes
    if least is None or bank.layer.expert_nbytes < least:
        return False
    kernel = layer.selector.select(bank, rows)
    return (
        kernel.runs_switch_glu
        and kernel.subset_exact(layer.selector.backend)
        and mlx_compat.is_stock_switch_glu(bank.glu)
    )


class Schedule:
    """One layer call's way of computing its rows: ``run()`` gives the layer's output, inside a
    ``with`` block (per-layer schedules finish the call's bookkeeping on leaving it). ``abstract``:
    a base of schedules, never chosen itself."""

    abstract = True

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> bool:
        return False

    def run(self) -> mx.array:
        raise NotImplementedError


class StockGraph(Schedule):
    """Chosen for a complete identity bank (every expert in its own slot) with a kernel that takes
    the ids on the device: expert ids are slot ids, so the router's indices go straight to the
    kernel, with no host sync: stock's graph, and mlx-lm's ``async_eval`` pipelining kept.
    Measured faster than the same call with the host sync on the GPU (``warm_sync``); on the CPU
    within noise."""

    def __init__(self, layer, x, indices, kernel):
        self.layer, self.x, self.indices, self.kernel = layer, x, indices, kernel

    def run(self):
        return self.kernel(self.x, self.indices, None, self.layer.bank)


class Verified(Schedule):
    """Chosen inside a verified step (``verified_step.py``: decode-sized calls while recent tokens
    missed in few layers), for a bank with slots and a kernel that takes the ids on the device: the
    router's ids mapped to slot ids on the device, with no host sync, and the bank's device map of
    missing experts handed to the step, which counts every layer's misses at once after the
    forward.
    Measured: the per-layer host sync costs more than the layer on a GPU."""

    def __init__(self, layer, x, indices, kernel, step):
        self.layer, self.x, self.indices, self.kernel, self.step = layer, x, indices, kernel, step

    def run(self):
        bank = self.layer.bank
        tl = bank.cache.timeline
        start = tl.now() if tl else 0
        indices = mx.stop_gradient(self.indices)
        with bank.lock:
            if bank.identity and bank.staged:
                # the fill's reads that landed: into slots no resident expert has, which no pending
                # work reads but for rows a miss makes wrong anyway (dropped at the check)
                install_finished(bank)
                bank.note_complete()
            slots, missing = bank.device_map()
            y = self.kernel(self.x, slots[indices], None, bank)
        self.step.add(bank, indices, missing)
        bank.last_stream = mx.default_stream(mx.default_device())
        if tl:  # its ids are not on the host: its experts and misses are the step's to count
            tl.layer(start, bank.path, indices.size // indices.shape[-1], verified=True)
        return y


class HostSync:
    """The layer's one host sync, which the per-layer schedules start from: the router's ids read
    back (``idx``, with the next MoE layer's lookahead guess evaluated in the same sync:
    ``ahead``), recorded, and the call's distinct ``experts``."""

    def __init__(self, layer, x, indices):
        bank = layer.bank
        cache = bank.cache
        cache.note_caller()
        self.layer, self.bank, self.x = layer, bank, x
        tl = cache.timeline
        self.start = tl.now() if tl else 0
        self.misses = cache.stats.misses
        self.indices = indices = mx.stop_gradient(indices)
        self.ahead = ahead = lookahead.guess(bank, x, indices)
        if ahead is not None:
            mx.eval(indices, *[g for _, g in ahead])  # one sync for the ids and the guesses
        self.idx = np.array(indices, copy=False).astype(np.int64)  # the one host sync
        if tl:
            tl.span("host sync", self.start, "sync", layer=bank.path)
        if cache.recorder is not None:
            cache.recorder.record(bank, self.idx)
        self.experts = np.unique(self.idx)


class PerLayer(Schedule):
    """A schedule after the layer's host sync (``HostSync``): the call's experts made resident on
    the host's word. ``locked``: run under the bank's lock, which ``choose`` took to choose it."""

    abstract = True
    locked = True

    def __init__(self, call: HostSync):
        self.call = call
        self.layer, self.bank, self.x = call.layer, call.bank, call.x
        self.idx, self.experts, self.ahead = call.idx, call.experts, call.ahead

    def __exit__(self, *exc) -> bool:
        call, bank = self.call, self.bank
        if self.locked:
            bank.lock.release()
        bank.drop_staged()
        tl = bank.cache.timeline
        if tl:
            idx = self.idx
            tokens, read = idx.size // idx.shape[-1], bank.cache.stats.misses - call.misses
            tl.layer(call.start, bank.path, tokens, experts=len(self.experts), misses=read)
        return False

    def rows(self, rows):
        """The kernel over the (token, expert) rows ``rows`` of the flattened call, ``(n, D)``.

        Where the kernel's per-row results depend on how many rows it is given (``subset_exact``),
        the rows are padded to the whole call's count with copies of the first one (dropped after),
        so that every partial call has stock's shapes."""
        return kernel_rows(self.layer, self.x, self.idx, rows)


class OneCall(PerLayer):
    """Chosen without direct reads (no host view of the bank, a second calling thread, or
    ``direct_reads`` off) when the call's experts fit the bank's slots: load them (through staging
    buffers), then one kernel call over all rows. Measured faster than the seed designs
    (docs/benchmarks/README.md, "What won, what lost")."""

    def run(self):
        bank, idx = self.bank, self.idx
        bank.load(self.experts)
        if self.ahead is not None:
            lookahead.stage_all(self.ahead)
        if bank.identity and not bank.complete:
            bank.cache.request_fill(bank)
        kernel = self.layer.selector.select(bank, idx.size)
        if bank.identity:
            return kernel(self.x, self.call.indices, idx, bank)
        slots_np = bank.slot_of[idx]
        slots = mx.array(slots_np.astype(np.uint32))
        return kernel(self.x, slots, slots_np, bank)


class Waves(PerLayer):
    """Chosen without direct reads when the call needs more experts than the bank has slots
    (prefill with a small budget): waves of ``slots`` experts, each loaded (never evicting one the
    wave uses), computed and evaluated before the next, whose experts are read in the background
    meanwhile. Expert-major: each expert is read at most once per call. Runs outside the bank's
    lock but for each wave. Measured: CPU cold prefill near its I/O limit."""

    locked = False

    def run(self):
        bank, idx, experts = self.bank, self.idx, self.experts
        flat = idx.reshape(-1)
        size = bank.slots
        waves = [experts[i : i + size] for i in range(0, len(experts), size)]
        outs, rows_done = [], []
        for w, wave in enumerate(waves):
            rows = np.nonzero(member(flat, wave, bank.num_experts))[0]
            with bank.lock:
                bank.load(wave)
                # read ahead while this wave computes: the next wave, or after the last one the
                # next layer's guess
                if w + 1 < len(waves):
                    bank.stage(waves[w + 1], "wave", WAVE, fit=True)
                elif self.ahead is not None:
                    lookahead.stage_all(self.ahead)
                yw = self.rows(rows)
                # finish this wave before the next one reuses the slots
                wait(bank, yw)
            outs.append(yw)
            rows_done.append(rows)
        order = np.argsort(np.concatenate(rows_done), kind="stable")
        y = mx.concatenate(outs, axis=0)[mx.array(order)]
        return y.reshape(*idx.shape, y.shape[-1])


class Direct(PerLayer):
    """Direct reads (``LayerBank.direct``): the call's reads issued, the resident experts' rows
    submitted while they are read, then the read experts' rows as ``landing`` says. With more
    experts than slots, waves of at most half the slots, so that a wave's reads go into the other
    half while the wave before computes. The subclasses differ only in ``landing``."""

    abstract = True

    def landing(self, compute, landed, rows_done, outs):
        """``(ready, part_ready)`` for ``LayerBank.load``: what is done as read experts land."""
        raise NotImplementedError

    def run(self):
        bank, x, idx, experts = self.bank, self.x, self.idx, self.experts
        flat = idx.reshape(-1)
        rows_done, outs = [], []

        def compute(ids):
            rows = np.nonzero(member(flat, ids, bank.num_experts))[0]
            y = self.rows(rows)
            submit(bank, y)
            rows_done.append(rows)
            outs.append(y)

        landed = []  # read experts whose rows wait for the end of their wave (``PrefillWaves``)
        ready, part_ready = self.landing(compute, landed, rows_done, outs)

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
                wait(bank, outs[: ends[back]])
            keep = np.concatenate([waves[w - 1], wave]) if overlap and w > 0 else wave
            if w == 0:
                take_staged(bank, wave, keep)
            elif bank.staged:
                # installing them now (an MLX update of a bank that pending work reads) would
                # copy the whole bank: read them again directly instead
                bank.discard_staged()
            hit = wave[bank.slot_of[wave] >= 0]
            started = None
            if len(hit):
                started = lambda hit=hit: compute(hit)  # noqa: E731 (while they are read)
            bank.load(wave, ready=ready, keep=keep, part_ready=part_ready, started=started)
            rest()
            ends.append(len(outs))
        if self.ahead is not None:
            lookahead.stage_all(self.ahead)
        if bank.identity and not bank.complete:
            bank.cache.request_fill(bank)
        if len(outs) == 1 and len(rows_done[0]) == flat.size:
            y = outs[0]  # every row, in order
        else:
            order = np.argsort(np.concatenate(rows_done), kind="stable")
            y = mx.concatenate(outs, axis=0)[mx.array(order)]
        y = y.reshape(*idx.shape, y.shape[-1])
        # submitted before the lock is let go: a later call's host sync on this stream then waits
        # for it, so no pending work reads a slot that call rewrites
        submit(bank, y)
        bank.last_stream = mx.default_stream(mx.default_device())
        return y


class AsTheyLand(Direct):
    """Chosen with direct reads for decode-sized calls (fewer than ``SORT_THRESHOLD`` rows): each
    read expert's rows computed as soon as its bytes land, while the others are still read.
    Measured: cold decode faster than staged reads on the H200 and the CPU."""

    def landing(self, compute, landed, rows_done, outs):
        return compute, None  # those reported together (installed from staging) in one call


class ByProjection(Direct):
    """Chosen instead of ``AsTheyLand`` for big experts (``CacheTuning.phase_min_bytes`` and more)
    where partial calls are exact and the kernel runs the layer's stock ``SwitchGLU`` code: as an
    expert's gate and up projections land, their rows of this call are computed (``async_eval``);
    when its down projection lands, the rest. The ops are those of mlx-lm's ``SwitchGLU.__call__``
    below ``SORT_THRESHOLD`` indices (``mlx_compat.switch_glu_*``), over the same rows and slots as
    ``rows`` would give it, so the result is the same bits. Measured: CPU Mixtral-shape cold
    decode closer to its I/O limit than experts read whole."""

    def landing(self, compute, landed, rows_done, outs):
        bank, idx = self.bank, self.idx
        glu = bank.glu
        k = idx.shape[-1]
        flat = idx.reshape(-1)
        x2 = self.x.reshape(-1, self.x.shape[-1])
        partial = {}  # expert -> (rows, slots, input rows, {proj: output})

        def part_ready(e, slot, proj):
            if e not in partial:
                rows = np.nonzero(flat == e)[0]
                slots = mx.array(np.full((len(rows), 1), slot, dtype=np.uint32))
                xe = mlx_compat.switch_glu_input(x2[mx.array(rows // k)])
                partial[e] = (rows, slots, xe, {})
            _, slots, xe, done = partial[e]
            done[proj] = mlx_compat.switch_glu_projection(glu, proj, xe, slots)
            submit(bank, done[proj])

        def ready(ids):
            for e in ids:
                if e not in partial:  # installed from staging: no projection landed on its own
                    compute(np.array([e]))
                    continue
                rows, slots, _, done = partial.pop(e)
                up, gate = done["up_proj"], done["gate_proj"]
                y = mlx_compat.switch_glu_output(glu, up, gate, slots)[:, 0]
                submit(bank, y)
                rows_done.append(rows)
                outs.append(y)

        return ready, part_ready


class PrefillAsTheyLand(Direct):
    """Chosen with direct reads for prefill-sized calls (``SORT_THRESHOLD`` rows and more) where
    partial calls are exact (MLX's CPU backend): each read expert's rows computed alone as it
    lands, which keeps fewer and smaller temporaries than a call per wave (measured: lower peak
    RSS over the budget on the CPU)."""

    def landing(self, compute, landed, rows_done, outs):
        def ready(ids):
            for e in ids:
                compute(np.array([e]))

        return ready, None


class PrefillWaves(Direct):
    """Chosen with direct reads for prefill-sized calls where partial calls are padded to the whole
    call's rows (GPUs: each partial call then costs as much as the whole one): a wave's read
    experts computed in one call once they all landed. Measured: H200 cold prefill much closer to
    its I/O limit than a call per landing."""

    def landing(self, compute, landed, rows_done, outs):
        return landed.extend, None


def kernel_rows(layer, x, idx, rows):
    """``PerLayer.rows``: the selected kernel over some rows of the call, padded where needed."""
    bank = layer.bank
    selector = layer.selector
    k = idx.shape[-1]
    flat = idx.reshape(-1)
    n = rows.size
    kernel = selector.select(bank, flat.size)
    if n < flat.size and not kernel.subset_exact(selector.backend):
        rows = np.concatenate([rows, np.full(flat.size - n, rows[0], dtype=rows.dtype)])
    else:
        kernel = selector.select(bank, n)
    slots_np = bank.slot_of[flat[rows]][:, None]
    slots = mx.array(slots_np.astype(np.uint32))
    xw = x.reshape(-1, x.shape[-1])[mx.array(rows // k)]
    y = kernel(xw, slots, slots_np, bank)[:, 0]
    return y if rows.size == n else y[:n]


def take_staged(bank, experts, keep) -> None:
    """Before any of this call's work is pending: write the experts read in the background into
    their slots (an MLX update, which would copy a bank that pending work reads)."""
    if bank.identity and bank.staged:
        install_finished(bank)
    staged = [e for e in experts.tolist() if e in bank.staged]
    if staged:
        # counted once, as misses, by the call's own load of ``experts`` (not as a miss here
        # and a hit there), and one call to the policy
        bank.load(np.array(staged, dtype=np.int64), keep=keep, guessed=True)


def member(ids: np.ndarray, of: np.ndarray, num_experts: int) -> np.ndarray:
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


def submit(bank, y) -> None:
    """``mx.async_eval(y)``: the layer's compute handed to MLX."""
    _timed(bank, mx.async_eval, y, "submit", "compute")


def wait(bank, y) -> None:
    """``mx.eval(y)`` where the layer waits for its own compute."""
    _timed(bank, mx.eval, y, "wait compute", "wait")


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
