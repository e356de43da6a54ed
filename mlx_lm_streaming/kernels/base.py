"""The kernel interface: how the selected experts of one layer are computed from its slot bank.

A kernel gets the layer's input ``x`` (``(..., D)``), the router's choices already turned into slot ids
(``slots``, ``(..., K)``, as an ``mx.array`` and as a numpy copy for host-side planning), the
``LayerBank`` and the layer's own activation, and returns ``(..., K, D)`` exactly as mlx-lm's
``SwitchGLU`` would.

Each kernel says whether it can run on the current backend (``available``), whether it is bit-identical
to stock mlx-lm there (``exact``), whether it handles a bank's quantization (``supports``) and how much
it wants the job (``priority``). Like mlx-lm's ``gated_delta`` kernels, one that cannot run reports so
and the selector falls back. Exactness is a measured fact per backend: never claim it unverified.
"""

import mlx.core as mx


class ExpertKernel:
    """Computes ``SwitchGLU(x, indices)`` over a slot bank."""

    name = "base"
    # backends on which the kernel was measured bit-identical to stock mlx-lm
    exact_on = ()
    # backends on which computing a subset of a call's (token, expert) rows gives each row the same
    # bits as the whole call: there the layer may compute rows in groups (the resident experts' while
    # the others are read, each read expert's as it lands, waves). Elsewhere every partial call is
    # padded to the whole call's row count (repeating a row it has, results dropped), so the kernel
    # sees the shapes stock mlx-lm gives it: on CUDA a kernel's launch shape, and with it a row's
    # bits, may depend on the row count (docs/design.md, "Row groups and exactness on GPUs").
    subset_exact_on = ()
    # whether it reads ``slots_np`` (host copy of the slot ids); if not, a complete bank whose slots
    # are the expert ids calls it with the router's indices and ``slots_np=None``, with no host sync
    needs_host_slots = True
    # whether it computes with the layer's own stock ``SwitchGLU`` code over the bank: then that code
    # run a projection at a time (``mlx_shims.switch_glu_*``, in runtime/) gives the kernel's bits,
    # and the layer may compute a read expert's first projections while its last one is still read
    runs_switch_glu = False
    # whether its call is ``bank.glu_call(x, slots)`` and nothing else: the layer may then make
    # that call itself, a Python call fewer a MoE call (``gather``, not a subclass that overrides
    # its call)
    calls_only_glu = False

    def available(self) -> bool:
        return True

    def exact(self, backend: str) -> bool:
        return backend in self.exact_on

    def subset_exact(self, backend: str) -> bool:
        return backend in self.subset_exact_on

    def supports(self, bank) -> bool:
        return True

    def priority(self, backend: str, bank, rows: int) -> float:
        return 0.0

    def __call__(self, x, slots, slots_np, bank) -> mx.array:
        raise NotImplementedError
