"""Which MLX backend computes: ``metal``, ``cuda`` or ``cpu``.

Kernels choose by it (exactness is a measured fact per backend), and so do the stores' and the cache's
defaults for writing into MLX memory from the host (verified on the CPU backend only).
"""

import mlx.core as mx


def backend() -> str:
    """``metal``, ``cuda`` or ``cpu``: where the default device computes."""
    if mx.default_device() == mx.gpu:
        if mx.metal.is_available():
            return "metal"
        if hasattr(mx, "cuda") and mx.cuda.is_available():
            return "cuda"
    return "cpu"
