"""Slot bank of one MoE layer: the layer's expert arrays, made ``slots`` experts deep.

Each MoE layer owns a ``LayerBank``: for every tensor of an expert (``gate_proj.weight``,
``gate_proj.scales``, ...) one array of shape ``(slots, *expert_shape)``. The stock mlx-lm
``SwitchGLU`` of the layer keeps its own code, activation and quantization settings; only its arrays
are swapped for the banks. The router's expert ids become slot ids (``slot_of[expert]``, from the
bank's ``SlotTable``) passed to ``gather_qmm`` as data, so nothing is stacked or rebuilt per token.

``load`` makes a call's experts resident: it never evicts an expert the call pins (the experts it is
about to compute) and reads the others into their slots (bank_io.py). A bank with a slot per expert
(``slots == num_experts``) maps expert ``e`` to slot ``e`` (identity): once every expert of the layer
is resident the bank is ``complete``, and the layer passes the router's indices straight to the kernel
with no host sync, the same graph as stock. ``stage`` starts background reads (lookahead, next wave,
fill) into staging buffers; only ``load`` writes them into the bank, on the thread that calls the layer.

Demand reads go straight into the banks (direct reads) through host views of the bank's memory.
Writing bank memory behind MLX's back is safe only when no pending MLX work reads the slot being
written: the victims are never slots the call uses, and every call that used the bank was submitted
(``mx.async_eval``) on the same stream before this call's host sync, which waits for it (a call on
another stream first synchronizes that one). Where that cannot be known (a second thread uses the
model) or MLX memory has no host view, reads go through staging buffers and MLX's own copy-on-write
slice updates.
"""

import threading
from typing import Dict, List, Optional

import mlx.core as mx
import numpy as np

from . import cuda_copy, lookahead
from .bank_io import install_finished, read_into_slots
from .index import LayerExperts
from .policy import SlotTable
from .host_views import host_address, host_bytes
from .prefetch import StagedBatch
from .safetensors_header import mx_dtype


class LayerBank:
    """Slot bank of one MoE layer, wrapped around that layer's stock ``SwitchGLU``."""

    def __init__(self, cache, layer: LayerExperts, glu):  # cache: expert_cache.ExpertCache
        self.cache = cache
        self.layer = layer
        self.glu = glu  # the stock SwitchGLU whose arrays become our banks
        self.num_experts = layer.num_experts
        self.slots = 0
        # which expert is in which slot, and the eviction policy (``policy.py``)
        self.table = SlotTable(layer.num_experts, cache.policy)
        self.lock = threading.RLock()
        # slots == num_experts: expert e lives in slot e; complete once all are resident
        self.identity = False
        self.complete = False
        # expert -> StagedBatch read in the background, written into a slot by ``load``
        self.staged: Dict[int, StagedBatch] = {}
        # x -> router logits of this layer (for lookahead from the layer before), or None
        self.router = None
        # writable host views of the banks' memory, one (slots, bytes) uint8 array per part, and the
        # addresses they were made for; None where MLX memory has none (see ``refresh_views``)
        self.views: Optional[List[np.ndarray]] = None
        self._addresses: Optional[List[int]] = None
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
        # (table, version, slot of each expert, whether each expert is missing): ``device_map``
        self._device = None

    @property
    def path(self) -> str:
        return self.layer.path

    @property
    def slot_of(self) -> np.ndarray:
        """``slot_of[expert]``: the expert's slot, -1 if not resident (read-only: see ``table``)."""
        return self.table.slot_of

    @property
    def expert_of(self) -> np.ndarray:
        """``expert_of[slot]``: the slot's expert, -1 if free (read-only: see ``table``)."""
        return self.table.expert_of

    def device_map(self):
        """``(slots, missing)``: the slot table as two device arrays indexed by expert id, the slot
        (``uint32``; 0 for a missing expert) and whether the expert is missing (``bool``). Made anew
        whenever the table changed: a graph that read one keeps the residency of its own moment,
        whatever the host does to the table after (mlx-lm builds step t+1 before step t ran)."""
        table = self.table
        made = self._device
        if made is None or made[0] is not table or made[1] != table.version:
            slot_of = table.slot_of
            slots = mx.array(np.maximum(slot_of, 0).astype(np.uint32))
            missing = mx.array(slot_of < 0)
            made = self._device = (table, table.version, slots, missing)
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
        self.fill_requested = False
        self.table = SlotTable(self.num_experts, self.cache.policy)
        self.table.reset(slots)
        for spec in self.layer.parts:
            proj = self.glu[spec.proj]
            proj[spec.part] = mx.zeros((slots, *spec.shape), dtype=mx_dtype(spec.dtype))
        mx.eval([self.array(spec.proj, spec.part) for spec in self.layer.parts])
        self.views = self._addresses = None
        self.last_stream = None
        self.refresh_views()

    def refresh_views(self) -> None:
        """Host views of the banks, remade if MLX moved a bank to new memory (an update that could
        not be done in place). Called after every MLX update of the banks; views are used only under
        ``lock``, so a stale one is never written through."""
        if self.slots == 0 or not self.cache.tuning.direct_reads:
            self.views = self._addresses = self.copier = None
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
            self.views = self._addresses = self.copier = None
            return
        self.views, self._addresses = views, addresses
        self.copier = cuda_copy.copier_for(addresses) if self.cache.tuning.device_copies else None

    def array(self, proj: str, part: str) -> mx.array:
        return self.glu[proj][part]

    @property
    def resident_bytes(self) -> int:
        return self.slots * self.layer.expert_nbytes

    def load(
        self,
        experts: np.ndarray,
        ready=None,
        keep=(),
        part_ready=None,
        guessed=False,
        started=None,
    ) -> None:
        """Make every expert in ``experts`` (unique ids, at most ``slots``) resident.

        ``ready(ids)``: called (on this thread) with the experts that were read, as they become
        resident (with direct reads, one expert or a few at a time while the others are still being
        read; else all at once). ``keep``: expert ids that must not be evicted either (the experts of
        a wave still computing). ``part_ready(expert, slot, proj)``: with direct reads, experts are
        read one projection at a time and this is called as each but the last lands (before the
        expert is resident: its slot holds that projection's bytes only). ``started()``: called
        (on this thread, once) when the reads have been handed to the readers, before any is
        waited for; at once where nothing is read."""
        self.cache.ensure_planned()
        self.cache.stats.start()
        if len(experts) > self.slots:
            raise ValueError(
                f"{self.path}: {len(experts)} experts asked for at once but the bank has "
                f"{self.slots} slots"
            )
        with self.lock:
            if self.identity and self.staged and ready is None:
                # (a caller passing ``ready`` has work pending on the bank: it did this before)
                install_finished(self)
            if guessed:
                self._load_guessed(experts, keep)
                return
            resident = self.slot_of[experts] >= 0
            # guesses read ahead (staged, and loaded with ``guessed``) that this call uses: read
            # for it, so counted as its misses (and as misses guessed)
            used = self._take_ahead_used(experts)
            if self.predicted is not None:
                missed = experts[~resident]
                if len(used):
                    missed = np.union1d(missed, used).astype(np.int64)
                lookahead.score(self, missed)
            # slots for the missing experts: free ones first, then the policy's victims, never
            # a slot of ``experts`` or ``keep`` (pinned). The victims are freed before reading:
            # if the read fails, no slot may still name an evicted expert (evicting that slot
            # later would unmap the expert from wherever it lives by then)
            try:
                missing, victims, evicted = self.table.admit(experts, keep)
            except ValueError as e:
                raise ValueError(f"{self.path}: {e}") from None
            if len(missing):
                read_into_slots(
                    self, missing, victims, ready=ready, part_ready=part_ready, started=started
                )
            elif started is not None:
                started()
            hits = len(experts) - len(missing) - len(used)
            self.hits += hits
            self.misses += len(missing) + len(used)
            self.cache.stats.add(hits, len(missing) + len(used), evicted)
            self.note_complete()

    def _take_ahead_used(self, experts: np.ndarray) -> np.ndarray:
        """The experts of ``experts`` read ahead on a guess for this call (``load(...,
        guessed=True)``), no longer counted as such."""
        if not self._ahead_used:
            return np.zeros(0, dtype=np.int64)
        used = np.intersect1d(self._ahead_used, experts).astype(np.int64)
        taken = set(used.tolist())
        self._ahead_used = [e for e in self._ahead_used if e not in taken]
        return used

    def note_use(self, experts: np.ndarray) -> tuple:
        """A call found every one of ``experts`` resident and loaded nothing (a verified step's
        commit): the policy's record of a use, and this layer's counters. Experts read ahead on a
        guess for it (``load(..., guessed=True)``) count as its misses, the rest as hits; guesses it
        did not use end here. Returns ``(hits, misses)`` for the cache's counters."""
        with self.lock:
            self.table.admit(experts)
            read = len(np.intersect1d(self._ahead_used, experts)) if self._ahead_used else 0
            self._ahead_used = []
            hits = len(experts) - read
            self.hits += hits
            self.misses += read
        return hits, read

    def drop_guesses(self) -> None:
        """Guesses read ahead for a call that ended without using them are no longer its."""
        with self.lock:
            self._ahead_used = []

    def note_complete(self) -> None:
        """An identity bank is ``complete`` once every expert is resident (checked after a change)."""
        if self.identity and not self.complete:
            self.complete = bool((self.slot_of >= 0).all())

    def _load_guessed(self, experts: np.ndarray, keep) -> None:
        """``load(..., guessed=True)``: experts read ahead on a guess for the call that is starting
        (staged), made resident before its own ``load``: slots as for a read ahead (not a use of the
        policy, so the call is one call to it; nothing but ``keep`` pinned), not counted here; the
        call's own load counts them as its misses, and as misses guessed."""
        missing, victims, evicted = self.table.prefetch(experts, keep)
        if len(missing):
            read_into_slots(self, missing, victims)
        self._ahead_used.extend(missing.tolist())
        self.cache.stats.add(0, 0, evicted)

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

    @property
    def direct(self) -> bool:
        """Whether demand reads go straight into the banks' memory now (module docstring)."""
        return self.views is not None and self.cache.tuning.direct_reads and not self.cache.shared

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
        # on the CPU backend a bank with direct reads copies staged bytes in through its host
        # views (``bank_io._copy_in``): host buffers (should it lose them before the load,
        # ``_install`` copies from those buffers instead). On a GPU an MLX update was faster
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

    def drop_staged(self) -> None:
        """End of a call: staged experts it did not use are dropped (identity banks keep them)."""
        if self.staged and not self.identity:
            with self.lock:
                self.discard_staged()

    def discard_staged(self) -> None:
        """Forget every staged read (under ``lock``), identity bank or not: their buffers go back
        once read. For a call that cannot install them now (``schedules.Direct``)."""
        batches = {id(b): b for b in self.staged.values()}
        self.staged.clear()
        for batch in batches.values():
            self.cache.release(batch, when_done=True)
