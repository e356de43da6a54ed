"""``per_expert``: one ``quantized_matmul`` (or ``matmul``) per selected expert and projection.

Rows are grouped by slot on the host (the slot ids are already there), each group is multiplied by its
expert's own slice of the bank, and the rows are put back in order. Bit-identical to stock on CPU
(measured); on CUDA it is not (docs/design.md, "Kernels and the selector"), so it is marked inexact
there and is only used when asked for by name. Global-scale (nvfp4) banks are not supported:
``quantized_matmul`` takes no global scale; nor are ``SwitchMLP`` banks (``fc1`` / ``fc2``):
``gather`` computes those.
"""

import mlx.core as mx
import numpy as np

from ..runtime.reads.index import PROJECTIONS
from .base import ExpertKernel


class PerExpertKernel(ExpertKernel):
    name = "per_expert"
    exact_on = ("cpu",)
    subset_exact_on = ("cpu",)

    def supports(self, bank):
        # a SwitchGLU's three projections (a SwitchMLP's fc1 / fc2 take the gather kernel)
        projections = {spec.proj for spec in bank.layer.parts}
        return projections == set(PROJECTIONS) and all(
            spec.part != "global_scale" for spec in bank.layer.parts
        )

    def priority(self, backend, bank, rows):
        # gather_qmm batches all experts in one call; this only wins when asked for
        return 1.0

    def _linear(self, bank, proj, x, slot):
        module = bank.glu[proj]
        w = module["weight"][slot]
        if "scales" in module:
            biases = module.get("biases")
            y = mx.quantized_matmul(
                x,
                w,
                module["scales"][slot],
                None if biases is None else biases[slot],
                transpose=True,
                group_size=module.group_size,
                bits=module.bits,
                mode=module.mode,
            )
        else:
            y = x @ w.T
        if "bias" in module:
            y = y + module["bias"][slot]
        return y

    def __call__(self, x, slots, slots_np, bank):
        k = slots_np.shape[-1]
        x_flat = x.reshape(-1, x.shape[-1])
        flat = slots_np.reshape(-1)
        order = np.argsort(flat, kind="stable")
        uniq, starts = np.unique(flat[order], return_index=True)
        ends = np.append(starts[1:], len(order))
        act = bank.glu.activation
        outs = []
        for slot, s, e in zip(uniq.tolist(), starts.tolist(), ends.tolist()):
            xs = x_flat[mx.array(order[s:e] // k)]
            up = self._linear(bank, "up_proj", xs, slot)
            gate = self._linear(bank, "gate_proj", xs, slot)
            outs.append(self._linear(bank, "down_proj", act(up, gate), slot))
        y = mx.concatenate(outs, axis=0)[mx.array(np.argsort(order, kind="stable"))]
        return y.reshape(*slots_np.shape, y.shape[-1])
