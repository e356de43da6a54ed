"""``gather``: mlx-lm's own ``SwitchGLU`` code over the slot bank (``gather_qmm`` / ``gather_mm``).

The layer's stock ``SwitchGLU`` module is called with its arrays swapped for the slot banks and with slot
ids in place of expert ids, so sorting at >= 64 indices, activations and biases are mlx-lm's code.
Measured bit-identical to stock on CPU and on CUDA when called with the call's whole row count: on
CUDA partial calls are padded to it (``ExpertKernel.subset_exact_on``; docs/design.md, "Row groups and
exactness on GPUs"). On Metal it is MLX's own kernel, expected exact but not verified by us (no Mac in
CI), and padded like CUDA.
"""

from .base import ExpertKernel


class GatherKernel(ExpertKernel):
    name = "gather"
    exact_on = ("cpu", "cuda", "metal")
    subset_exact_on = ("cpu",)
    needs_host_slots = False
    runs_switch_glu = True
    calls_only_glu = True

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "__call__" in cls.__dict__:  # (a subclass with a call of its own is called)
            cls.calls_only_glu = False

    def priority(self, backend, bank, rows):
        return 10.0

    def __call__(self, x, slots, slots_np, bank):
        return bank.glu_call(x, slots)
