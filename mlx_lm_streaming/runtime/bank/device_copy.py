"""A long prompt over two tiers (``tiers``): its MoE calls run over a copy of their layer's bank
in device memory, and move nothing while the prompt runs.

With two tiers a complete bank's pages lie partly in host memory, which the GPU reads over the
bus inside the kernel. A decode call reads each expert it uses once; a prompt's call (a chunk of
thousands of tokens) names nearly every expert and its kernel passes over each many times: run
in place, a 4K-token prompt took 27x stock's time to first token on the H200. So a prompt's call
runs over a copy of the whole bank that the GPU makes in device memory (``run``: the host tier
crosses the bus once per layer and chunk), one layer's copy at a time. A copy moves bytes and
computes nothing, so the kernel reads stock's bits and gives stock's output. A prompt's uses move
nothing while it runs: ``tiers`` counts them, scaled, at the first token after it. A bank the
background fill has not completed yet is completed first (``complete``): its missing experts read
once each, as the fill would, rather than the call running over host pages in padded waves.
"""

import numpy as np

# a call of at least this many (token, expert) rows per expert of the layer is a prompt's
ROWS_PER_EXPERT = 4


def is_prompt(bank, indices) -> bool:
    """Whether a call of ``bank`` with the router's ``indices`` is a prompt's."""
    return indices.size >= ROWS_PER_EXPERT * bank.num_experts


def run(bank, glu, x, indices):
    """``glu(x, indices)`` over copies of the bank's arrays made by the device (a take: bytes moved,
    not computed), evaluated before the bank's own arrays are put back: one layer's copy at a time
    in device memory, and a host wait per MoE layer of a prompt's chunk."""
    import mlx.core as mx

    parts = bank.layer.parts
    with bank.lock:
        kept = [bank.array(spec.proj, spec.part) for spec in parts]
        try:
            for spec, arr in zip(parts, kept):
                bank.glu[spec.proj][spec.part] = mx.take(arr, mx.arange(bank.slots), axis=0)
            y = glu(x, indices)
            mx.eval(y)
        finally:
            for spec, arr in zip(parts, kept):
                bank.glu[spec.proj][spec.part] = arr
    return y


def complete(bank, indices) -> None:
    """Before a prompt's call on an identity bank the fill has not completed: its missing experts
    read now, so that the call runs over a device copy of the complete bank (``tiers.Tiers.caller``)."""
    if bank.identity and not bank.complete and is_prompt(bank, indices):
        bank.load(np.flatnonzero(bank.slot_of < 0))
