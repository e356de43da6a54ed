"""A MoE layer's whole expert set, for a long prompt's prefill (``layer_major.py``): every routed
expert of one layer in arrays of shape ``(num_experts, *expert_shape)``, expert e at row e, so that
each chunk's MoE call is stock's own ``SwitchGLU`` call over them (``LayerSet.call``): the same
rows, the same arrays' bytes, the same bits on every backend, with no padding and no waves.

Two sets take turns (``LayerSets``): while the layer being computed runs over one, the next MoE
layer's experts are read into the other on a bank thread (``fill``; ``take`` waits for it). An
expert that the layer's slot bank holds is copied from the bank's memory where both are written by
the host (the CPU backend), else read; every other expert is read once. After the layer, its slot
bank is given the experts that the prompt used most there (``keep``: copied from the set by an MLX
update, not read): those the last token's step and decode likely want.

Writing a set's memory from the host is safe as a direct read into a bank is (the unit's
docstring): a set is filled again only once every computation over it was evaluated
(``layer_major`` evaluates each chunk's layer output before it goes on).

Part of the bank unit: ``LayerSets`` is driven by ``layer_major`` on the thread that prefills.
"""

import threading
import time
from concurrent.futures import wait
from typing import List, Optional

import mlx.core as mx
import numpy as np

from ...errors import StreamingError
from ..reads.bank_reads import _runs
from ..reads.host_views import host_address, host_bytes
from ..reads.safetensors_header import mx_dtype
from . import cuda_copy


# ``CacheTuning.set_stage``: where a fill through device copies reads to first
STAGES = {"device": cuda_copy.DeviceStage, "host": cuda_copy.HostStage}


def set_bytes(bank) -> int:
    """What one set of ``bank``'s layer takes: every expert of the layer."""
    return bank.num_experts * bank.layer.expert_nbytes


def largest_set(banks) -> int:
    """What a prompt's set takes: the largest of ``banks``' layers' sets."""
    return max((set_bytes(b) for b in banks), default=0)


def with_stage(nbytes: int, banks) -> bool:
    """Whether ``nbytes`` (``machine.layer_sets_fit``'s) count a stage on the device beside the
    two sets: three sets' bytes."""
    return nbytes > 2 * largest_set(banks)


class LayerSet:
    """One layer's whole expert set (module docstring): the arrays, their host views, the fill."""

    def __init__(self, cache, owner=None):
        self.cache = cache  # the model's ExpertCache (its store, bank threads, tuning)
        self.owner = owner  # the ``LayerSets`` whose stage a fill through device copies uses
        self.staged = None  # experts the last fill left in the stage, moved in by ``ready``
        self.bank = None  # the slot bank whose layer the set holds, or is being filled with
        self.shapes = None  # ((num_experts, *shape), dtype) of each part the arrays were made for
        self.arrays: List[mx.array] = []
        self.views: Optional[List[np.ndarray]] = None
        self.addresses: Optional[List[int]] = None
        self.copier = None  # on mlx-cuda, the writer of reads by device copies (``cuda_copy``)
        self.future = None  # the fill running on a bank thread
        # experts read from the store, and copied from the slot bank, by this set's fills
        self.read = 0
        self.copied = 0

    def allocate(self, bank) -> bool:
        """Arrays for ``bank``'s layer (kept where the last layer's parts had the same shapes),
        evaluated on this thread, and their host views; whether the set can be written so."""
        shapes = [((bank.num_experts, *p.shape), p.dtype) for p in bank.layer.parts]
        if shapes != self.shapes:
            self.arrays, self.views = [], None  # the old memory first
            self.arrays = [mx.zeros(shape, dtype=mx_dtype(dtype)) for shape, dtype in shapes]
            mx.eval(self.arrays)
            self.shapes = shapes
            self._make_views()
        return self.views is not None

    def _make_views(self) -> None:
        """Host views of the arrays as they are now (remade only where an MLX update moved them:
        a view's check writes a byte from the host, which on mlx-cuda migrates the page from the
        device and back, every layer where it ran on each fill)."""
        addresses = [host_address(a) for a in self.arrays]
        if self.views is not None and addresses == self.addresses:
            return
        views = None
        if None not in addresses:
            views = [host_bytes(a, at) for a, at in zip(self.arrays, addresses)]
            if any(v is None for v in views):
                views = None
        self.views, self.addresses = views, addresses
        self.copier = None
        if views is not None and self.cache.tuning.device_copies:
            self.copier = cuda_copy.copier_for(addresses)

    def fill(self, bank) -> None:
        """Start making every expert of ``bank``'s layer resident in the set, on a bank thread
        (``allocate`` first, on this thread); ``ready`` waits for it. The experts the slot bank
        holds are copied from it: through host views on that thread where the host writes both
        (the CPU), else here by an MLX update (on a GPU: a device copy, no read)."""
        self.ready()
        self.bank = bank
        host = bank.views is not None and bank.copier is None and self.copier is None
        held = set() if host else self._copy_on_device(bank)
        self.future = self.cache.set_pool.submit(self._fill, bank, host, held)

    def _copy_on_device(self, bank) -> set:
        """The experts ``bank`` holds, copied into their rows by an MLX update, evaluated (every
        computation over the set was); the views remade where it moved the arrays."""
        with bank.lock:
            held = np.nonzero(bank.slot_of >= 0)[0]
            tier = self.cache.tiers.banks.get(id(bank)) if self.cache.tiers is not None else None
            if tier is not None:  # two tiers: the device tier's; the host tier's read once
                held = held[tier.device[held]]  # (``CacheTuning.tier_layer_sets``)
            if not len(held):
                return set()
            rows, slots = mx.array(held), mx.array(bank.slot_of[held])
            for i, p in enumerate(bank.layer.parts):
                self.arrays[i][rows] = bank.array(p.proj, p.part)[slots]
            mx.eval(self.arrays)
        self._make_views()
        self.copied += len(held)
        return set(held.tolist())

    def ready(self) -> None:
        """Wait for the fill; its error, if it failed, raised here."""
        future, self.future = self.future, None
        if future is not None:
            future.result()
        staged, self.staged = self.staged, None
        if staged:
            start = time.perf_counter()
            rows = [view.shape[1] for view in self.views]
            offsets = stage_offsets(rows, self.views[0].shape[0])
            self.owner.stage.move(stage_moves(staged, self.addresses, rows, offsets))
            self.cache.timeline.span("move layer set", start, "copy", layer=self.bank.path,
                                     experts=len(staged))  # fmt: skip

    def _fill(self, bank, host: bool, held: set) -> None:
        start = time.perf_counter()
        experts = range(bank.num_experts)
        if host:  # the slot bank's experts copied through the host views
            with bank.lock:
                slots = {e: int(s) for e in experts if (s := bank.slot_of[e]) >= 0}
                for e, slot in slots.items():
                    for view, source in zip(self.views, bank.views):
                        view[e] = source[slot]
            held = set(slots)
            self.copied += len(held)
        rest = [e for e in experts if e not in held]
        store, refs = self.cache.store, bank.layer.refs
        rows = [view.shape[1] for view in self.views]
        stage = None  # (``CacheTuning.set_stage``: where the reads go first, moved in by ``ready``)
        if self.copier is not None and self.owner is not None:
            stage = self.owner.staging(self.copier)
        if self.copier is not None and not (stage is not None and stage.host):
            # each thread reads whole experts into its own page-locked buffer, then the device
            # copies: ``set_readers`` threads at once, so that reads and copies overlap (more
            # threads queue more small copies: 10.3 GB/s at 16 against 15.7 at 8 on the H200)
            tuning = self.cache.tuning
            readers = tuning.set_readers or tuning.reads_in_flight or store.threads
            parts = max(1, min(len(rest), readers))
            pool = self.cache.demand_pool
            targets = self.addresses  # (the set's, or a device stage's)
            if stage is not None:
                targets = [stage.base + at for at in stage_offsets(rows, len(experts))]
            futures = [
                pool.submit(self.copier.read, store.read_on_this_thread, pieces)
                for pieces in by_expert(rest, refs, targets, rows, parts)
            ]
            for future in futures:
                future.result()
        elif rest:  # through host views: the set's (the CPU), or a host stage's
            views = self.views if stage is None else stage_views(stage, rows, len(experts))
            store.read_many(
                [(ref, memoryview(views[i][e])) for e in rest for i, ref in enumerate(refs(e))]
            )
        if stage is not None:
            self.staged = rest  # (moved into the set by ``ready``, the device idle)
        self.read += len(rest)
        self.cache.timeline.span(
            "fill layer set", start, "read", layer=bank.path, read=len(rest), copied=len(held)
        )

    def call(self, module, x, indices):
        """Stock's ``SwitchGLU`` call of ``module``'s layer over the set: the bank's stock module
        given the set's arrays for the call's graph, its slot arrays put back after."""
        bank = module.bank
        glu, parts = bank.glu, bank.layer.parts
        with bank.lock:
            slots = [glu[p.proj][p.part] for p in parts]
            try:
                for p, arr in zip(parts, self.arrays):
                    glu[p.proj][p.part] = arr
                return glu(x, indices)
            finally:
                for p, arr in zip(parts, slots):
                    glu[p.proj][p.part] = arr

    def release(self) -> None:
        """The memory given back, once a running fill ended (an error of one that no layer took
        is moot: the prompt ended, or failed on another error)."""
        future, self.future = self.future, None
        if future is not None:
            wait([future])
        self.staged = None
        self.bank, self.shapes, self.arrays, self.views, self.copier = None, None, [], None, None


def by_expert(experts, refs, addresses, row_bytes, parts: int) -> list:
    """``experts`` dealt out whole to ``parts`` readers, a run of consecutive experts each: per
    reader, ``(ref, address)`` for each range of its experts (``refs(e)``, part i at
    ``addresses[i] + e * row_bytes[i]``), part by part, each part's experts in order. Consecutive
    experts' ranges of one tensor follow each other in the file, so the store reads them in one go
    (``stores.safetensors.runs``), and in the set too, so the copier copies them in one go
    (``cuda_copy._spans``: expert by expert a layer took ~1,150 copies, two thirds of them a
    scale's or bias's 49 KB on Qwen3-30B-A3B); dealt every 8th range of the layer, each thread read
    one range of many experts, each alone. The H200's ram probe: page cache to slots with whole
    experts per thread 3.5-4.7 GB/s at 8 threads ("slots k8"), 2.3-2.5 with each expert's ranges
    spread over the readers ("slots k8 spread"; docs/benchmarks/prefill.md)."""
    experts = list(experts)
    bounds = [len(experts) * k // parts for k in range(parts + 1)]
    out = []
    for k in range(parts):
        mine = experts[bounds[k] : bounds[k + 1]]
        per_expert = [refs(e) for e in mine]
        out.append([
            (ref[i], addresses[i] + e * row_bytes[i])
            for i in range(len(addresses))
            for e, ref in zip(mine, per_expert)
        ])  # fmt: skip
    return out


def stage_offsets(row_bytes, num_experts: int) -> List[int]:
    """Where each part of a set of ``num_experts`` rows of ``row_bytes`` lies in a stage (the
    parts one after the other, as laid out for ``stage_moves``)."""
    at = [0]
    for n in row_bytes[:-1]:
        at.append(at[-1] + num_experts * n)
    return at


def stage_views(stage, row_bytes, num_experts: int) -> List[np.ndarray]:
    """A host stage's parts as ``(num_experts, row bytes)`` arrays."""
    data = stage.view()
    return [
        data[at : at + num_experts * n].reshape(num_experts, n)
        for at, n in zip(stage_offsets(row_bytes, num_experts), row_bytes)
    ]


def stage_moves(experts, addresses, row_bytes, offsets) -> list:
    """``(address, stage offset, bytes)`` of the copies that move ``experts`` from a stage laid
    out as the set (part i at ``offsets[i]``, expert e at row e) into the set's parts at
    ``addresses``: a copy per part and run of consecutive experts."""
    runs = _runs(list(experts), list(experts))
    return [
        (address + e * n, at + e * n, k * n)
        for address, n, at in zip(addresses, row_bytes, offsets)
        for e, _, k in runs
    ]


def expert_counts(ids, n: int) -> mx.array:
    """How many of the router's ``ids`` (a chunk's MoE calls') name each of ``n`` experts, as an
    MLX graph (a scatter-add of ones: integer counts, exact)."""
    counts = mx.zeros((n,), dtype=mx.int32)
    for idx in ids:
        counts = counts.at[idx.reshape(-1)].add(1)
    return counts


def keep(bank, layer_set: LayerSet, uses: np.ndarray) -> int:
    """Give ``bank``'s slots the experts the prompt used most (``uses``: its count per expert),
    copied from ``layer_set`` by an MLX update of each run of slots, in place (every computation
    over the bank was evaluated): a use of them for the eviction policy, no read. The experts
    copied."""
    want = np.argsort(-uses, kind="stable")[: bank.slots]
    want = want[uses[want] > 0].astype(np.int64)
    start = time.perf_counter()
    with bank.lock:
        if bank.staged:
            bank.discard_staged()  # (never installed over what the set gave)
        missing, slots, _ = bank.table.admit(want)
        if not len(missing):
            return 0
        order = np.argsort(slots, kind="stable")
        runs = _runs(missing[order].tolist(), slots[order].tolist())
        parts = bank.layer.parts
        for p, source in zip(parts, layer_set.arrays):
            target = bank.array(p.proj, p.part)
            for r, s, n in runs:
                target[s : s + n] = source[r : r + n]
        mx.eval([bank.array(p.proj, p.part) for p in parts])  # (on this thread: ``allocate``)
        if bank.views is not None:
            bank.refresh_views()
        bank.table.place(missing, slots)
    bank.cache.timeline.span("install", start, "install", layer=bank.path, experts=len(missing))
    return len(missing)


class LayerSets:
    """The two sets of a long prompt's prefill (module docstring), made at the prompt's first
    layer and released at its end; ``nbytes``: what both take at most, beside the budget, a
    stage on the device included (three sets' bytes: ``machine.layer_sets_fit``)."""

    def __init__(self, cache, nbytes: int):
        self.cache = cache
        self.nbytes = nbytes
        self.staged = with_stage(nbytes, cache.banks)  # (a stage only where the check counted it)
        self.sets = [LayerSet(cache, self), LayerSet(cache, self)]
        self.lock = threading.Lock()
        # on mlx-cuda, where fills copy through a reader's page-locked buffer: the memory those
        # reads go to first (``CacheTuning.set_stage``: "device", ``cuda_copy.DeviceStage``;
        # "host", ``cuda_copy.HostStage``), one set's bytes, made on the first fill
        self.stage = None
        self.unstaged = False  # (the stage could not be made: this prompt fills without one)
        # experts read and copied into sets, and copied from them into slot banks, in all
        self.read = self.copied = self.kept = 0

    def staging(self, copier):
        """The stage a fill through ``copier`` copies into (made now if none), or None where
        ``CacheTuning.set_stage`` is None. Filled by one fill at a time: a set's ``ready`` moves
        its experts out before the other set's fill starts (``take``)."""
        kind = self.cache.tuning.set_stage
        if kind not in STAGES or self.unstaged or (kind == "device" and not self.staged):
            return None
        with self.lock:
            if self.stage is None:
                try:
                    self.stage = STAGES[kind](copier.lib, largest_set(self.cache.banks))
                except MemoryError:  # (no room on the device: the prompt's fills go straight in)
                    self.unstaged = True
        return self.stage

    def writable(self, bank) -> bool:
        """Whether a set for ``bank``'s layer can be written by the host here (allocated now)."""
        return self.sets[0].allocate(bank)

    def take(self, bank, after=None) -> Optional[LayerSet]:
        """The set holding ``bank``'s layer, filled (a fill started now if none was), with the
        next MoE layer's (``after``'s) fill started in the other set once it is, to run while this
        layer computes (not before: the two would share the disk while this layer waits); ``bank``
        None (a layer with no streamed experts): only that fill, and None."""
        current = None
        if bank is not None:
            current = self._holding(bank) or self._fill(self._free(), bank)
            if after is not None and self._holding(after) is None:
                # the other set's memory made while this fill runs (the prompt's first layer:
                # ~20 ms on the H200 between the first set's move and the second's fill)
                self._free(current).allocate(after)
            start = self.cache.timeline.now()
            current.ready()
            self.cache.timeline.span("wait for layer set", start, "wait", layer=bank.path)
        if after is not None and self._holding(after) is None:
            self._fill(self._free(current), after)
        return current

    def done(self, layer_set: LayerSet, uses: np.ndarray) -> None:
        """The prompt's group is through the set's layer: its slot bank keeps the most used
        experts; the set is free for another layer."""
        self.kept += keep(layer_set.bank, layer_set, uses)
        layer_set.bank = None

    def _holding(self, bank) -> Optional[LayerSet]:
        for s in self.sets:
            if s.bank is bank:
                return s
        return None

    def _free(self, besides=None) -> LayerSet:
        """A set that holds no layer (every layer but the one computing is done), not ``besides``."""
        return next(s for s in self.sets if s.bank is None and s is not besides)

    def _fill(self, layer_set: LayerSet, bank) -> LayerSet:
        layer_set.ready()
        if not layer_set.allocate(bank):
            raise StreamingError(
                f"{bank.path}: a layer set's memory has no host view here: turn layer-major "
                "prefill off (--layer-major-prefill off)"
            )
        layer_set.fill(bank)
        return layer_set

    def release(self) -> None:
        """The prompt's end: both sets' memory given back, their counts kept."""
        for s in self.sets:
            s.release()
            self.read += s.read
            self.copied += s.copied
            s.read = s.copied = 0
        stage, self.stage = self.stage, None
        if stage is not None:
            stage.close()
