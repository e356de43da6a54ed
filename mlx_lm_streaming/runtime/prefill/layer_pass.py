"""One decoder layer over a group of a long prompt's chunks, its experts read once for all of them
(``LayerPass``): the expert-major half of layer-major prefill (``layer_major.py`` drives it)."""

from threading import get_ident
from typing import List

import mlx.core as mx
import numpy as np

from .. import mlx_shims
from ..bank import LayerBank, waves
from ..bank.waves import submit, wait
from ..decode.modes import Mode
from ..decode.schedules import kernel_rows, member


class Chunk:
    """One chunk of the prompt: its recorded layer calls and its hidden states so far."""

    def __init__(self, calls):
        self.calls = calls
        self.h = calls[0][2][0]  # the embeddings, as layer 0 gets them

    @property
    def tokens(self) -> int:
        return self.h.shape[1]


class LayerPass(Mode):
    """One decoder layer over a group of chunks, its experts read once for all of them: the mode
    of the layer's calls (``modes``), installed on ``cache`` while it routes and while it gives.

    ``route``: each chunk through the layer with its MoE calls recorded (their input and the
    router's ids) and answered with zeros: the layer's KV entries are right (they do not depend on
    the MoE's output), its output is not. The calls of the layer's other parts (attention, norms:
    its direct child modules holding no streamed experts) are recorded with their outputs.
    ``compute``: every chunk's MoE rows, expert-major: each expert read once, each chunk's rows
    of an expert by the same kernel over the same bank as a per-layer schedule
    (``schedules.kernel_rows``: a partial call, padded to the chunk's rows where the backend needs
    it), waves of half the slots read while the wave before computes. ``give``: each chunk
    through the layer again, its cache entry put back as it was before the chunk (a KV entry at
    the chunk's first token, a hybrid's recurrent state given its arrays of then), every recorded
    call given with the very same arguments answered with its recorded output (attention does
    not run twice: its KV entries are already written, and its reads see the chunks before this
    one), the MoE calls answered with the rows computed where the call's input and ids are those
    routed; a call whose arguments differ runs as usual (an attention writes the same entries
    again, at the same place); after it, the entry is put where routing left it (a recurrent
    mixer given back its output did not advance its state again)."""

    def __init__(self, cache, entry, layer=None):
        self.cache = cache  # the model's ExpertCache, whose mode this is while it runs
        # the layer's cache entry: a KVCache, a recurrent state (ArraysCache) or None (none)
        self.entry = entry
        self.routing = True
        self.chunks: List[Chunk] = []
        self.moe: List[list] = []  # per chunk: [module, x, indices, y] per MoE call
        self.parts: List[list] = []  # per chunk: (module, args, kwargs, output) per part call
        # per chunk: the entry before it and after its routing (``mlx_shims.mark``)
        self.starts: List[object] = []
        self.ends: List[object] = []
        self.at = 0
        self.given = 0  # the part calls given back so far in this chunk
        self.top_k = 8  # until a call says
        self.replayed = 0  # part calls given back their recorded output
        self.rerun = 0  # part calls given the layer's KV entry run again (attention)
        self.layer = layer
        self.owner = get_ident()
        self.own = []
        if layer is not None:  # (a module holding streamed experts: a StreamingSwitchGLU's bank)
            self.own = [
                m
                for m in mlx_shims.child_modules(layer)
                if not any(isinstance(getattr(n, "bank", None), LayerBank) for n in m.modules())
            ]

    @property
    def hold(self) -> int:
        """Held between layers per hidden state: it, the MoE's input and ``top_k`` output rows, the
        outputs of the attention and of its two norms."""
        return 5 + self.top_k

    def moe_call(self, module, x, indices):
        if self.routing:
            self.moe[-1].append([module, x, indices, None])
            self.top_k = indices.shape[-1]
            return mx.zeros((*indices.shape, x.shape[-1]), dtype=x.dtype)
        calls = self.moe[self.at]
        for item in calls:
            got, x0, idx0, y = item
            if got is module and y is not None:
                item[3] = None
                if mx.array_equal(x0, x).item() and mx.array_equal(idx0, indices).item():
                    return y
                break
        return Mode.moe_call(self, module, x, indices)  # a call routing did not see: on its own

    def part_call(self, module, call, args, kwargs):
        """A call of one of the layer's parts: recorded while routing, answered with its recorded
        output when given the same arguments again (``_same``). Another thread's calls of the
        same modules run stock."""
        if get_ident() != self.owner:
            return call(*args, **kwargs)
        if self.routing:
            out = call(*args, **kwargs)
            self.parts[-1].append((module, args, kwargs, out))
            return out
        calls = self.parts[self.at]
        if self.given < len(calls):
            got, args0, kwargs0, out = calls[self.given]
            self.given += 1
            if got is module and _same(args, args0) and _same(kwargs, kwargs0):
                self.replayed += 1
                return out
            self.given = len(calls)  # not the routed sequence: nothing more is given back
        if self.entry is not None and any(a is self.entry for a in (*args, *kwargs.values())):
            self.rerun += 1  # an attention, run again
        return call(*args, **kwargs)

    def route(self, chunk: Chunk, i: int) -> None:
        _, call, args, kwargs = chunk.calls[i]
        if not self.chunks:  # the layer's entry, as the model gives it (``Recorder.problem``)
            self.entry = mlx_shims.layer_cache(args, kwargs)
        self.chunks.append(chunk)
        self.moe.append([])
        self.parts.append([])
        self.starts.append(mlx_shims.mark(self.entry))
        with self.cache.running(self), mlx_shims.calls_through(self.own, self.part_call):
            # (not installed, where another thread's call runs: the MoE calls computed, none
            # recorded, and the layer's output right, as a layer with no MoE call)
            h = call(chunk.h, *args[1:], **kwargs)
        self.ends.append(mlx_shims.mark(self.entry))
        if h.shape != chunk.h.shape:
            raise RuntimeError(f"decoder layer {i} changed the hidden states' shape to {h.shape}")
        if self.moe[-1]:
            mx.eval(
                [(x, idx) for _, x, idx, _ in self.moe[-1]],
                [out for *_, out in self.parts[-1]],
                mlx_shims.kv_state(self.entry),
            )
        else:  # no MoE call in this layer: its output is right
            mx.eval(h, mlx_shims.kv_state(self.entry))
            chunk.out = h
            self.parts[-1] = []

    def finish(self, i: int) -> int:
        """The group's MoE rows, then each chunk through layer ``i`` again; the bytes held."""
        if not any(self.moe):
            for chunk in self.chunks:
                chunk.h = chunk.out
            return sum(ch.h.nbytes for ch in self.chunks)
        self.compute()
        held = (
            sum(ch.h.nbytes for ch in self.chunks)
            + sum(x.nbytes + y.nbytes for calls in self.moe for _, x, _, y in calls)
            + sum(_nbytes(out) for calls in self.parts for *_, out in calls)
        )
        end = mlx_shims.mark(self.entry)
        self.routing = False
        with self.cache.running(self), mlx_shims.calls_through(self.own, self.part_call):
            # (not installed, where another thread's call runs: each MoE call computed on its own)
            for at, chunk in enumerate(self.chunks):
                self.at, self.given = at, 0
                mlx_shims.seek(self.entry, self.starts[at])
                _, call, args, kwargs = chunk.calls[i]
                h = call(chunk.h, *args[1:], **kwargs)
                mlx_shims.seek(self.entry, self.ends[at])
                mx.eval(h, mlx_shims.kv_state(self.entry))
                chunk.h = h
                self.moe[at] = []
                self.parts[at] = []
        if self.entry is not None and mlx_shims.changed(self.entry, end):
            raise RuntimeError(
                f"decoder layer {i}'s cache entry does not end where routing left it"
            )
        return held

    def compute(self) -> None:
        by_module = {}
        for calls in self.moe:
            for item in calls:
                by_module.setdefault(id(item[0]), []).append(item)
        for items in by_module.values():
            _expert_major(items)


class _ChunkRows:
    """The wave engine's ``work`` (``bank.waves``) for one MoE module's calls over a group of
    chunks: an expert's rows of every chunk's call computed at once."""

    def __init__(self, items, idx, each: bool):
        self.items, self.idx = items, idx
        self.flats = [ids.reshape(-1) for ids in idx]
        self.parts = [([], []) for _ in items]  # per call: rows done, their outputs
        self.outs, self.waiting = [], []
        self.each = each  # each landed expert's rows alone (partial calls exact), else per wave

    def rows(self, ids) -> None:
        module = self.items[0][0]
        num_experts = module.bank.num_experts
        for (_, x, _, _), call_ids, flat, (rows_done, ys) in zip(
            self.items, self.idx, self.flats, self.parts
        ):
            rows = np.nonzero(member(flat, ids, num_experts))[0]
            if len(rows):
                y = kernel_rows(module, x, call_ids, rows)
                submit(module.bank, y)
                rows_done.append(rows)
                ys.append(y)
                self.outs.append(y)

    def landed(self, ids, proj, slot) -> None:
        if self.each:
            for e in ids:
                self.rows(np.array([e]))
        else:
            self.waiting.extend(ids)


def _expert_major(items) -> None:
    """The rows of one MoE module's calls ``items`` (``[module, x, indices, None]``, one per
    chunk), expert-major, each expert read once, through the bank's wave engine (``bank.waves``):
    ``item[3]`` set to the call's output. Resident experts first (computed while the others are
    read), then the others from the least used by the prompt to the most used: the last waves stay
    in the slots, and the prompt's most used experts are the likeliest to be wanted next (the last
    token's step, decode). With direct reads each read expert's rows are computed as it lands
    where partial calls are exact (the CPU), else a wave's rows once it landed (partial calls
    padded: GPUs)."""
    module = items[0][0]
    bank = module.bank
    cache = bank.cache
    cache.ensure_planned()
    idx = [np.array(i, copy=False).astype(np.int64) for _, _, i, _ in items]
    if cache.recorder is not None:
        for ids in idx:
            cache.recorder.record(bank, ids)
    experts, uses = np.unique(np.concatenate([i.reshape(-1) for i in idx]), return_counts=True)
    selector = module.selector
    kernel = selector.select(bank, max(i.size for i in idx))
    work = _ChunkRows(items, idx, kernel.subset_exact(selector.backend))
    with bank.lock:
        resident = bank.slot_of[experts] >= 0
        rest = experts[~resident][np.argsort(uses[~resident], kind="stable")]
        experts = np.concatenate([experts[resident], rest])
        if bank.direct:
            waves.direct(bank, experts, work)
        else:
            waves.staged(bank, experts, work)
        wait(bank, work.outs)
    for item, ids, (rows_done, ys) in zip(items, idx, work.parts):
        order = np.argsort(np.concatenate(rows_done), kind="stable")
        y = mx.concatenate(ys, axis=0)[mx.array(order)]
        item[3] = y.reshape(*ids.shape, y.shape[-1])
        mx.eval(item[3])


def _same(a, b) -> bool:
    """Whether two argument tuples (or keyword dicts) of a call are the very same: the same
    objects, or equal numbers, strings and None."""
    if isinstance(a, dict):
        if a.keys() != b.keys():
            return False
        a, b = list(a.values()), [b[k] for k in a]
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if x is y:
            continue
        if type(x) is not type(y) or not isinstance(x, (int, float, str, bool)) or x != y:
            return False
    return True


def _nbytes(out) -> int:
    if isinstance(out, mx.array):
        return out.nbytes
    if isinstance(out, (tuple, list)):
        return sum(_nbytes(o) for o in out)
    return 0
