"""The per-layer schedules with direct reads: per wave, the reads issued, the hits submitted while
they are read, then each read expert taken as it lands (``LayerBank.reads``), its rows computed."""

import mlx.core as mx
import numpy as np

from .. import lookahead, mlx_shims
from .base import PerLayer, kernel_rows, submit, wait


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
        # every row submitted before the lock is let go: a later call's host sync on this stream
        # then waits for it, so no pending work reads a slot that call rewrites
        if len(outs) == 1 and len(rows_done[0]) == flat.size:
            y = outs[0]  # every row, in order: submitted already (``rows``)
            y = y.reshape(*idx.shape, y.shape[-1])
        else:
            order = np.argsort(np.concatenate(rows_done), kind="stable")
            y = mx.concatenate(outs, axis=0)[mx.array(order)]
            y = y.reshape(*idx.shape, y.shape[-1])
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
        tl = bank.cache.timeline
        start = tl.now()
        mx.async_eval(y)  # (``submit``, spelt out: once per landing)
        tl.span("submit", start, "compute", layer=bank.path)
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
    below ``SORT_THRESHOLD`` indices (``mlx_shims.switch_glu_*``), over the same rows and slots as
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
                xe = mlx_shims.switch_glu_input(x2[mx.array(rows // self.idx.shape[-1])])
                partial[e] = (rows, slots, xe, {})
            _, slots, xe, done = partial[e]
            done[proj] = mlx_shims.switch_glu_projection(glu, proj, xe, slots)
            submit(bank, done[proj])
            return
        for e in ids:
            if e not in partial:  # installed from staging: no projection landed on its own
                self.rows(np.array([e]))
                continue
            rows, slots, _, done = partial.pop(e)
            up, gate = done["up_proj"], done["gate_proj"]
            y = mlx_shims.switch_glu_output(glu, up, gate, slots)[:, 0]
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
