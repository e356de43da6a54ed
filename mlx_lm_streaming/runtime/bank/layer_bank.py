"""``LayerBank``: one MoE layer's slot bank (the unit's docstring, ``mlx_lm_streaming.runtime.bank``)."""

import threading
import time
from typing import Dict, List, Optional

import mlx.core as mx
import numpy as np

from .. import mlx_shims
from ..policy import SlotTable
from ..reads import lookahead
from ..reads.bank_reads import NOTHING_TO_READ, install_finished, landings
from ..reads.host_views import host_address, host_bytes
from ..reads.index import LayerExperts
from ..reads.prefetch import WAVE, StagedBatch
from ..reads.safetensors_header import mx_dtype
from . import compiled_glu, cuda_copy
from .later_landings import LaterLandings


class LayerBank:
    """Slot bank of one MoE layer, wrapped around that layer's stock ``SwitchGLU``."""

    def __init__(self, cache, layer: LayerExperts, glu):  # cache: expert_cache.ExpertCache
        self.cache = cache
        self.layer = layer
        self.path = layer.path  # (an attribute: the timeline's hooks read it on every call)
        self.glu = glu  # the stock SwitchGLU whose arrays become our banks
        # its call (``CacheTuning.kept_row_indices``: with its rows' indices given below the sort
        # threshold, ``mlx_shims.switch_glu``)
        self.glu_call, self.glu_mapped = glu, None  # (mapped: ``glu_call(x, slots[ids])``)
        if cache.tuning.kept_row_indices and mlx_shims.rows_kept(glu):
            self.glu_call = mlx_shims.switch_glu(glu)
            if compiled_glu.wanted(cache.tuning):
                self.glu_call, self.glu_mapped = compiled_glu.compiled_calls(glu) or (
                    self.glu_call, None)  # fmt: skip
        self.num_experts = layer.num_experts
        self.slots = 0
        # which expert is in which slot, and the eviction policy (``policy.py``)
        self.table = SlotTable(layer.num_experts, cache.policy)
        # ``slot_of[expert]``: the expert's slot, -1 if not resident; ``expert_of[slot]``: the
        # slot's expert, -1 if free: the table's arrays (read-only here: see ``table``)
        self.slot_of, self.expert_of = self.table.slot_of, self.table.expert_of
        self.lock = threading.RLock()
        # slots == num_experts: expert e lives in slot e; complete once all are resident
        self.identity = False
        self.complete = False
        # once complete: the layer's whole call (``complete_call``), or None
        self.stock_call = None
        # expert -> StagedBatch read in the background, written into a slot by ``load``
        self.staged: Dict[int, StagedBatch] = {}
        # x -> router logits of this layer (for lookahead from the layer before), or None; the
        # next MoE layer's bank, in model order (set when the cache plans its banks)
        self.router = None
        self.next_bank: Optional["LayerBank"] = None
        # writable host views of the banks' memory, one (slots, bytes) uint8 array per part, and the
        # addresses they were made for; None where MLX memory has none (see ``refresh_views``)
        self.views: Optional[List[np.ndarray]] = None
        self.view_addresses: Optional[List[int]] = None
        # whether demand reads go straight into the banks' memory now (module docstring): views,
        # and one calling thread; kept current by ``refresh_views`` and the cache's
        # ``note_caller`` (an attribute: ``schedules.choose`` reads it on every layer call)
        self.direct = False
        # on mlx-cuda: the writer of direct reads into the views' memory by device copies
        # (``cuda_copy``), or None (host writes through the views)
        self.copier = None
        # the stream of the last call that used the bank (see the module docstring)
        self.last_stream = None
        # the previous layer's guess of this layer's misses, scored at the next load; a running
        # precision decides whether guesses are read or only scored
        self.predicted: Optional[set] = None
        # guesses are scored from the first call but read only once their running precision
        # reaches ``CacheTuning.lookahead_min_precision`` (four good calls in a row from 0): wrong guesses
        # would cost staging memory and disk time before the layer has shown it can guess
        self.ahead_precision = 0.0
        # an identity bank's background fill was asked for (``ExpertCache.request_fill``)
        self.fill_requested = False
        # guesses staged and loaded for the call that is starting (``load(..., guessed=True)``),
        # counted as that call's misses by its own load
        self._ahead_used: List[int] = []
        # this layer's share of the cache's counters (``--streaming-stats layers``)
        self.hits = 0
        self.misses = 0
        # (table, version, slot of each expert, whether each expert is missing): ``device_map``'s
        # last, which a caller may take as is while ``table`` and its version are the same
        self.last_map = None

    def device_map(self):
        """``(slots, missing)``: the slot table indexed by expert id, as a device array of slots
        (``uint32``; 0 for a missing expert) and a host array of whether each expert is missing
        (``bool``, numpy: a verified step's check counts the misses on the host from the ids it
        reads back anyway, no kernel). Made anew whenever the table changed: a graph that read one
        keeps the residency of its own moment, whatever the host does to the table after (mlx-lm
        builds step t+1 before step t ran)."""
        table = self.table
        made = self.last_map
        if made is None or made[0] is not table or made[1] != table.version:
            slot_of = table.slot_of
            slots = mx.array(np.maximum(slot_of, 0).astype(np.uint32))
            made = self.last_map = (table, table.version, slots, slot_of < 0)
        return made[2], made[3]

    def allocate(self, slots: int) -> None:
        """Give the bank ``slots`` slots, zeroed.

        The banks are evaluated here and after every update: MLX ties a lazy array to the stream of
        the thread that built it, and evaluating it from another thread fails ("There is no Stream(cpu,
        N) in current thread"), so a bank must never be left lazy for the next caller's thread.
        """
        with self.lock:
            self.discard_staged()
        self.predicted = None
        self.ahead_precision = 0.0
        self.slots = slots
        self.identity = slots == self.num_experts
        self.complete = False
        self.stock_call = None
        self.cache.all_complete = False
        self.fill_requested = False
        self.table = SlotTable(self.num_experts, self.cache.policy)
        self.table.reset(slots)
        self.slot_of, self.expert_of = self.table.slot_of, self.table.expert_of
        # with two tiers (``tiers``) the banks are made by the CPU: their pages start on the host,
        # and only the device tier's are moved to the device (never all experts at once there)
        stream = mx.cpu if self.cache.tiers is not None else None
        for spec in self.layer.parts:
            proj = self.glu[spec.proj]
            shape = (slots, *spec.shape)
            proj[spec.part] = mx.zeros(shape, dtype=mx_dtype(spec.dtype), stream=stream)
        mx.eval([self.array(spec.proj, spec.part) for spec in self.layer.parts])
        self.views = self.view_addresses = None
        self.last_stream = None
        self.refresh_views()

    def resize(self, slots: int) -> None:
        """Make the bank ``slots`` slots deep, keeping the resident experts it has room for (where
        fewer, the eviction policy's victims leave: the least useful), between two model calls
        (``ExpertCache.follow_budget``). The banks are made anew and the kept experts' bytes copied
        into them (an MLX take, evaluated here): a graph built before holds the old arrays, which
        nothing writes again, so it computes what it was built to compute, and their memory is
        freed once it ran. The policy keeps its history; a bank of every expert maps expert e to
        slot e again (and fills in the background)."""
        with self.lock:
            self.discard_staged()
            if slots == self.slots or self.slots == 0:
                return
            table = self.table
            resident = np.nonzero(table.slot_of >= 0)[0]
            if len(resident) > slots:
                gone = table.policy.victims(resident, len(resident) - slots)
                resident = np.setdiff1d(resident, gone)
            identity = slots == self.num_experts
            new_slots = resident if identity else np.arange(len(resident), dtype=np.int64)
            source = np.zeros(slots, dtype=np.int32)  # a free slot's bytes: slot 0's, never read
            source[new_slots] = table.slot_of[resident]
            source = mx.array(source)
            parts = self.layer.parts
            arrays = [mx.take(self.array(p.proj, p.part), source, axis=0) for p in parts]
            mx.eval(arrays)  # (should it fail, e.g. out of memory, the bank is as it was)
            for spec, array in zip(parts, arrays):
                self.glu[spec.proj][spec.part] = array
            table.resize(slots, resident, new_slots)
            self.slot_of, self.expert_of = table.slot_of, table.expert_of
            self.slots = slots
            self.identity = identity
            self.complete = False
            self.stock_call = None
            self.fill_requested = False
            self._ahead_used = []
            self.last_map = None
            self.views = self.view_addresses = None
            self.last_stream = None
            self.refresh_views()
            self.note_complete()

    def refresh_views(self) -> None:
        """Host views of the banks, remade if MLX moved a bank to new memory (an update that could
        not be done in place). Called after every MLX update of the banks; views are used only under
        ``lock``, so a stale one is never written through."""
        self._make_views()
        self.cache.set_direct(self)

    def _make_views(self) -> None:
        if self.slots == 0 or not self.cache.direct_reads:
            self.views = self.view_addresses = self.copier = None
            return
        arrays = [self.array(spec.proj, spec.part) for spec in self.layer.parts]
        addresses = [host_address(a) for a in arrays]
        if self.views is not None and addresses == self.view_addresses:
            return
        views = (
            [host_bytes(a, at) for a, at in zip(arrays, addresses)]
            if None not in addresses
            else None
        )
        if views is None or any(v is None for v in views):
            self.views = self.view_addresses = self.copier = None
            return
        self.views, self.view_addresses = views, addresses
        self.copier = cuda_copy.copier_for(addresses) if self.cache.tuning.device_copies else None

    def array(self, proj: str, part: str) -> mx.array:
        return self.glu[proj][part]

    @property
    def resident_bytes(self) -> int:
        return self.slots * self.layer.expert_nbytes

    def load(self, experts: np.ndarray, keep=(), guessed=False, alone=False) -> None:
        """Make every expert in ``experts`` (unique ids, at most ``slots``) resident, and wait for
        it: ``issue``, every landing taken. ``guessed``: experts read ahead on a guess for the
        call that is starting (``issue``)."""
        self.cache.ensure_planned()
        with self.lock:
            landed, ahead = self.issue(experts, keep, guessed, alone)
            for _ in landed:
                pass
            self._ahead_used.extend(ahead)

    def issue(self, experts: np.ndarray, keep=(), guessed=False, alone=False):
        """``load``'s first half, under ``lock``: finished background fills installed, the reads
        of ``experts`` issued; ``(landings, ahead)``. Take every landing (or ``close()`` it), then
        add ``ahead`` to ``_ahead_used``: ``guessed``, experts read ahead on a guess for the call
        that is starting (staged), made resident before its own ``load``: slots as for a read
        ahead (not a use of the policy, so the call is one call to it; nothing but ``keep``
        pinned), not counted here; the call's own load counts them as its misses, and as misses
        guessed. ``load_together`` issues several banks' loads before it takes any landing."""
        if self.identity and self.staged:
            install_finished(self)
        if not guessed:
            return self.reads(experts, keep, alone=alone), ()
        missing, victims, evicted = self.table.prefetch(experts, keep)
        if not len(missing):
            return NOTHING_TO_READ, ()
        landed = landings(self, missing, victims, (0, 0, evicted), alone=alone)
        next(landed)  # the reads issued
        return landed, missing.tolist()

    def reads(self, experts: np.ndarray, keep=(), by_projection=False, alone=False):
        """Start making every expert in ``experts`` (unique ids, at most ``slots``) resident, under
        ``lock``: the policy told of the call's use, a slot for each missing expert (free ones
        first, then the policy's victims; never a slot of ``experts`` or ``keep``, the experts of
        a wave still computing: pinned), and their reads issued. Returns the landings
        (``bank_reads.landings``): iterate it to take each as it lands, ``close()`` it if the caller
        stops early. The victims are freed before reading: if the read fails, no slot may still
        name an evicted expert (evicting that slot later would unmap the expert from wherever it
        lives by then). ``by_projection``, ``alone``: as for ``bank_reads.landings``."""
        stats = self.cache.stats
        if stats.first_request is None:
            stats.start()
        if len(experts) > self.slots:
            raise ValueError(
                f"{self.path}: {len(experts)} experts asked for at once but the bank has "
                f"{self.slots} slots"
            )
        # guesses read ahead (staged, and loaded with ``guessed``) that this call uses: read for
        # it, so counted as its misses (and as misses guessed)
        used = self._take_ahead_used(experts) if self._ahead_used else ()
        if self.predicted is not None:
            missed = experts[self.slot_of[experts] < 0]
            if len(used):
                missed = np.union1d(missed, used).astype(np.int64)
            if self.predicted or len(missed):  # (an empty guess and no miss: nothing to score)
                lookahead.score(self, missed)
            self.predicted = None
        try:
            missing, victims, evicted = self.table.admit(experts, keep)
        except ValueError as e:
            raise ValueError(f"{self.path}: {e}") from None
        misses = len(missing) + len(used)
        hits = len(experts) - misses
        if not len(missing):
            self.hits += hits
            self.misses += misses
            with stats.lock:  # (``stats.add``, spelt out: once per layer call)
                stats.hits += hits
                stats.misses += misses
                stats.evictions += evicted
            stats.last_request = time.perf_counter()
            if self.identity and not self.complete:
                self.note_complete()
            return NOTHING_TO_READ
        landed = landings(self, missing, victims, (hits, misses, evicted), by_projection, alone)
        next(landed)  # the reads issued
        return landed

    def _take_ahead_used(self, experts: np.ndarray) -> np.ndarray:
        """The experts of ``experts`` read ahead on a guess for this call (``load(...,
        guessed=True)``), no longer counted as such."""
        used = np.intersect1d(self._ahead_used, experts).astype(np.int64)
        taken = set(used.tolist())
        self._ahead_used = [e for e in self._ahead_used if e not in taken]
        return used

    def drop_guesses(self) -> None:
        """Guesses read ahead for a call that ended without using them are no longer its."""
        with self.lock:
            self._ahead_used = []

    def note_complete(self) -> None:
        """An identity bank is ``complete`` once every expert is resident (checked after a change)."""
        if self.identity and not self.complete:
            self.complete = bool((self.slot_of >= 0).all())
            if self.complete:
                cache = self.cache
                cache.all_complete = all(b.complete for b in cache.banks)

    def complete_call(self):
        """A complete bank's whole call, which ``StreamingSwitchGLU`` runs before anything else
        once ``schedules.choose`` has found it applies (``stock_call``): stock's ``SwitchGLU`` over
        the bank with the router's ids, as ``StockGraph`` runs it; with two tiers the ids kept
        first for the device tier's count (``tiers.Tiers.caller``)."""
        tiers = self.cache.tiers
        return self.glu_call if tiers is None else tiers.caller(self, self.glu_call)

    def summary(self) -> dict:
        """This layer's counters: hits, misses, and the GB (decimal) of the experts it missed."""
        asked = self.hits + self.misses
        return {
            "layer": self.path,
            "slots": self.slots,
            "hits": self.hits,
            "misses": self.misses,
            "hit_rate": self.hits / asked if asked else float("nan"),
            "gb_read": self.misses * self.layer.expert_nbytes / 1e9,
        }

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
            host = self.cache.host_cache
            held = host.held(self) if host is not None and want else None
            if held is not None:  # a host cache's experts are copied from it, not read
                want = [e for e in want if held[e] < 0]
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
        # on the CPU backend a bank with direct reads copies staged bytes in through its host
        # views (``bank_reads.copy_in``): host buffers (should it lose them before the load,
        # ``bank_reads.install`` copies from those buffers instead). On a GPU an MLX update was faster
        host = self.direct and not self.identity and mx.default_device().type == mx.cpu
        batch = prefetcher.submit(
            self.layer, np.array(want), kind, priority, block=block, start=False, host=host
        )
        if batch is None:
            return 0
        # recorded before its read starts: a load meanwhile either finds it here (and waits for
        # it) or made the expert resident first (then the batch skips it): never read twice
        with self.lock:
            for e in want:
                if self.slot_of[e] < 0 and e not in self.staged:
                    self.staged[e] = batch
                else:
                    batch.skip.add(e)
        if not prefetcher.start(batch, priority):
            return 0
        return len(want) - len(batch.skip)

    def install_finished(self) -> None:
        """Identity banks: every finished staged expert written into its own slot (under
        ``lock``)."""
        install_finished(self)

    def drop_staged(self) -> None:
        """End of a call: staged experts it did not use are dropped (identity banks keep them)."""
        if self.staged and not self.identity:
            with self.lock:
                self.discard_staged()

    def discard_staged(self) -> None:
        """Forget every staged read (under ``lock``), identity bank or not: their buffers go back
        once read. For a call that cannot install them now (``schedules.Direct``). An identity
        bank's fill may be among them: it is to be asked for again (the next call that finds the
        bank incomplete does), or the experts it staged would be read only if a call used them."""
        batches = {id(b): b for b in self.staged.values()}
        self.staged.clear()
        if self.identity and batches:
            self.fill_requested = False
        for batch in batches.values():
            self.cache.release(batch, when_done=True)


def load_together(loads, later: bool = False) -> Optional[LaterLandings]:
    """``bank.load(experts, **options)`` for each of ``loads``, every bank's reads issued before
    any is waited for. Where every bank reads directly into its slots: the reads run on the
    cache's demand threads, ``CacheTuning.reads_in_flight`` at once, while this thread takes the
    landings bank after bank, every bank's lock held until all have landed. Else (staged writes:
    Metal, a second calling thread) the banks after the first are read ahead into staging buffers
    (``stage``, as much as the staging bound has room for, the ``together`` kind), and the loads
    run one after another, each installing what was read ahead for it. A model with a host cache
    (whose copies go before any read of their bank) loads one bank after another. All pending
    work was evaluated by the caller, so no bank need wait for its stream (``last_stream``).
    Every load has ended when this returns; the first error is raised then. ``later`` (direct
    reads only): each bank's landings are taken when its layer runs (``later_landings``)."""
    banks = [bank for bank, _, _ in loads]
    if len(loads) == 1 or banks[0].cache.host_cache is not None:
        for bank, experts, options in loads:
            bank.load(experts, **options)
        return
    if not all(b.direct for b in banks):
        for bank, experts, _ in loads[1:]:
            bank.stage(experts, "together", WAVE, fit=True)
        for bank, experts, options in loads:
            bank.load(experts, **options)
        return
    banks[0].cache.ensure_planned()
    landings = LaterLandings().issue(loads)
    if later:
        return landings
    landings.finish()


def note_hits(banks: List[LayerBank], experts: List[np.ndarray]) -> tuple:
    """Each of ``banks`` found every one of its ``experts`` resident and loaded nothing (a verified
    step's commit; the policies' records of the uses: ``decode.step_uses.note_uses``): their
    counters. Experts read ahead on a guess for a call (``load(..., guessed=True)``) count as its
    misses, the rest as hits; guesses it did not use end here. Returns ``(hits, misses)`` summed;
    the caller holds the banks' locks."""
    hits = misses = 0
    for bank, used in zip(banks, experts):
        read = len(np.intersect1d(bank._ahead_used, used)) if bank._ahead_used else 0
        bank._ahead_used = []
        bank.hits += len(used) - read
        bank.misses += read
        hits, misses = hits + len(used) - read, misses + read
    return hits, misses
