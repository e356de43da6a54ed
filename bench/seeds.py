"""The two seed designs the benchmark compares against, as the seeds built them.

Both read experts through the same store as ours and keep an LRU of expert dicts (one MLX array per
tensor of an expert) under the same byte budget; they differ in how they compute:

- ``LoopSwitchGLU``: a Python loop over the selected experts, one ``quantized_matmul`` per expert and
  projection (rows grouped per expert), results put back in order;
- ``StackSwitchGLU``: per token, the selected experts' tensors are stacked into a fresh sub-``SwitchGLU``
  (a copy of the layer's stock module) that is called with indices ``0..k-1``.

``install(model, budget_bytes, kind)`` swaps every ``StreamingSwitchGLU`` of a streaming model for one of
these. Both are exact on CPU (the loop is not on CUDA: per-expert ``quantized_matmul`` differs there).
"""

import copy
import time
from collections import OrderedDict

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlx_lm_streaming.safetensors_header import DTYPES
from mlx_lm_streaming.switch import StreamingSwitchGLU


class ExpertDictLRU:
    """(layer, expert) -> {(proj, part): mx.array}, least recently used out first."""

    def __init__(self, store, capacity_bytes: int):
        self.store = store
        self.capacity = capacity_bytes
        self.entries = OrderedDict()
        self.nbytes = 0
        self.hits = 0
        self.misses = 0
        self.bytes_read = 0
        self.io_seconds = 0.0

    def get(self, layer, expert: int):
        key = (layer.path, expert)
        entry = self.entries.get(key)
        if entry is not None:
            self.entries.move_to_end(key)
            self.hits += 1
            return entry
        self.misses += 1
        start = time.perf_counter()
        bufs = [np.empty(p.nbytes, dtype=np.uint8) for p in layer.parts]
        self.store.read_many(list(zip(layer.refs(expert), map(memoryview, bufs))))
        self.io_seconds += time.perf_counter() - start
        entry = {
            (p.proj, p.part): mx.array(b).view(DTYPES[p.dtype][0]).reshape(p.shape)
            for p, b in zip(layer.parts, bufs)
        }
        mx.eval(list(entry.values()))
        self.bytes_read += layer.expert_nbytes
        self.entries[key] = entry
        self.nbytes += layer.expert_nbytes
        while self.nbytes > self.capacity and len(self.entries) > 1:
            (path, _), _ = self.entries.popitem(last=False)
            self.nbytes -= layer.expert_nbytes  # every expert of a model has the same size here
        return entry


class _SeedSwitch(nn.Module):
    def __init__(self, bank, lru):
        super().__init__()
        object.__setattr__(self, "_layer", bank.layer)
        object.__setattr__(self, "_glu", bank.glu)
        object.__setattr__(self, "_lru", lru)


class LoopSwitchGLU(_SeedSwitch):
    """Seed 1: per-expert loop, one quantized_matmul per expert and projection."""

    def _linear(self, proj, w, x):
        module = self._glu[proj]
        weight = w[(proj, "weight")]
        if (proj, "scales") in w:
            y = mx.quantized_matmul(
                x,
                weight,
                w[(proj, "scales")],
                w.get((proj, "biases")),
                transpose=True,
                group_size=module.group_size,
                bits=module.bits,
                mode=module.mode,
            )
        else:
            y = x @ weight.T
        if (proj, "bias") in w:
            y = y + w[(proj, "bias")]
        return y

    def __call__(self, x, indices):
        idx = np.array(indices, copy=False).astype(np.int64)
        k = idx.shape[-1]
        flat = idx.reshape(-1)
        x_flat = x.reshape(-1, x.shape[-1])
        order = np.argsort(flat, kind="stable")
        uniq, starts = np.unique(flat[order], return_index=True)
        ends = np.append(starts[1:], len(order))
        act = self._glu.activation
        outs = []
        for e, s, t in zip(uniq.tolist(), starts.tolist(), ends.tolist()):
            w = self._lru.get(self._layer, e)
            xs = x_flat[mx.array(order[s:t] // k)]
            up = self._linear("up_proj", w, xs)
            gate = self._linear("gate_proj", w, xs)
            outs.append(self._linear("down_proj", w, act(up, gate)))
        y = mx.concatenate(outs, axis=0)[mx.array(np.argsort(order, kind="stable"))]
        return y.reshape(*idx.shape, y.shape[-1])


class StackSwitchGLU(_SeedSwitch):
    """Seed 2: per token, stack the selected experts into a fresh sub-SwitchGLU."""

    def __call__(self, x, indices):
        idx = np.array(indices, copy=False).astype(np.int64)
        k = idx.shape[-1]
        flat = idx.reshape(-1, k)
        x_flat = x.reshape(-1, x.shape[-1])
        local = mx.arange(k, dtype=mx.uint32)[None]
        outs = []
        for t in range(flat.shape[0]):
            ws = [self._lru.get(self._layer, e) for e in flat[t].tolist()]
            sub = copy.copy(self._glu)
            for proj in ("gate_proj", "up_proj", "down_proj"):
                p = copy.copy(self._glu[proj])
                for part in list(p.keys()):
                    if isinstance(p[part], mx.array):
                        p[part] = mx.stack([w[(proj, part)] for w in ws])
                sub[proj] = p
            outs.append(sub(x_flat[t : t + 1], local))
        y = mx.concatenate(outs, axis=0)
        return y.reshape(*idx.shape, y.shape[-1])


SEEDS = {"seed_loop": LoopSwitchGLU, "seed_stack": StackSwitchGLU}


def install(model, budget_bytes: int, kind: str) -> ExpertDictLRU:
    """Replace every StreamingSwitchGLU of ``model`` by seed ``kind``; returns the shared LRU."""
    state = model.expert_streaming
    lru = ExpertDictLRU(state.store, budget_bytes)
    for path, module in list(model.named_modules()):
        if isinstance(module, StreamingSwitchGLU):
            parent = model
            parts = path.split(".")
            for p in parts[:-1]:
                parent = parent[int(p)] if isinstance(parent, list) else parent[p]
            parent[parts[-1]] = SEEDS[kind](module.bank, lru)
    return lru
