"""One decoder layer over a group of a long prompt's chunks, with every routed expert of the layer
in one set (``SetPass``, ``bank.layer_set``): each chunk through the layer once, in order, its MoE
call stock's own call over the set. The way of layer-major prefill where two layers' sets fit
beside the budget (``machine.layer_sets_fit``); where not, ``layer_pass`` (waves through the slots).

Nothing is recorded and nothing runs twice: the layer's attention writes its KV entries once, as
stock's does, and its MoE call is ``SwitchGLU.__call__`` over arrays that hold every expert of the
layer, expert e at row e, with the router's own ids: stock's call, the same rows, the same bits.

The last decoder layer has no set: stock's prefill evaluates only the cache entries of a prompt's
chunks (``generate_step``: ``mx.eval([c.state for c in prompt_cache])``), so the last layer's
attention output and MoE, like the head, are never computed for them (only its keys and values
are); here its MoE call answers zeros that nothing evaluates, and only the layer's cache entry is
evaluated (and its router's ids where a routing recorder wants them: that computes its attention).
"""

from threading import get_ident

import mlx.core as mx
import numpy as np

from .. import mlx_shims
from ..bank import LayerBank, LayerSets
from ..bank.layer_set import expert_counts
from ..decode.modes import Mode
from ..memory import machine as memory


def layer_banks(layer) -> list:
    """The slot banks of a decoder layer's streamed experts, in module order."""
    banks = []
    for m in layer.modules():
        bank = getattr(m, "bank", None)
        if isinstance(bank, LayerBank) and all(b is not bank for b in banks):
            banks.append(bank)
    return banks


def layer_sets(state, decoder):
    """``(sets, why)``: the prompt's two layer sets (``bank.LayerSets``), or None and why its
    layers go through the slots in waves instead."""
    nbytes, why = memory.layer_sets_fit(state.cache, state.resident_bytes)
    if why is None and not state.cache.banks:
        why = "no streamed MoE layer"
    if why is None and any(len(layer_banks(layer)) > 1 for layer in decoder):
        why = "a decoder layer with more than one streamed MoE module"
    if why is not None:
        return None, why
    sets = LayerSets(state.cache, nbytes)
    if not sets.writable(state.cache.banks[0]):
        return None, "MLX memory has no host view here"
    return sets, None


class SetPass(Mode):
    """Decoder layer ``i`` over a group of chunks (``route``, a chunk at a time; ``finish`` once
    the group is through), its MoE calls answered by stock's call over the layer's set: the mode
    of the layer's calls (``modes``), installed on the cache while a chunk runs. ``sets``: the
    prompt's ``bank.LayerSets``; ``bank``: the layer's slot bank, or None (no streamed experts);
    ``after``: the next MoE layer's, whose set is filled while this one computes; ``last``: the
    last decoder layer, whose output nothing uses (module docstring)."""

    hold = 1  # held between layers per hidden state: the hidden state alone

    def __init__(self, cache, sets, bank, after, last=False):
        self.cache = cache
        self.owner = get_ident()
        self.bank = bank
        self.sets = sets
        self.last = last  # the last decoder layer: its output is not computed (module docstring)
        self.set = sets.take(None if last else bank, after)
        self.uses = np.zeros(bank.num_experts if bank is not None else 0, dtype=np.int64)
        self.ids = []  # the router's ids of the running chunk's MoE calls
        self.chunks = []
        self.submitted = []  # each routed chunk's outputs, submitted and not waited for yet
        self.replayed = self.rerun = 0  # (``LayerPass``'s counts: nothing is given back here)

    def moe_call(self, module, x, indices):
        if get_ident() != self.owner or module.bank is not self.bank:
            return Mode.moe_call(self, module, x, indices)  # (never a layer of this pass)
        self.ids.append(indices)
        if self.last:
            return mx.zeros((*indices.shape, x.shape[-1]), dtype=x.dtype)
        return self.set.call(module, x, indices)

    def route(self, chunk, i: int) -> None:
        """Chunk ``chunk`` through decoder layer ``i``: its hidden states replaced by the layer's
        output, submitted (``mx.async_eval``, with the KV entry the layer wrote and its router's
        ids counted per expert, or the ids themselves where a recorder wants them; the last
        layer's output is not, nor its ids unless recorded): the next chunk's graph
        is built while this one computes, with no host sync between a layer's chunks (``finish``
        waits once)."""
        _, call, args, kwargs = chunk.calls[i]
        entry = mlx_shims.layer_cache(args, kwargs)
        with self.cache.running(self):
            # (not installed, where another thread's call runs: the MoE calls per layer, exact)
            h = call(chunk.h, *args[1:], **kwargs)
        ids, self.ids = self.ids, []
        counts = []
        if self.cache.recorder is None:
            # counted by MLX: the host reads one small array a layer, not the ids (on mlx-cuda a
            # host read of memory the GPU wrote moves its pages; the H200's timeline of a 4K
            # prompt had 2.7 ms a layer between the compute's end and the install, the ids' read)
            if not self.last and len(self.uses):
                counts = [expert_counts(ids, len(self.uses))]
            ids = []
        if h.shape != chunk.h.shape:
            raise RuntimeError(f"decoder layer {i} changed the hidden states' shape to {h.shape}")
        outputs = [[] if self.last else h, mlx_shims.kv_state(entry), ids, counts]
        mx.async_eval(outputs)
        self.submitted.append(outputs)
        chunk.h = h
        self.chunks.append(chunk)

    def finish(self, i: int) -> int:
        """The group is through the layer: its chunks evaluated (every computation over the set),
        their router's ids counted (and recorded), the slot bank keeps what the prompt used most
        there, the set is free; the bytes of hidden states held."""
        timeline, recorder = self.cache.timeline, self.cache.recorder
        start = timeline.now()
        mx.eval(self.submitted)
        timeline.span("compute layer", start, "compute", layer=i, chunks=len(self.chunks))
        start = timeline.now()
        for _, _, ids, counts in self.submitted:
            for c in counts:
                self.uses += np.array(c, copy=False)
            for idx in ids:  # (a recorder's: read and counted here)
                flat = np.array(idx, copy=False).reshape(-1).astype(np.int64)
                self.uses += np.bincount(flat, minlength=len(self.uses))
                recorder.record(self.bank, flat.reshape(idx.shape))
        self.submitted = []
        timeline.span("count uses", start, "wait", layer=i)
        if self.set is not None:
            self.sets.done(self.set, self.uses)
        if self.cache.tiers is not None and self.bank is not None:
            self.cache.tiers.seed(self.bank, self.uses)  # (where the device tier goes next)
        return sum(ch.h.nbytes for ch in self.chunks)
