"""The schedules of one MoE layer call, and ``choose``, the one function that picks among them.

A ``StreamingSwitchGLU`` call is ``choose(layer, x, indices, step).run()``. ``choose`` is the whole
dispatch condition and does nothing else: no host sync, no lock, no read. It picks the kernel once
for the call, and a schedule class by the bank's state, the kernel, the call's row count and whether
the model call is a verified step (``step``). Each schedule's ``run`` then does the call top to
bottom: the host sync, the reads issued, the hits submitted, the read experts taken as they land
(``LayerBank.reads``: a generator of landings, as ``concurrent.futures.as_completed``), the
compute. Each computes every (token, expert) row exactly once, by the call's kernel, over the same
slot bank, so each gives stock's bits. Each is kept for a measured reason (docs/benchmarks/README.md;
docs/design.md's table lists them, with the figures).

``choose`` takes, in order: ``StockGraph`` (a complete identity bank), ``Verified`` (inside a
verified step); otherwise a per-layer schedule (one host sync per call): with direct reads
``PrefillWaves``, ``PrefillAsTheyLand``, ``ByProjection`` or ``AsTheyLand`` by the call's size, the
experts' size and the kernel; without, ``OneCall`` where the call's experts surely fit the slots,
else ``Waves``.
"""

import mlx.core as mx
import numpy as np

from . import lookahead, mlx_compat
from .mlx_compat import SORT_THRESHOLD
from .prefetch import WAVE


def choose(layer, x: mx.array, indices: mx.array, step=None) -> "Schedule":
    """The schedule of ``layer``'s call on ``x`` with the router's ``indices``, inside the verified
    step ``step`` (None: outside one): the whole dispatch condition."""
    bank = layer.bank
    selector = layer.selector
    rows = indices.size
    kernel = selector.select(bank, rows)
    if not kernel.needs_host_slots:
        if bank.complete and bank.cache.tuning.skip_sync:
            return StockGraph(layer, x, indices, kernel)
        if step is not None and bank.slots > 0:
            return Verified(layer, x, indices, kernel, step)
    if bank.direct:
        exact_rows = kernel.subset_exact(selector.backend)
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
            and mlx_compat.is_stock_switch_glu(bank.glu)
        ):
            cls = ByProjection
        else:
            cls = AsTheyLand
        return cls(layer, x, indices, kernel, pad=not exact_rows)
    if min(rows, bank.num_experts) <= bank.slots:  # (a call's distinct experts: at most its rows)
        return OneCall(layer, x, indices, kernel)
    return Waves(layer, x, indices, kernel)


class Schedule:
    """One layer call's way of computing its rows: ``run()`` gives the layer's output. (A
    ``with`` block may hold it: entering and leaving it do nothing.) ``abstract``: a base of
    schedules, never chosen itself."""

    abstract = True

    def __init__(self, layer, x, indices, kernel, step=None, pad=None):
        self.layer, self.bank, self.x, self.indices = layer, layer.bank, x, indices
        # ``pad``: partial calls padded to the call's rows (the kernel's rows are not
        # ``subset_exact`` here; None: not known yet)
        self.kernel, self.step, self.pad = kernel, step, pad

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

    def run(self):
        return self.kernel(self.x, self.indices, None, self.bank)


class Verified(Schedule):
    """Chosen inside a verified step (``verified_step.py``: decode-sized calls while recent tokens
    missed in few layers), for a bank with slots and a kernel that takes the ids on the device: the
    router's ids mapped to slot ids on the device, with no host sync, and the bank's device map of
    missing experts handed to the step, which counts every layer's misses at once after the
    forward.
    Measured: the per-layer host sync costs more than the layer on a GPU."""

    def run(self):
        bank = self.bank
        tl = bank.cache.timeline
        start = tl.now() if tl else 0
        indices = mx.stop_gradient(self.indices)
        with bank.lock:
            if bank.identity and bank.staged:
                # the fill's reads that landed: into slots no resident expert has, which no pending
                # work reads but for rows a miss makes wrong anyway (dropped at the check)
                bank.install_finished()
                bank.note_complete()
            slots, missing = bank.device_map()
            y = self.kernel(self.x, slots[indices], None, bank)
        self.step.add(bank, indices, missing)
        bank.last_stream = mx.default_stream(mx.default_device())
        if tl:  # its ids are not on the host: its experts and misses are the step's to count
            tl.layer(start, bank.path, indices.size // indices.shape[-1], verified=True)
        return y


class PerLayer(Schedule):
    """A schedule that starts from the layer's one host sync: the call's experts made resident on
    the host's word. ``run`` is the call top to bottom: the sync (``sync``), the call's work
    (``compute``: under the bank's lock where ``locked``), the bookkeeping after it."""

    abstract = True
    locked = True

    def run(self):
        bank = self.bank
        cache = bank.cache
        tl = cache.timeline
        start = tl.now() if tl else 0
        misses = cache.stats.misses
        idx, experts, ahead = self.sync()
        if self.locked:
            with bank.lock:
                y = self.compute(idx, experts, ahead)
        else:
            y = self.compute(idx, experts, ahead)
        if bank.staged and not bank.identity:
            bank.drop_staged()  # staged experts the call did not use
        if tl:
            tokens, read = idx.size // idx.shape[-1], cache.stats.misses - misses
            tl.layer(start, bank.path, tokens, experts=len(experts), misses=read)
        return y

    def sync(self):
        """The layer's one host sync: the router's ids read back, with the next MoE layer's
        lookahead guess evaluated in the same sync, and recorded. ``(ids, the call's distinct
        experts, the guess or None)``."""
        bank = self.bank
        cache = bank.cache
        tl = cache.timeline
        start = tl.now() if tl else 0
        self.indices = indices = mx.stop_gradient(self.indices)
        ahead = lookahead.guess(bank, self.x, indices)
        if ahead is not None:
            mx.eval(indices, ahead[1])  # one sync for the ids and the guess
        idx = np.array(indices, copy=False).astype(np.int64)  # the one host sync
        if tl:
            tl.span("host sync", start, "sync", layer=bank.path)
        if cache.recorder is not None:
            cache.recorder.record(bank, idx)
        return idx, np.unique(idx), ahead

    def compute(self, idx, experts, ahead) -> mx.array:
        raise NotImplementedError


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


class Waves(PerLayer):
    """Chosen without direct reads when the call's experts may not fit the bank's slots (prefill
    with a small budget): waves of ``slots`` experts, each loaded (never evicting one the wave
    uses), computed and evaluated before the next, whose experts are read in the background
    meanwhile. Expert-major: each expert is read at most once per call. Runs outside the bank's
    lock but for each wave. Measured: CPU cold prefill near its I/O limit."""

    locked = False

    def compute(self, idx, experts, ahead):
        bank = self.bank
        flat = idx.reshape(-1)
        size = bank.slots
        waves = [experts[i : i + size] for i in range(0, len(experts), size)]
        outs, rows_done = [], []
        for w, wave in enumerate(waves):
            rows = np.nonzero(member(flat, wave, bank.num_experts))[0]
            last = w + 1 == len(waves)
            with bank.lock:
                bank.load(wave)
                # read ahead while this wave computes: the next wave, or after the last one the
                # next layer's guess
                if not last:
                    bank.stage(waves[w + 1], "wave", WAVE, fit=True)
                elif ahead is not None:
                    lookahead.stage(*ahead)
                yw = kernel_rows(self.layer, self.x, idx, rows, self.kernel)
                if not last:
                    wait(bank, yw)  # finish this wave before the next one reuses the slots
            outs.append(yw)
            rows_done.append(rows)
        if len(outs) == 1:
            y = outs[0]  # every row, in order
        else:
            order = np.argsort(np.concatenate(rows_done), kind="stable")
            y = mx.concatenate(outs, axis=0)[mx.array(order)]
        return y.reshape(*idx.shape, y.shape[-1])


class Direct(PerLayer):
    """Direct reads (``LayerBank.direct``): per wave, the reads issued, the resident experts' rows
    submitted while they are read, then each landing taken as it comes (``landed``). With more
    experts than slots, waves of at most half the slots, so that a wave's reads go into the other
    half while the wave before computes. The subclasses differ in what they do with a landing."""

    abstract = True
    by_projection = False  # landings a projection at a time (``ByProjection``)

    def compute(self, idx, experts, ahead):
        bank = self.bank
        self.flat = flat = idx.reshape(-1)
        self.idx = idx
        self.outs, self.rows_done = [], []
        self.waiting = []  # landed experts whose rows wait for the end of their wave
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
                wait(bank, self.outs[: ends[back]])
            keep = np.concatenate([waves[w - 1], wave]) if overlap and w > 0 else wave
            if bank.staged:
                if w == 0:
                    take_staged(bank, wave, keep)
                else:
                    # installing them now (an MLX update of a bank that pending work reads) would
                    # copy the whole bank: read them again directly instead
                    bank.discard_staged()
            hit = wave[bank.slot_of[wave] >= 0]
            landings = bank.reads(wave, keep, by_projection=self.by_projection)  # issued
            try:
                if len(hit):
                    self.rows(hit)  # while they are read
                for ids, proj, slot in landings:
                    self.landed(ids, proj, slot)
            finally:
                landings.close()  # (after an error: every read has ended)
            if self.waiting:
                self.rows(np.array(self.waiting))
                self.waiting = []
            ends.append(len(self.outs))
        if ahead is not None:
            lookahead.stage(*ahead)
        if bank.identity and not bank.complete:
            bank.cache.request_fill(bank)
        outs, rows_done = self.outs, self.rows_done
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

    def rows(self, ids) -> None:
        """The rows of experts ``ids`` computed and submitted."""
        bank = self.bank
        mask = np.zeros(bank.num_experts, dtype=bool)
        mask[ids] = True
        rows = np.nonzero(mask[self.flat])[0]
        y = kernel_rows(self.layer, self.x, self.idx, rows, self.kernel, self.pad)
        submit(bank, y)
        self.rows_done.append(rows)
        self.outs.append(y)

    def landed(self, ids, proj, slot) -> None:
        """Experts ``ids`` landed (``proj`` None; else a projection of one: ``ByProjection``):
        their rows computed now, or (``waiting``) at the end of the wave."""
        self.rows(ids)


class AsTheyLand(Direct):
    """Chosen with direct reads for decode-sized calls (fewer than ``SORT_THRESHOLD`` rows): each
    read expert's rows computed as soon as its bytes land, while the others are still read (those
    installed together from staging in one call).
    Measured: cold decode faster than staged reads on the H200 and the CPU."""


class ByProjection(Direct):
    """Chosen instead of ``AsTheyLand`` for big experts (``CacheTuning.phase_min_bytes`` and more)
    where partial calls are exact and the kernel runs the layer's stock ``SwitchGLU`` code: as an
    expert's gate and up projections land, their rows of this call are computed (``async_eval``);
    when its down projection lands, the rest. The ops are those of mlx-lm's ``SwitchGLU.__call__``
    below ``SORT_THRESHOLD`` indices (``mlx_compat.switch_glu_*``), over the same rows and slots as
    ``rows`` would give it, so the result is the same bits. Measured: CPU Mixtral-shape cold
    decode closer to its I/O limit than experts read whole."""

    by_projection = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.partial = {}  # expert -> (rows, slots, input rows, {proj: output})

    def landed(self, ids, proj, slot):
        partial = self.partial
        bank = self.bank
        glu = bank.glu
        if proj is not None:  # a projection of expert ``ids[0]`` landed in ``slot``
            e = ids[0]
            if e not in partial:
                rows = np.nonzero(self.flat == e)[0]
                slots = mx.array(np.full((len(rows), 1), slot, dtype=np.uint32))
                x2 = self.x.reshape(-1, self.x.shape[-1])
                xe = mlx_compat.switch_glu_input(x2[mx.array(rows // self.idx.shape[-1])])
                partial[e] = (rows, slots, xe, {})
            _, slots, xe, done = partial[e]
            done[proj] = mlx_compat.switch_glu_projection(glu, proj, xe, slots)
            submit(bank, done[proj])
            return
        for e in ids:
            if e not in partial:  # installed from staging: no projection landed on its own
                self.rows(np.array([e]))
                continue
            rows, slots, _, done = partial.pop(e)
            up, gate = done["up_proj"], done["gate_proj"]
            y = mlx_compat.switch_glu_output(glu, up, gate, slots)[:, 0]
            submit(bank, y)
            self.rows_done.append(rows)
            self.outs.append(y)


class PrefillAsTheyLand(Direct):
    """Chosen with direct reads for prefill-sized calls (``SORT_THRESHOLD`` rows and more) where
    partial calls are exact (MLX's CPU backend): each read expert's rows computed alone as it
    lands, which keeps fewer and smaller temporaries than a call per wave (measured: lower peak
    RSS over the budget on the CPU)."""

    def landed(self, ids, proj, slot):
        for e in ids:
            self.rows(np.array([e]))


class PrefillWaves(Direct):
    """Chosen with direct reads for prefill-sized calls where partial calls are padded to the whole
    call's rows (GPUs: each partial call then costs as much as the whole one): a wave's read
    experts computed in one call once they all landed. Measured: H200 cold prefill much closer to
    its I/O limit than a call per landing."""

    def landed(self, ids, proj, slot):
        self.waiting.extend(ids)


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


def take_staged(bank, experts, keep) -> None:
    """Before any of this call's work is pending: write the experts read in the background into
    their slots (an MLX update, which would copy a bank that pending work reads)."""
    if bank.identity:
        bank.install_finished()
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


def submit(bank, y) -> None:
    """``mx.async_eval(y)``: the layer's compute handed to MLX (a timeline span if recorded)."""
    tl = bank.cache.timeline
    if tl:
        start = tl.now()
        mx.async_eval(y)
        tl.span("submit", start, "compute", layer=bank.path)
    else:
        mx.async_eval(y)


def wait(bank, y) -> None:
    """``mx.eval(y)`` where the layer waits for its own compute (a timeline span if recorded)."""
    tl = bank.cache.timeline
    start = tl.now() if tl else 0
    mx.eval(y)
    if tl:
        tl.span("wait compute", start, "wait", layer=bank.path)


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
