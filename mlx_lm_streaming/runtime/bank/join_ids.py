"""``join_rows``: a decode step's small ids arrays joined into one array by one kernel on mlx-cuda.

A verified step's check reads every MoE call's ids back once (``named_reads.call_ids``), and the
two tiers count every call's ids each batch (``tiers.Tiers.gather``): many arrays of a few ids
each joined into one, to be read once. MLX joins input by input (``mx.stack`` and
``mx.concatenate`` copy each input with a kernel of its own): a kernel per MoE layer a token. On
mlx-cuda a decode step of a 16-layer MoE is host-bound, ~500 kernels in ~3.4 ms on an H100, so each
kernel costs the step its launch (~7 us), and those copies were ~16 of a step's kernels in both
(docs/benchmarks/streaming-path.md, tiers.md: "The fifteenth session"). Here one kernel copies
every array (``mx.fast.cuda_kernel``: a switch over its inputs, one thread an id), compiled once
per count of arrays, ids per array and dtype. The ids are copied, never computed on: the bytes are
the router's.

Where ``CacheTuning.join_kernel`` says so (off by default: exact on an H100, but no faster beyond
the noise there, docs/benchmarks/streaming-path.md, "The sixteenth session"), on mlx-cuda only;
elsewhere (the CPU, Metal) and for arrays of other sizes or dtypes, or more than ``MAX_ARRAYS``,
MLX's own ``mx.stack`` as before. On Metal a ``metal_kernel`` would do the same; not written (no
Mac to verify it on).
"""

from operator import attrgetter
from typing import Dict, List, Optional, Tuple

import mlx.core as mx

from ..devices import backend

# more inputs than this: MLX's own stack (a kernel's parameters are bounded: 8 bytes an input)
MAX_ARRAYS = 512
_kernels: Dict[int, object] = {}  # arrays joined -> the kernel made for that count
_SHAPE, _DTYPE = attrgetter("shape"), attrgetter("dtype")


def join_rows(arrays: List[mx.array], kernel: Optional[bool] = None) -> mx.array:
    """``arrays`` (all of one shape and dtype) as the rows of one array, ``(len(arrays), size)``,
    lazily: one kernel (module docstring) where ``kernel`` (None: where this is mlx-cuda; the
    package passes ``CacheTuning.join_kernel``'s answer), ``mx.stack`` elsewhere."""
    n = len(arrays)
    if (
        not 1 < n <= MAX_ARRAYS
        or not (backend() == "cuda" if kernel is None else kernel)
        or len(set(map(_DTYPE, arrays))) != 1  # (the kernel reads one type; stack promotes)
    ):
        return mx.stack(arrays).reshape(n, -1)
    kernel = _kernels.get(n)
    if kernel is None:
        kernel = _kernels[n] = mx.fast.cuda_kernel(*_source(n))
    k, dtype = arrays[0].size, arrays[0].dtype
    return kernel(
        inputs=arrays,
        template=[("T", dtype), ("N", n), ("K", k)],
        grid=(n * k, 1, 1),
        threadgroup=(min(256, n * k), 1, 1),
        output_shapes=[(n, k)],
        output_dtypes=[dtype],
    )[0]


def join_flat(arrays: List[mx.array], kernel: bool) -> mx.array:
    """Every id of ``arrays`` one after another in one array (lazily; flattened, it is their ids
    in order): ``join_rows`` where the arrays are of one shape and dtype (without ``kernel``,
    arrays of one row each joined on their last axis: the fewest graph nodes), else each
    flattened and concatenated."""
    shapes = set(map(_SHAPE, arrays))  # (C loops: no Python call per array)
    if len(shapes) != 1:
        return mx.concatenate([a.reshape(-1) for a in arrays])
    shape = shapes.pop()
    if not kernel and len(shape) and arrays[0].size == shape[-1]:
        return mx.concatenate(arrays, axis=-1)
    return join_rows(arrays, kernel)


def _source(n: int) -> Tuple[str, list, list, str]:
    """``(name, input names, output names, source)`` of the kernel joining ``n`` arrays: thread
    ``e`` copies id ``e % K`` of array ``e / K``."""
    names = [f"a{i}" for i in range(n)]
    cases = " ".join(f"case {i}: src = a{i}; break;" for i in range(1, n))
    source = f"""
    const unsigned int e = blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= N * K) return;
    const unsigned int w = e / K;
    const T* src = a0;
    switch (w) {{ {cases} }}
    out[e] = src[e - w * K];
"""
    return f"mlx_lm_streaming_join_{n}", names, ["out"], source
