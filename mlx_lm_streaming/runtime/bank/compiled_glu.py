"""A bank's decode-sized expert call compiled (``CacheTuning.compiled_glu``): its graph built once.

A decode step on a GPU (and on a Mac) is bound by the host: stock's own step is its graph's build
and launch, and a verified step's extra over it is mostly Python per MoE layer
(docs/benchmarks/streaming-path.md). ``mlx_shims.switch_glu``'s call (mlx-lm's ``SwitchGLU``
statements below the sort threshold, each projection's rows given) builds the same few ops at
every call; ``mx.compile`` builds them once per input shape and replays them from C++. Here that
call, and a verified step's (the router's ids mapped to slot ids on the device first,
``slots[ids]``), are compiled with every array an input (a bank's arrays are swapped in place:
nothing is baked in).

Exact: the primitives and their inputs are ``switch_glu``'s; the one elementwise part is mlx-lm's
``SwiGLU``, itself compiled by mlx-lm (``swiglu``: one fused kernel), so the compiled graph fuses
the same ops into the same kernel. Taken only for that activation (another's code could fuse
to other bits; gemma-4's ``GeGLU``, which mlx-lm 0.32 compiles as ``geglu``, is left out: its
build would save ~0.5% of a gemma-4 step and no GPU run compared it) and the
projection kinds ``mlx_compat.switch_linears`` knows (a global scale, where a projection has one,
is an input too). Verified bit for bit on the CPU (tests/test_compiled_glu.py, and every parity
test through the default) and on mlx-cuda by the benchmark's every-step comparison (an H100, five
runs: docs/benchmarks/streaming-path.md); not on Metal (no Mac here): off there by default.

May import: runtime (as the room's other modules)
"""

import functools
from operator import getitem
from typing import Callable, Optional, Tuple

import mlx.core as mx

from .. import devices, mlx_shims
from ..mlx_compat import SORT_THRESHOLD

_KEYS = ("weight", "scales", "biases", "global_scale", "bias")


def wanted(tuning) -> bool:
    """Whether ``tuning.compiled_glu`` asks for the compiled calls here (None: on the CPU and on
    mlx-cuda, where they were verified; not on Metal)."""
    if tuning.compiled_glu is None:
        return devices.backend() in ("cpu", "cuda")
    return tuning.compiled_glu


def compiled_calls(glu) -> Optional[Tuple[Callable, Callable]]:
    """``(call, mapped)`` for ``glu`` (one ``mlx_shims.rows_kept`` accepts): ``call(x, ids)`` as
    ``switch_glu(glu)(x, ids)`` and ``mapped(x, slots, ids)`` as ``switch_glu(glu)(x,
    slots[ids])``, their graphs compiled below the sort threshold; None where ``glu``'s
    activation is not mlx-lm's ``SwiGLU`` as ``mlx_shims.stock_swiglu`` found it (its
    projections are kinds ``rows_kept`` knows)."""
    kinds = mlx_shims.linear_kinds()
    projections = (glu.up_proj, glu.gate_proj, glu.down_proj)
    swiglu = mlx_shims.stock_swiglu()  # (its call and its ``swiglu`` checked: None otherwise)
    if swiglu is None or type(glu.activation) is not swiglu:
        return None
    act = glu.activation
    # each projection: its gather (None: ``gather_mm``) and the keys of the arrays it reads
    specs = []
    for proj in projections:
        qmm = None
        if kinds[type(proj)] != "plain":
            qmm = functools.partial(mx.gather_qmm, transpose=True, group_size=proj.group_size,
                                    bits=proj.bits, mode=proj.mode)  # fmt: skip
        specs.append((qmm, tuple(k for k in _KEYS if k in proj), kinds[type(proj)] == "global"))
    reads = tuple((p, k) for p, (_, keys, _) in zip(projections, specs) for k in keys)

    def body(x, rows_in, rows_mid, ids, arrays):
        # the rows of x, then of the activation (a row per token and expert: ids' shape)
        x, rows = mx.expand_dims(x, (-2, -3)), rows_in
        out, at = [], 0
        for qmm, keys, glob in specs:
            a = dict(zip(keys, arrays[at : at + len(keys)]))
            at += len(keys)
            if len(out) == 2:
                x = act(out[0], out[1])
                rows = rows_mid
            if qmm is None:
                y = mx.gather_mm(x, a["weight"].swapaxes(-1, -2), rows, ids)
            else:  # (``global_scale``: an array of the module's, or None as it has none)
                y = qmm(x, a["weight"], a["scales"], a.get("biases"), rows, ids,
                        **({"global_scale": a.get("global_scale")} if glob else {}))  # fmt: skip
            if "bias" in a:
                y = y + mx.expand_dims(a["bias"][ids], -2)
            out.append(y)
        return out[2].squeeze(-2)

    plain = mx.compile(body)
    through = mx.compile(lambda x, r, s, slots, ids, arrays: body(x, r, s, slots[ids], arrays))
    # each projection's rows, made once per shape (``switch_glu``'s: x's batch shape and a 1,
    # then ids' shape), looked up inline (the hot path's calls are counted)
    made, make = mlx_shims.ROWS, mlx_shims.row_indices

    # the arrays as the projections hold them now (C calls: ``map`` over ``getitem``)
    holders, keys = tuple(p for p, _ in reads), tuple(k for _, k in reads)

    def call(x, ids):
        if ids.size >= SORT_THRESHOLD:
            return glu(x, ids)
        rows_in, rows_mid = made.get((*x.shape[:-1], 1)), made.get(ids.shape)
        if rows_in is None or rows_mid is None:
            rows_in, rows_mid = make((*x.shape[:-1], 1)), make(ids.shape)
        return plain(x, rows_in, rows_mid, ids, list(map(getitem, holders, keys)))

    def mapped(x, slots, ids):
        if ids.size >= SORT_THRESHOLD:
            return glu(x, slots[ids])
        rows_in, rows_mid = made.get((*x.shape[:-1], 1)), made.get(ids.shape)
        if rows_in is None or rows_mid is None:
            rows_in, rows_mid = make((*x.shape[:-1], 1)), make(ids.shape)
        return through(x, rows_in, rows_mid, slots, ids, list(map(getitem, holders, keys)))

    return call, mapped
