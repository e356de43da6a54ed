"""Trace routing for the benchmarks: each MoE layer's router choice replaced by a real trace's experts.

``TraceRouting.wrap(model)`` puts a small module in front of every MoE block's expert module (stock
``SwitchGLU``, our ``StreamingSwitchGLU``) that passes the trace's experts
(``mlx_lm_streaming.files.routing_trace``, ``tests/data/routing/*.jsonl``) instead of the router's
``indices``; the router still runs and its gate weights are used as stock uses them. The choice
depends only on (layer, rows consumed so far), so stock and streaming compute the same thing and
their logits stay comparable bit for bit. The rules (layers, top-k, cursors):
docs/benchmarks/methods.md (harness.py).
"""

import functools
import math
import time
from typing import Dict, List, Optional

import numpy as np

from mlx_lm_streaming.files.routing_trace import RoutingTrace, TraceError


class RowRouting:
    """Router choices as rows of expert ids per layer, taken in order by each layer's cursor.
    ``rows(layer_no, start, n, top_k)`` gives rows ``start`` to ``start + n`` (a cursor only
    grows: ``rows`` maps it into a table). A decode call's row is an evaluated device array of
    its own, sent in blocks of ``BLOCK`` rows (no host array and no graph node per call: issue 36
    measured a host array per MoE layer call costing stock a fifth); a longer call's are sent from
    the host."""

    BLOCK = 256

    def __init__(self):
        self.cursor: Dict[int, int] = {}
        self._device: Dict[tuple, tuple] = {}  # (layer, shape) -> (first row, its block's arrays)

    def reset(self) -> None:
        self.cursor = {}

    def indices(self, layer_no: int, shape):
        """The next ``prod(shape[:-1])`` rows of layer ``layer_no``, as ``shape``."""
        import mlx.core as mx

        rows, start = math.prod(shape[:-1]), self.cursor.get(layer_no, 0)
        if rows == 1:
            first, key = start - start % self.BLOCK, (layer_no, tuple(shape))
            held = self._device.get(key)
            if held is None or held[0] != first:
                block = self.rows(layer_no, first, self.BLOCK, shape[-1])
                held = self._device[key] = (first, [mx.array(r.reshape(shape)) for r in block])
                mx.eval(held[1])
            ids = held[1][start - first]
        else:
            ids = mx.array(self.peek(layer_no, shape))
        self.cursor[layer_no] = start + rows
        taken(self, layer_no, rows)
        return ids

    def unwind(self, layer_no: int, rows: int) -> None:
        self.cursor[layer_no] -= rows

    def peek(self, layer_no: int, shape) -> np.ndarray:
        """What ``indices`` will return next for layer ``layer_no``, without taking it (numpy)."""
        start, rows = self.cursor.get(layer_no, 0), math.prod(shape[:-1])
        return self.rows(layer_no, start, rows, shape[-1]).reshape(shape)


class ForcedRouting(RowRouting):
    """Uniformly random experts in place of a layer's router choice, alike in every configuration:
    row r of layer l depends only on (seed, l, r), so logits stay comparable. Why uniform (a
    random-weight model's own router picks the same few experts): docs/benchmarks/methods.md."""

    def __init__(self, num_experts: int, seed: int = 0):
        super().__init__()
        self.num_experts, self.seed = num_experts, seed

    def rows(self, layer_no: int, start: int, n: int, top_k: int) -> np.ndarray:
        picks = [np.random.default_rng([self.seed, layer_no, r]).random(self.num_experts)
                 for r in range(start, start + n)]  # fmt: skip
        return np.argsort(np.array(picks), axis=-1)[:, :top_k].astype(np.uint32)


class TraceRouting(RowRouting):
    """Router choices from a routing trace, the same for every model it wraps."""

    def __init__(self, trace: RoutingTrace, layers: Optional[int] = None):
        super().__init__()
        self.trace = trace
        self.top_k, self.num_experts = trace.top_k, trace.num_experts
        self.layers = trace.num_layers if layers is None else layers
        if not 0 < self.layers <= trace.num_layers:
            raise TraceError(
                f"{trace.path}: cannot replay {self.layers} MoE layers from a trace of "
                f"{trace.num_layers}"
            )
        # per layer: the ids of every row that has them, (rows, top_k), and how many are prefill
        # rows (past the end the rows go on from the first decode row: a decode never meets its
        # prompt's routing again, which a tier's counts would take for a shift)
        self.table: List[np.ndarray] = []
        self.prefill: List[int] = []
        for layer in range(self.layers):
            rows = [row for row in trace.rows if row.experts[layer]]
            self.table.append(np.array([row.experts[layer] for row in rows], dtype=np.uint32))
            self.prefill.append(sum(row.phase == "prefill" for row in rows))

    def check(self, num_layers: int, num_experts: int, top_k: int) -> None:
        """One-line ``TraceError`` unless the model can replay this trace's first ``layers``."""
        path = self.trace.path
        if num_layers != self.layers:
            raise TraceError(
                f"{path}: the model has {num_layers} MoE layers, the replay {self.layers} "
                f"(of the trace's {self.trace.num_layers})"
            )
        if num_experts != self.num_experts:
            raise TraceError(
                f"{path}: the trace has {self.num_experts} experts per layer, the model {num_experts}"
            )
        if top_k != self.top_k:
            raise TraceError(
                f"{path}: the trace picks {self.top_k} experts per token, the model {top_k}; "
                f"build the checkpoint with top_k={self.top_k}"
            )

    def wrap(self, model) -> int:
        """Route every MoE layer of ``model`` through this trace; returns the layers wrapped."""
        return wrap(model, self)

    def rows(self, layer_no: int, start: int, n: int, top_k: int) -> np.ndarray:
        if top_k != self.top_k:
            raise TraceError(
                f"{self.trace.path}: layer {layer_no} asked for {top_k} experts per token, "
                f"the trace has {self.top_k}"
            )
        table, at = self.table[layer_no], np.arange(start, start + n)
        first = self.prefill[layer_no] % len(table)  # (no decode rows: the whole table again)
        return table[np.where(at < len(table), at, first + (at - first) % (len(table) - first))]

    def decode_rows(self):
        """Index of the trace's first decode row (prompt length that lands decode on decode rows)."""
        rows = self.trace.rows
        return next((i for i, row in enumerate(rows) if row.phase == "decode"), len(rows))


def expert_modules(model):
    """``(parent, name, module)`` of every MoE expert module of ``model``, in layer order."""
    from mlx_lm.models.switch_layers import SwitchGLU

    from mlx_lm_streaming.runtime.decode.switch import StreamingSwitchGLU
    from mlx_lm_streaming.runtime.reads.index import natural_key

    kinds = (SwitchGLU, StreamingSwitchGLU)
    found = sorted(
        ((path, m) for path, m in model.named_modules() if isinstance(m, kinds)),
        key=lambda pm: natural_key(pm[0]),
    )
    out = []
    for path, module in found:
        parent = model
        parts = path.split(".")
        for q in parts[:-1]:
            parent = parent[int(q)] if isinstance(parent, list) else parent[q]
        out.append((parent, parts[-1], module))
    return out


def _expert_counts(model):
    """(experts per layer, experts per token) from the model's arguments."""
    args = getattr(model, "args", None)
    for source in (args, getattr(args, "text_config", None)):  # (a dict in qwen3_5_moe's)
        if source is None:
            continue
        experts = _first(source, ("num_experts", "num_local_experts", "n_routed_experts"))
        top_k = _first(source, ("num_experts_per_tok", "top_k", "num_experts_per_token",
                                 "top_k_experts"))
        if experts and top_k:
            return experts, top_k
    raise TraceError("cannot tell the model's experts per layer and per token from its arguments")


def _first(obj, names):
    for name in names:
        value = obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


# A forward that the streaming model runs again (a verified step that found a miss: the KV caches
# are rewound, ``mlx_shims.rewind``, and the call repeated) must see the same ids again, as a
# router given the same input would. Routing sources count calls, so the repeat would take the next
# ones: ``unwind_on_rewind`` makes every rewind also take back the calls of the last forward that
# has any left (single-threaded benchmarks: the one just rewound; with late checks, checked_late.py,
# the next token's forward first, then the missed one's from its layer).
_FORWARDS: List[List[tuple]] = []  # per recent forward, (routing, layer_no, rows) of its calls


def taken(routing, layer_no: int, rows: int) -> None:
    """A routing source gave ``rows`` rows of ids to layer ``layer_no`` (for ``unwind_on_rewind``)."""
    if layer_no == 0 or not _FORWARDS:  # a forward begins
        _FORWARDS.append([])
        del _FORWARDS[:-3]
    _FORWARDS[-1].append((routing, layer_no, rows))


def unwind_on_rewind() -> None:
    """Patch ``mlx_shims.rewind`` (bench only) to take back the rewound forward's routing calls."""
    from mlx_lm_streaming.runtime import mlx_shims

    if getattr(mlx_shims.rewind, "unwinds", False):
        return
    rewind = mlx_shims.rewind

    def rewind_and_unwind(cache, tokens):
        # the rewound entries are the model's last ones: in the benchmarks' models every decoder
        # layer is an MoE layer, so their calls are the last ``len(cache)`` ones of the forward
        rewind(cache, tokens)
        while _FORWARDS and not _FORWARDS[-1]:
            _FORWARDS.pop()
        calls = _FORWARDS[-1] if _FORWARDS else []
        for _ in range(len(calls) if cache is None else min(len(cache), len(calls))):
            routing, layer_no, rows = calls.pop()
            routing.unwind(layer_no, rows)

    rewind_and_unwind.unwinds = True
    mlx_shims.rewind = rewind_and_unwind


@functools.cache
def _routed_class():
    import mlx.core as mx
    import mlx.nn as nn

    class RoutedSwitch(nn.Module):
        """An expert module whose ``indices`` are replaced by a routing source's choice."""

        def __init__(self, inner, routing, layer_no, depends):
            super().__init__()
            object.__setattr__(self, "_inner", inner)
            object.__setattr__(self, "_routing", routing)
            object.__setattr__(self, "_layer_no", layer_no)
            object.__setattr__(self, "_depends", depends)

        def __call__(self, x, indices):
            routing, start = self._routing, time.perf_counter()
            ids = routing.indices(self._layer_no, indices.shape)
            out = self._inner(x, mx.depends(ids, indices) if self._depends else ids)
            # host time in the expert module (its host sync and reads included)
            seconds = time.perf_counter() - start
            routing.call_seconds = getattr(routing, "call_seconds", 0.0) + seconds
            return out

    return RoutedSwitch


def wrap(model, routing, depends=False) -> int:
    """Route every MoE layer of ``model`` through ``routing`` (its ``check`` first, where it has
    one); returns the layers routed. A model routed before is pointed at ``routing`` instead.
    ``depends``: the ids made to depend on the layer's router (``mx.depends``: no kernel): the
    values are the routing's, but a host readback of them waits for the graph up to that router,
    as with a trained model (a streaming model reads its ids on the host; stock reads none)."""
    cls = _routed_class()
    routed = [module for _, module in model.named_modules() if isinstance(module, cls)]
    for module in routed:
        object.__setattr__(module, "_routing", routing)
    if routed:
        return len(routed)
    found = expert_modules(model)
    if hasattr(routing, "check"):
        routing.check(len(found), *_expert_counts(model))
    for layer_no, (parent, name, module) in enumerate(found):
        parent[name] = cls(module, routing, layer_no, depends)
    return len(found)
