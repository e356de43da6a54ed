"""The per-layer schedules with direct reads: per wave (``bank.waves.direct``), the reads issued, the
hits submitted while they are read, then each read expert taken as it lands (``LayerBank.reads``),
its rows computed."""

import mlx.core as mx
import numpy as np

from ... import mlx_shims
from ...bank.waves import submit
from .base import ExpertRows


class Direct(ExpertRows):
    """Direct reads (``LayerBank.direct``) through the wave engine (``bank.waves.direct``): per
    wave, the reads issued, the resident experts' rows submitted while they are read, then each
    landing taken as it comes (``landed``). With more experts than slots, waves of at most half
    the slots, so that a wave's reads go into the other half while the wave before computes. The
    subclasses differ in what they do with a landing."""

    abstract = True


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
