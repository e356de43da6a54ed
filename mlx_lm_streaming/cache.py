"""Expert cache: a byte budget split into per-layer slot banks.

Each MoE layer owns a ``LayerBank``: for every tensor of an expert (``gate_proj.weight``,
``gate_proj.scales``, ...) one array of shape ``(slots, *expert_shape)``. The stock mlx-lm
``SwitchGLU`` of the layer keeps its own code, activation and quantization settings; only its arrays
are swapped for the banks. The router's expert ids become slot ids (``slot_of[expert]``) passed to
``gather_qmm`` as data, so nothing is stacked or rebuilt per token.

Loading experts into slots never evicts an expert the current call pins (the experts it is about to
compute). The budget is global: every layer gets the same number of slots,
``budget // sum(bytes of one expert of each layer)``, at most the layer's expert count, and what that
leaves of the budget gives one more slot to layers in model order while it lasts.

A bank with a slot per expert (``slots == num_experts``) maps expert ``e`` to slot ``e`` (identity):
once every expert of the layer is resident the bank is ``complete``, and the layer passes the router's
indices straight to the kernel with no host sync, the same graph as stock. Such a bank is filled in the
background (``prefetch``). Background reads (lookahead, next wave, fill) land in staging buffers and are
written into the banks only by ``load``, on the thread that calls the layer.

Demand reads go straight into the banks (``direct reads``): the store reads each missed expert into its
slot's memory through a host view of the bank, on reader threads, and ``load`` reports each expert as it
lands (``ready``), so the layer computes that expert's rows while the others are still read, and no
staging buffer or copy is needed. Writing bank memory behind MLX's back is safe only when no pending
MLX work reads the slot being written: the victims are never slots the call uses, and every call that
used the bank was submitted (``mx.async_eval``) on the same stream before this call's host sync, which
waits for it (a call on another stream first synchronizes that one). Where that cannot be known
(a second thread uses the model) or MLX memory has no host view, reads go through staging buffers and
MLX's own copy-on-write slice updates, as before.
"""

import math
import queue
import re
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import mlx.core as mx
import numpy as np

from . import cuda_uvm
from .errors import ConfigurationError, ExpertIOError
from .index import PROJECTIONS, LayerExperts
from .prefetch import FILL, ExpertPrefetcher, StagedBatch, host_address, host_bytes

GB = 1 << 30
# staging buffers (background reads, and without direct reads demand reads per chunk) are bounded by
# this share of the budget; without direct reads they hold at least two experts (demand reads and the
# next wave go through them), with direct reads nothing needs them: a lookahead that does not fit is
# not read. Peak memory stays within ~2x this over the budget
STAGING_SHARE = 0.05
# the order in which a phased direct read (``LayerBank._read_direct``) reads an expert's projections:
# the two the layer can compute from its input first, the one that needs both last
PHASE_ORDER = ("gate_proj", "up_proj", "down_proj")
# experts this big and bigger are read a projection at a time (``ExpertCache.phase_min_bytes``)
PHASE_MIN_BYTES = 16 << 20
assert sorted(PHASE_ORDER) == sorted(PROJECTIONS)
# every cache that may have background threads, for ``close_all`` at interpreter exit
_LIVE: "weakref.WeakSet[ExpertCache]" = weakref.WeakSet()


@dataclass
class CacheStats:
    """Expert requests served from the banks (hits) or read from the store (misses)."""

    hits: int = 0
    misses: int = 0
    evictions: int = 0
    # seconds the calling thread waited for expert bytes (reads and staged reads), and spent
    # writing them into the banks
    io_wait_seconds: float = 0.0
    install_seconds: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, hits: int, misses: int, evictions: int) -> None:
        with self.lock:
            self.hits += hits
            self.misses += misses
            self.evictions += evictions

    def add_time(self, io_wait: float, install: float) -> None:
        with self.lock:
            self.io_wait_seconds += io_wait
            self.install_seconds += install


class LayerBank:
    """Slot bank of one MoE layer, wrapped around that layer's stock ``SwitchGLU``."""

    def __init__(self, cache: "ExpertCache", layer: LayerExperts, glu):
        self.cache = cache
        self.layer = layer
        self.glu = glu  # the stock SwitchGLU whose arrays become our banks
        self.num_experts = layer.num_experts
        self.slots = 0
        self.slot_of = np.full(layer.num_experts, -1, dtype=np.int64)
        self.expert_of = np.zeros(0, dtype=np.int64)
        self.last_used = np.zeros(0, dtype=np.int64)
        self.lock = threading.RLock()
        # slots == num_experts: expert e lives in slot e; complete once all are resident
        self.identity = False
        self.complete = False
        # expert -> StagedBatch read in the background, written into a slot by ``load``
        self.staged: Dict[int, StagedBatch] = {}
        # x -> router logits of this layer (for lookahead from the layer before), or None
        self.router = None
        self.while_reading = None  # see ``load``
        # writable host views of the banks' memory, one (slots, bytes) uint8 array per part, and the
        # addresses they were made for; None where MLX memory has none (see ``_refresh_views``)
        self.views: Optional[List[np.ndarray]] = None
        self._addresses: Optional[List[int]] = None
        # the stream of the last call that used the bank (see the module docstring)
        self.last_stream = None
        # the previous layer's guess of this layer's misses, scored at the next load; a running
        # precision decides whether guesses are read or only scored
        self.predicted: Optional[set] = None
        # guesses are scored from the first call but read only once their running precision
        # reaches ``lookahead_min_precision`` (four good calls in a row from 0): wrong guesses
        # would cost staging memory and disk time before the layer has shown it can guess
        self.ahead_precision = 0.0
        self._fill_requested = False

    @property
    def path(self) -> str:
        return self.layer.path

    def allocate(self, slots: int) -> None:
        """Give the bank ``slots`` slots, zeroed.

        The banks are evaluated here and after every update: MLX ties a lazy array to the stream of
        the thread that built it, and evaluating it from another thread fails ("There is no Stream(cpu,
        N) in current thread"), so a bank must never be left lazy for the next caller's thread.
        """
        with self.lock:
            self._drop_staged(everything=True)
        self.predicted = None
        self.ahead_precision = 0.0
        self.slots = slots
        self.identity = slots == self.num_experts
        self.complete = False
        self._fill_requested = False
        self.slot_of[:] = -1
        self.expert_of = np.full(slots, -1, dtype=np.int64)
        self.last_used = np.full(slots, -1, dtype=np.int64)
        for spec in self.layer.parts:
            proj = self.glu[spec.proj]
            proj[spec.part] = mx.zeros((slots, *spec.shape), dtype=_mx_dtype(spec.dtype))
        mx.eval([self.array(spec.proj, spec.part) for spec in self.layer.parts])
        self.views = self._addresses = None
        self.last_stream = None
        self._refresh_views()

    def _refresh_views(self) -> None:
        """Host views of the banks, remade if MLX moved a bank to new memory (an update that could
        not be done in place). Called after every MLX update of the banks; views are used only under
        ``lock``, so a stale one is never written through."""
        if self.slots == 0 or not self.cache.direct_reads:
            self.views = self._addresses = None
            return
        arrays = [self.array(spec.proj, spec.part) for spec in self.layer.parts]
        addresses = [host_address(a) for a in arrays]
        if self.views is not None and addresses == self._addresses:
            return
        views = (
            [host_bytes(a, at) for a, at in zip(arrays, addresses)]
            if None not in addresses
            else None
        )
        if views is None or any(v is None for v in views):
            self.views = self._addresses = None
            return
        self.views, self._addresses = views, addresses
        if self.cache.uvm == "host" and not self.identity:
            for a, at in zip(arrays, addresses):
                cuda_uvm.prefer_host(at, a.nbytes)

    def array(self, proj: str, part: str) -> mx.array:
        return self.glu[proj][part]

    @property
    def resident_bytes(self) -> int:
        return self.slots * self.layer.expert_nbytes

    def load(self, experts: np.ndarray, ready=None, keep=(), part_ready=None) -> None:
        """Make every expert in ``experts`` (unique ids, at most ``slots``) resident.

        ``ready(ids)``: called (on this thread) with the experts that were read, as they become
        resident (with direct reads, one expert or a few at a time while the others are still being
        read; else all at once). ``keep``: expert ids that must not be evicted either (the experts of
        a wave still computing). ``part_ready(expert, slot, proj)``: with direct reads, experts are
        read one projection at a time and this is called as each but the last lands (before the
        expert is resident: its slot holds that projection's bytes only). ``self.while_reading``,
        if the caller (holding ``lock``) set it: called once the experts already resident are pinned
        and before the others are read, when there are both (the layer computes its hit rows
        meanwhile); it may return a function that waits for that work, called before any slot is
        written with an MLX update (an update of a bank that pending work reads copies the bank)."""
        while_reading, self.while_reading = self.while_reading, None
        self.cache.ensure_planned()
        if len(experts) > self.slots:
            raise ValueError(
                f"{self.path}: {len(experts)} experts asked for at once but the bank has "
                f"{self.slots} slots"
            )
        with self.lock:
            tick = self.cache.tick()
            if self.identity and self.staged and ready is None:
                # (a caller passing ``ready`` has work pending on the bank: it did this before)
                self._install_finished()
            slots = self.slot_of[experts]
            hit = slots >= 0
            self.last_used[slots[hit]] = tick
            missing = experts[~hit]
            if self.predicted is not None:
                self._score_guess(missing)
            evicted = 0
            if len(missing):
                if self.identity:
                    victims = missing.copy()
                else:
                    # victims: free slots first, then least recently used; pinned slots never
                    priority = self.last_used.copy()
                    priority[slots[hit]] = np.iinfo(np.int64).max
                    if len(keep):
                        kept = self.slot_of[np.asarray(keep, dtype=np.int64)]
                        priority[kept[kept >= 0]] = np.iinfo(np.int64).max
                    victims = np.argsort(priority, kind="stable")[: len(missing)]
                    if (priority[victims] == np.iinfo(np.int64).max).any():
                        raise ValueError(
                            f"{self.path}: {len(missing)} experts to read but fewer slots are "
                            "free of pinned and kept experts"
                        )
                old = self.expert_of[victims]
                evicted = int((old >= 0).sum())
                self.slot_of[old[old >= 0]] = -1
                # free before reading: if the read fails, no slot may still name an evicted expert
                # (evicting that slot later would unmap the expert from wherever it lives by then)
                self.expert_of[victims] = -1
                self.last_used[victims] = -1
                waiter = while_reading() if while_reading is not None and hit.any() else None
                self._read_into_slots(
                    missing, victims, tick, before_install=waiter, ready=ready, part_ready=part_ready
                )
            self.cache.stats.add(int(hit.sum()), len(missing), evicted)
            if self.identity and not self.complete:
                self.complete = bool((self.slot_of >= 0).all())

    def _score_guess(self, missing: np.ndarray) -> None:
        guess, self.predicted = self.predicted, None
        hit = len(guess.intersection(missing.tolist()))
        stats = self.cache.prefetch_stats
        with stats.lock:
            stats.predicted += len(guess)
            stats.predicted_hit += hit
            stats.demand += len(missing)
        if guess:
            self.ahead_precision += 0.2 * (hit / len(guess) - self.ahead_precision)

    def _read_into_slots(
        self,
        experts: np.ndarray,
        slots: np.ndarray,
        tick: int,
        before_install=None,
        ready=None,
        part_ready=None,
    ) -> None:
        """Bytes from staged background reads where there are, from the store for the rest; each
        expert is mapped to its slot once its bytes are there, and reported to ``ready``."""
        start = time.perf_counter()
        stats = self.cache.prefetch_stats
        groups = []  # (batch, rows of the batch, slots)
        rest = []
        by_batch: Dict[int, tuple] = {}
        popped: Dict[int, StagedBatch] = {}
        for e, slot in zip(experts.tolist(), slots.tolist()):
            batch = self.staged.pop(e, None)
            if batch is not None:
                popped[id(batch)] = batch
                waited = time.perf_counter()
                good = batch.ok(wait=True)
                with stats.lock:
                    stats.waited_s += time.perf_counter() - waited
                if good:
                    by_batch.setdefault(id(batch), (batch, [], []))
                    by_batch[id(batch)][1].append(batch.row[e])
                    by_batch[id(batch)][2].append(slot)
                    stats.add("used", batch.kind, 1)
                    continue
            rest.append((e, slot))
        groups.extend(by_batch.values())
        io = time.perf_counter() - start
        install = 0.0
        wait_first = [before_install]

        def resident(pairs):
            ids = [e for e, _ in pairs]
            self.slot_of[ids] = [s for _, s in pairs]
            self.expert_of[[s for _, s in pairs]] = ids
            self.last_used[[s for _, s in pairs]] = tick
            if ready is not None:
                ready(ids)

        def write(groups):
            nonlocal install
            if wait_first[0] is not None:
                done, wait_first[0] = wait_first[0], None
                done()
            t = time.perf_counter()
            self._install(groups)
            install += time.perf_counter() - t
            for batch, rows, group_slots in groups:
                resident([(int(batch.experts[r]), s) for r, s in zip(rows, group_slots)])

        try:
            if self.direct:
                # staged ones first: their MLX update must not race with the direct writes
                if groups:
                    write(groups)
                    groups = []
                io += self._read_direct(rest, resident, part_ready)
            else:
                # the rest from the store, in chunks of at most the staging bound (a prefill wave
                # can miss a whole bank's worth of experts: its bytes need not all be staged at once)
                chunk = max(1, self.cache.staging_limit // max(1, self.layer.expert_nbytes))
                for i in range(0, len(rest), chunk):
                    part = rest[i : i + chunk]
                    t = time.perf_counter()
                    batch = StagedBatch(self.layer, np.array([e for e, _ in part]), "demand")
                    self.cache.store.read_many(batch.jobs())
                    io += time.perf_counter() - t
                    if groups:  # staged ones after the first read: it overlaps the layer's work
                        write(groups)
                        groups = []
                    write([(batch, list(range(len(part))), [s for _, s in part])])
                    del batch
                if groups:
                    write(groups)
        finally:
            still = {id(b) for b in self.staged.values()}
            for key, batch in popped.items():
                if key not in still:
                    self.cache.release(batch)
            self.cache.stats.add_time(io, install)

    @property
    def direct(self) -> bool:
        """Whether demand reads go straight into the banks' memory now (module docstring)."""
        return self.views is not None and self.cache.direct_reads and not self.cache.shared

    def _read_direct(self, pairs, resident, part_landed=None) -> float:
        """Read each ``(expert, slot)`` into the slot's memory, in parallel; report each expert to
        ``resident`` as it lands. Every read has ended when this returns, also on error (the first
        error is raised then; experts that landed stay resident). Returns the seconds waited.

        ``part_landed(expert, slot, proj)``, if given: each expert is read one projection at a time, in
        ``PHASE_ORDER``, and this is called (on this thread) as each projection but the last lands,
        so that the caller can start computing it (``StreamingSwitchGLU._as_they_land``)."""
        if not pairs:
            return 0.0
        stream = self.last_stream
        if stream is not None and stream != mx.default_stream(mx.default_device()):
            mx.synchronize(stream)  # work of the previous call, if on another stream, has ended
        views, refs, parts = self.views, self.layer.refs, self.layer.parts
        store = self.cache.store
        prefetch = self.cache.uvm == "prefetch"
        if part_landed is None:
            groups = [(None, list(range(len(parts))))]
        else:
            groups = [
                (proj, [i for i, spec in enumerate(parts) if spec.proj == proj])
                for proj in PHASE_ORDER
            ]
        events: "queue.SimpleQueue" = queue.SimpleQueue()

        def read(pair):
            e, slot = pair
            try:
                expert_refs = refs(e)
                for g, (proj, members) in enumerate(groups):
                    store.read_many([(expert_refs[i], memoryview(views[i][slot])) for i in members])
                    if g < len(groups) - 1:
                        events.put((pair, proj, None))
                if prefetch:
                    for v in views:
                        cuda_uvm.prefetch(v[slot].ctypes.data, v.shape[1])
            except BaseException as exc:
                events.put((pair, None, exc))
                return
            events.put((pair, None, None))

        def read_in_turn(batch):
            for pair in batch:
                read(pair)

        def cancelled(future, batch):
            # reads that never ran (their pool shut down with cancel_futures) still report
            if future.cancelled():
                for pair in batch:
                    error = ExpertIOError(f"{self.path}: the read of expert {pair[0]} was cancelled")
                    events.put((pair, None, error))

        # experts in parallel, one thread each; a projection at a time, one expert after the other, so
        # that the first expert's projections land first rather than share the disk with the others'
        # (the store still reads a projection's parts in parallel)
        batches = [[p] for p in pairs] if part_landed is None else [list(pairs)]
        pool = self.cache.demand_pool
        for batch in batches:
            pool.submit(read_in_turn, batch).add_done_callback(lambda f, b=batch: cancelled(f, b))
        pending, error, waited = len(pairs), None, 0.0
        while pending:
            t = time.perf_counter()
            pair, proj, exc = events.get()
            waited += time.perf_counter() - t
            if proj is not None:
                if error is None:
                    try:
                        part_landed(*pair, proj)
                    except BaseException as e:  # still wait for every read before raising
                        error = e
                continue
            pending -= 1
            if exc is not None:
                error = error or exc
            elif error is None:
                try:
                    resident([pair])
                except BaseException as e:
                    error = e
        if error is not None:
            raise error
        return waited

    def _install(self, groups) -> None:
        """Write staged rows into slots, one slice copy per run of consecutive slots, then evaluate.

        Slice copies run at memcpy speed on the CPU backend; a scatter with a slot index array was
        measured ~7x slower (8 slots of 786 KB: 10 ms vs 1.4 ms)."""
        parts = self.layer.parts
        for batch, rows, slots in groups:
            runs = _runs(rows, slots)
            total = len(batch.experts)
            for i, spec in enumerate(parts):
                values = batch.part(i).view(_mx_dtype(spec.dtype)).reshape(total, *spec.shape)
                bank = self.array(spec.proj, spec.part)
                for r, s, n in runs:
                    # in place: the SwitchGLU's own array object is updated
                    bank[s : s + n] = values[r : r + n]
        # evaluated now, in this thread (see ``allocate``)
        mx.eval([self.array(spec.proj, spec.part) for spec in parts])
        if self.views is not None:
            self._refresh_views()

    def _install_finished(self) -> None:
        """Identity banks: write every finished staged expert into its own slot."""
        start = time.perf_counter()
        stats = self.cache.prefetch_stats
        batches = {id(b): b for b in self.staged.values()}
        groups, done = [], []
        for batch in batches.values():
            if not batch.future.done():
                continue
            done.append(batch)
            if not batch.ok(wait=False):
                continue  # a failed background read: those experts are read on demand
            rows = [
                i
                for i, e in enumerate(batch.experts.tolist())
                if self.staged.get(e) is batch and self.slot_of[e] < 0
            ]
            if rows:
                experts = batch.experts[rows]
                groups.append((batch, rows, experts.tolist()))
                self.slot_of[experts] = experts
                self.expert_of[experts] = experts
                self.last_used[experts] = self.cache.tick()
                stats.add("used", batch.kind, len(rows))
        for batch in done:
            for e in batch.experts.tolist():
                if self.staged.get(e) is batch:
                    del self.staged[e]
        if groups:
            self._install(groups)
        for batch in done:
            self.cache.release(batch)
        if groups:
            self.cache.stats.add_time(0.0, time.perf_counter() - start)

    def stage(
        self, experts: np.ndarray, kind: str, priority: int, block: bool = False, fit: bool = False
    ) -> int:
        """Start background reads of those ``experts`` that are neither resident nor staged.

        ``fit``: read only as many as the staging bound has room for now (else all or nothing)."""
        with self.lock:
            if self.slots == 0:
                return 0
            experts = np.asarray(experts, dtype=np.int64)
            want = [e for e in experts.tolist() if self.slot_of[e] < 0 and e not in self.staged]
            if not want:
                return 0
            if not self.identity:
                # never more than the slots: more could not be resident at once
                want = want[: self.slots]
        prefetcher = self.cache.prefetcher
        if fit:
            want = want[: max(0, prefetcher.room()) // self.layer.expert_nbytes]
            if not want:
                return 0
        batch = prefetcher.submit(self.layer, np.array(want), kind, priority, block=block)
        if batch is None:
            return 0
        with self.lock:
            for e in want:
                if self.slot_of[e] < 0 and e not in self.staged:
                    self.staged[e] = batch
        return len(want)

    def drop_staged(self) -> None:
        """End of a call: staged experts it did not use are dropped (identity banks keep them)."""
        if self.staged and not self.identity:
            with self.lock:
                self._drop_staged()

    def _drop_staged(self, everything: bool = False) -> None:
        batches = {id(b): b for b in self.staged.values()}
        self.staged.clear()
        for batch in batches.values():
            self.cache.release(batch, when_done=True)


def _runs(rows, slots):
    """``(first row, first slot, length)`` of each run where rows and slots both step by one."""
    runs = []
    for r, s in zip(rows, slots):
        if runs and runs[-1][0] + runs[-1][2] == r and runs[-1][1] + runs[-1][2] == s:
            runs[-1][2] += 1
        else:
            runs.append([r, s, 1])
    return runs


def _mx_dtype(name: str):
    from .index import DTYPES

    return DTYPES[name][0]


class ExpertCache:
    """All slot banks of one model, sharing one byte budget and one store."""

    def __init__(
        self,
        store,
        budget_bytes: Optional[int] = None,
        *,
        lookahead: bool = True,
        fill: bool = True,
        skip_sync: bool = True,
        staging_bytes: Optional[int] = None,
        prefetch_threads: int = 2,
    ):
        self.store = store
        self.budget_bytes = budget_bytes
        self.stats = CacheStats()
        # background reads: next-layer lookahead, filling identity banks; a complete identity bank
        # skips the host sync. Each only moves or drops work; none changes what is computed.
        self.lookahead = lookahead
        # a layer's guesses are read only while their running precision is at least this; below it
        # they are only scored (a wrong guess costs a read: on an I/O-bound machine, a demand read)
        self.lookahead_min_precision = 0.5
        self.fill = fill
        self.skip_sync = skip_sync
        # a layer computes the rows of its resident experts while it reads the others (and, with
        # direct reads, each read expert's rows as it lands)
        self.split_misses = True
        # with direct reads, experts of at least this many bytes are read one projection at a time
        # and each projection's rows computed as it lands (``StreamingSwitchGLU._by_projection``), so
        # that a layer's first missed expert stalls it for one projection's read, not three (only
        # where partial calls are exact, not padded: MLX's CPU backend). None: off. Mixtral-8x7B
        # shape on the CPU, paired probes: 0.95 vs 0.92, 0.93 vs 0.88, 0.88 vs 0.84, 0.91 vs 0.75 of
        # stock (docs/benchmarks/README.md)
        self.phase_min_bytes: Optional[int] = PHASE_MIN_BYTES
        # CUDA unified-memory hints for direct reads (cuda_uvm.py; experimental, benchmarks only):
        # None, "prefetch" (landed experts to the GPU) or "host" (banks stay in host memory)
        self.uvm: Optional[str] = None
        # bound on bytes staged by background reads; None: max(5% of the budget, 2 experts)
        self.staging_bytes = staging_bytes
        self.prefetch_threads = prefetch_threads
        # demand reads straight into the banks (see the module docstring); off: through staging
        self.direct_reads = True
        self._callers: set = set()  # threads that called a layer; direct reads need just one
        self._demand_pool: Optional[ThreadPoolExecutor] = None
        self._prefetcher: Optional[ExpertPrefetcher] = None
        self._filler: Optional[threading.Thread] = None
        self._fill_queue: List[LayerBank] = []
        self._banks: "weakref.WeakSet[LayerBank]" = weakref.WeakSet()
        self._order: Optional[List[LayerBank]] = None
        self._planned = False
        self._tick = 0
        self._lock = threading.Lock()
        self._closed = False
        _LIVE.add(self)

    def register(self, layer: LayerExperts, glu) -> LayerBank:
        bank = LayerBank(self, layer, glu)
        self._banks.add(bank)
        self._planned = False
        self._order = None
        return bank

    def unregister(self, bank: LayerBank) -> None:
        """Drop a bank whose layer left the model (a pipeline stage keeps only its own layers)."""
        self._banks.discard(bank)
        self._planned = False
        self._order = None

    @property
    def banks(self) -> List[LayerBank]:
        """In model order (``layers.2`` before ``layers.10``)."""
        order = self._order
        if order is None:
            order = self._order = sorted(self._banks, key=lambda b: _natural(b.path))
        return list(order)

    def next_bank(self, bank: LayerBank) -> Optional[LayerBank]:
        """The MoE layer after ``bank``'s, in model order."""
        order = self._order if self._order is not None else self.banks
        try:
            i = order.index(bank)
        except ValueError:
            return None
        return order[i + 1] if i + 1 < len(order) else None

    @property
    def shared(self) -> bool:
        """True once layers were called from more than one thread: direct reads are then off."""
        return len(self._callers) > 1

    def note_caller(self) -> None:
        """Record the calling thread (a layer call on a bank that is not complete)."""
        me = threading.get_ident()
        if me not in self._callers:
            with self._lock:
                self._callers.add(me)

    @property
    def demand_pool(self) -> ThreadPoolExecutor:
        """Threads that run the demand reads of one load in parallel, one expert each."""
        if self._demand_pool is None:
            with self._lock:
                if self._closed:
                    raise ExpertIOError("the expert cache is closed (its model was released)")
                if self._demand_pool is None:
                    threads = max(2, int(getattr(self.store, "threads", 4) or 4))
                    self._demand_pool = ThreadPoolExecutor(
                        threads, thread_name_prefix="mlx-lm-streaming-demand"
                    )
        return self._demand_pool

    # -- background reads ------------------------------------------------------------------------

    @property
    def prefetcher(self) -> ExpertPrefetcher:
        if self._prefetcher is None:
            with self._lock:
                if self._prefetcher is None:
                    self._prefetcher = ExpertPrefetcher(
                        self.store, self._staging_limit(), self.prefetch_threads
                    )
                    if self._closed:
                        self._prefetcher.close()
        return self._prefetcher

    @property
    def staging_limit(self) -> int:
        """Bytes of expert staging buffers at once: background reads, and demand reads per chunk."""
        return self._prefetcher.max_bytes if self._prefetcher is not None else self._staging_limit()

    @property
    def prefetch_stats(self):
        return self.prefetcher.stats

    def _staging_limit(self) -> int:
        if self.staging_bytes is not None:
            return int(self.staging_bytes)
        biggest = max((b.layer.expert_nbytes for b in self.banks), default=0)
        budget = self.budget_bytes if self.budget_bytes is not None else self.total_expert_bytes
        floor = 0 if self.direct_reads else 2 * biggest
        return int(max(STAGING_SHARE * budget, floor))

    def release(self, batch: StagedBatch, when_done: bool = False) -> None:
        prefetcher = self._prefetcher
        if prefetcher is None or batch.kind == "demand":
            return
        if when_done:
            batch.future.add_done_callback(lambda _f: prefetcher.release(batch))
        else:
            prefetcher.release(batch)

    def request_fill(self, bank: LayerBank) -> None:
        """Read the rest of an identity bank's experts in the background (low priority)."""
        if not self.fill or bank._fill_requested or self._closed:
            return
        bank._fill_requested = True
        with self._lock:
            self._fill_queue.append(bank)
            if self._filler is None or not self._filler.is_alive():
                self._filler = threading.Thread(
                    target=self._fill_loop, name="mlx-lm-streaming-fill", daemon=True
                )
                self._filler.start()

    def _fill_loop(self) -> None:
        while True:
            with self._lock:
                if self._closed or not self._fill_queue:
                    self._filler = None
                    return
                bank = self._fill_queue.pop(0)
            chunk = max(
                1, min(8, self.prefetcher.max_bytes // max(1, 4 * bank.layer.expert_nbytes))
            )
            with bank.lock:
                todo = [
                    e
                    for e in range(bank.num_experts)
                    if bank.slot_of[e] < 0 and e not in bank.staged
                ]
            for i in range(0, len(todo), chunk):
                if self._closed or not bank.identity:
                    break
                bank.stage(np.array(todo[i : i + chunk]), "fill", FILL, block=True)

    def close(self, wait: bool = True) -> None:
        """Stop background reads (the store is closed by its owner). ``wait=False`` joins no thread:
        for the finalizer that runs when a model is garbage collected, which can run inside another
        thread's start-up, where joining a thread deadlocks (seen: a pytest run hung there)."""
        self._closed = True
        if self._prefetcher is not None:
            self._prefetcher.close(wait=wait)
        with self._lock:
            pool, self._demand_pool = self._demand_pool, None
        if pool is not None:
            pool.shutdown(wait=wait)
        filler = self._filler
        if wait and filler is not None and filler is not threading.current_thread():
            filler.join()

    def tick(self) -> int:
        with self._lock:
            self._tick += 1
            return self._tick

    def ensure_planned(self) -> None:
        if not self._planned:
            with self._lock:
                if not self._planned:
                    self._plan()
                    self._planned = True

    def slots_for_budget(self) -> int:
        banks = self.banks
        per_slot = sum(b.layer.expert_nbytes for b in banks)
        most = max(b.num_experts for b in banks)
        if self.budget_bytes is None:
            return most
        slots = self.budget_bytes // per_slot
        if slots < 1:
            raise ConfigurationError(
                f"expert cache budget of {self.budget_bytes / GB:.3f} GB is below the minimum "
                f"of one expert per MoE layer ({per_slot / GB:.3f} GB for {len(banks)} "
                "layers); raise --expert-cache-gb / expert_cache_gb"
            )
        return min(slots, most)

    def plan_slots(self) -> List[int]:
        """Slots per bank, in model order: ``slots_for_budget()`` each, then what the budget has left
        gives one more slot to layers in model order while it lasts (8 GiB over a 32-layer
        Mixtral-8x7B is 2 slots per layer and 1.44 GiB left: a third slot for 13 layers)."""
        banks = self.banks
        slots = self.slots_for_budget()
        plan = [min(slots, b.num_experts) for b in banks]
        if self.budget_bytes is not None:
            left = self.budget_bytes - sum(n * b.layer.expert_nbytes for n, b in zip(plan, banks))
            for i, b in enumerate(banks):
                if plan[i] < b.num_experts and left >= b.layer.expert_nbytes:
                    plan[i] += 1
                    left -= b.layer.expert_nbytes
        return plan

    def _plan(self) -> None:
        for bank, slots in zip(self.banks, self.plan_slots()):
            bank.allocate(slots)

    @property
    def resident_bytes(self) -> int:
        return sum(b.resident_bytes for b in self.banks)

    @property
    def total_expert_bytes(self) -> int:
        return sum(b.layer.expert_nbytes * b.num_experts for b in self.banks)

    def summary(self) -> Dict[str, float]:
        """Counters for ``--streaming-stats``: hit rate, experts and GB read, seconds in I/O."""
        s, st = self.stats, self.store.stats
        asked = s.hits + s.misses
        return {
            "hit_rate": s.hits / asked if asked else math.nan,
            "hits": s.hits,
            "misses": s.misses,
            "evictions": s.evictions,
            "experts_read": s.misses,
            "gb_read": st.bytes_read / GB,
            "io_seconds": st.seconds,
            "io_wait_seconds": s.io_wait_seconds,
            "install_seconds": s.install_seconds,
            "cache_gb": self.resident_bytes / GB,
            "complete_layers": sum(b.complete for b in self.banks),
            **(self._prefetcher.stats.summary() if self._prefetcher is not None else {}),
        }


def close_all() -> None:
    """Stop every cache's background reads and join their threads (an ``atexit`` handler).

    A daemon thread still inside an MLX call when the interpreter finalizes is ended by Python 3.11
    as it takes the GIL back, and that unwinds through a C++ destructor: ``terminate called without
    an active exception``, exit 134 (docs/reliability.md). A cache whose model was collected with
    ``close(wait=False)`` is here too, for as long as its threads keep it alive."""
    for cache in list(_LIVE):
        cache.close(wait=True)


def _natural(path: str):
    """Sort key that orders ``layers.2`` before ``layers.10``."""
    return [(1, int(p), "") if p.isdigit() else (0, 0, p) for p in re.split(r"(\d+)", path)]
