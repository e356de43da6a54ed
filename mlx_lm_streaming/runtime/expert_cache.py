"""Expert cache: all slot banks of one model, sharing one byte budget, one store and its threads.

The budget is global: every layer gets the same number of slots,
``budget // sum(bytes of one expert of each layer)``, at most the layer's expert count, and what that
leaves of the budget gives one more slot to layers in model order while it lasts (``plan_slots``).
The cache owns what the banks share: the demand read threads, the background reader
(``prefetch.ExpertPrefetcher``: lookahead, next wave) and the fill thread that completes identity
banks, the settings that turn each of them on or off (``CacheTuning``), and the counters behind
``--streaming-stats``.
"""

import contextlib
import math
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Dict, List, Optional

import numpy as np

from ..errors import ConfigurationError, ExpertIOError
from . import costs
from .bank import LayerBank
from .counters import CacheStats
from .index import LayerExperts, natural_key
from .modes import PER_LAYER
from .no_timeline import NO_TIMELINE
from .options import gb_at_least
from .policy import DEFAULT_POLICY
from .prefetch import FILL, ExpertPrefetcher, StagedBatch

# staging buffers (background reads, and without direct reads demand reads per chunk) are bounded by
# this share of the budget; without direct reads they hold at least two experts (demand reads and the
# next wave go through them), with direct reads nothing needs them: a lookahead that does not fit is
# not read. Peak memory stays within ~2x this over the budget
STAGING_SHARE = 0.05
# banks loaded at once when a verified step reads a token's misses together
BANK_THREADS = 8
# experts this big and bigger are read a projection at a time (``CacheTuning.phase_min_bytes``)
PHASE_MIN_BYTES = 16 << 20
# every cache that may have background threads, for ``close_all`` at interpreter exit
_LIVE: "weakref.WeakSet[ExpertCache]" = weakref.WeakSet()


@dataclass(frozen=True)
class CacheTuning:
    """How an ``ExpertCache`` schedules its reads, fixed at construction. Each setting only moves or
    drops work; none changes what is computed, and each is kept for a measured reason
    (docs/benchmarks/README.md). Defaults that benchmarks and tests vary (through the internal
    ``tuning`` entry of the streaming options, not a user option); what users choose (direct reads,
    layer-major prefill) is theirs alone (``StreamingOptions``), resolved at load and given to the
    cache beside this (``ExpertCache.direct_reads``, ``ExpertCache.layer_major_prefill``)."""

    # next-layer lookahead (prefetch.py); its guesses are read only while a layer's running
    # precision is at least ``lookahead_min_precision`` (a wrong guess costs a read), and so are
    # a verified step's (``read_misses_together``: ``StepRunner.guess_precision``)
    lookahead: bool = True
    lookahead_min_precision: float = 0.5
    # decode-sized calls whose experts are all resident run with no host sync per layer, checked
    # once per call (``verified_step.py``)
    verified_steps: bool = True
    # a verified step that finds a miss reads, with the missed layer's experts, those the pass
    # beyond it picked and lacks, all at once, then runs again from the missed layer
    # (``verified_step.py``); off: the missed layer's alone, the rest found by later checks
    read_misses_together: bool = True
    # how a decode-sized call chooses between a verified step and the per-layer schedule
    # (``costs.CHOICES``): "costs", by this run's measured costs (``costs.py``); "limits",
    # by the per-backend limits on the share of MoE layers that missed; "always", a verified step
    # wherever one may run; None: the backend's default (``costs.CHOICE``)
    verify_choice: Optional[str] = None
    # with direct reads, a load of at most this many experts spreads each expert's ranges over the
    # store's readers; a load of more reads each expert on its own demand thread alone (fewer
    # thread hand-offs: docs/benchmarks/README.md, "A token's misses read together"); None: always
    # spread
    spread_reads_upto: Optional[int] = 1
    # on mlx-cuda, direct reads go into a page-locked buffer and are copied into the slots by the
    # CUDA runtime (``cuda_copy.py``: the slots' managed pages stay on the device); off: host
    # writes through the banks' views. Nothing changes on other backends
    device_copies: bool = True
    # with direct reads, experts of at least this many bytes are read a projection at a time
    # (``schedules.ByProjection``); None: never
    phase_min_bytes: Optional[int] = PHASE_MIN_BYTES
    # bound on bytes staged by background reads; None: ``STAGING_SHARE`` of the budget
    staging_bytes: Optional[int] = None
    # bound on the hidden states held between layers for one group of chunks; None: no bound
    prefill_hold_bytes: Optional[int] = 1 << 30
    # long prompts' layers over whole expert sets where two fit (``memory.layer_sets_fit``); off: waves
    layer_sets: bool = True


class ExpertCache:
    """All slot banks of one model, sharing one byte budget and one store."""

    def __init__(
        self,
        store,
        budget_bytes: Optional[int] = None,
        tuning: CacheTuning = CacheTuning(),
        policy: str = DEFAULT_POLICY,
        direct_reads: bool = True,
        layer_major_prefill: bool = True,
    ):
        self.store = store
        # the user's switches, resolved for this backend (``StreamingOptions.use_direct_reads``,
        # ``use_layer_major_prefill``): demand reads straight into the banks (bank/reads.py; off:
        # through staging buffers); prompts longer than one prefill chunk through decoder layer L
        # chunk after chunk before layer L+1 (layer_major.py; off: chunk by chunk, as stock)
        self.direct_reads, self.layer_major_prefill = direct_reads, layer_major_prefill
        self.budget_bytes = budget_bytes
        # on mlx-cuda: host memory for the experts the device budget cannot hold and the two tiers
        # (``tiers.Tiers``), or a host cache below that (``host_cache``), set at load by
        # ``tiers.set_up``; every bank complete (``note_complete``): a call runs stock's graph whole
        self.host_bytes, self.tiers, self.host_cache, self.all_complete = 0, None, None, False
        self.tuning = tuning
        self.stats = CacheStats()
        # which resident expert a bank evicts (``policy.POLICIES``)
        self.policy = policy
        # routing_trace.RoutingRecorder that each layer call reports its expert ids to, or None
        self.recorder = None
        # timeline.Timeline that reads, installs, syncs and compute are recorded on, or the null
        # one (``NO_TIMELINE``: its calls record nothing)
        self.timeline = NO_TIMELINE
        # runner.StepRunner of the model, which chooses each decode call's mode
        self.steps = None
        # the running model call's mode (``modes``): what each MoE layer call does
        self.mode = PER_LAYER
        # threads that called a layer (direct reads need just one), and whether the banks are
        # planned: read by ``StreamingSwitchGLU``, which calls ``enter_call`` only while either is
        # to be done
        self.callers: set = set()
        self.planned = False
        # True once layers were called from more than one thread: direct reads are then off
        self.shared = False
        self._demand_pool: Optional[ThreadPoolExecutor] = None
        self._bank_pool: Optional[ThreadPoolExecutor] = None
        self._prefetcher: Optional[ExpertPrefetcher] = None
        self._filler: Optional[threading.Thread] = None
        self._fill_queue: List[LayerBank] = []
        self._banks: "weakref.WeakSet[LayerBank]" = weakref.WeakSet()
        self._order: Optional[List[LayerBank]] = None
        self._numbers: Dict[int, int] = {}
        self._lock = threading.Lock()
        self._direct_lock = threading.Lock()  # (``set_direct``)
        self._closed = False
        _LIVE.add(self)

    def register(self, layer: LayerExperts, glu) -> LayerBank:
        bank = LayerBank(self, layer, glu)
        self._banks.add(bank)
        self.planned, self._order = False, None
        return bank

    def unregister(self, bank: LayerBank) -> None:
        """Drop a bank whose layer left the model (a pipeline stage keeps only its own layers)."""
        self._banks.discard(bank)
        self.planned = False
        self._order = None

    @property
    def banks(self) -> List[LayerBank]:
        """In model order (``layers.2`` before ``layers.10``)."""
        order = self._order
        if order is None:
            order = self._order = sorted(self._banks, key=lambda b: natural_key(b.path))
        return list(order)

    def next_bank(self, bank: LayerBank) -> Optional[LayerBank]:
        """The MoE layer after ``bank``'s, in model order."""
        order = self._order if self._order is not None else self.banks
        try:
            i = order.index(bank)
        except ValueError:
            return None
        return order[i + 1] if i + 1 < len(order) else None

    def enter_call(self) -> None:
        """Before a layer call's schedule is chosen (a verified step's: once, before its forward):
        the banks planned (``ensure_planned``), the calling thread noted (``note_caller``)."""
        if not self.planned:
            self.ensure_planned()
        if threading.get_ident() not in self.callers:
            self.note_caller()

    def install(self, mode) -> bool:
        """Make ``mode`` the running model call's (``modes``) where no other is (the mode is
        ``PER_LAYER``): whether it was. The caller puts ``PER_LAYER`` back after its call
        (``running``)."""
        with self._lock:
            if self.mode is not PER_LAYER:
                return False
            self.mode = mode
            return True

    @contextlib.contextmanager
    def running(self, mode):
        """``mode`` the running model call's for the block (``install``); yields whether it is."""
        installed = self.install(mode)
        try:
            yield installed
        finally:
            if installed:
                self.mode = PER_LAYER

    def note_caller(self) -> None:
        """Record the calling thread (``enter_call``)."""
        me = threading.get_ident()
        if me not in self.callers:
            with self._lock:
                self.callers.add(me)
                self.shared = len(self.callers) > 1
                if self.shared:  # direct reads off for good (``LayerBank.direct``)
                    with self._direct_lock:
                        for bank in self._banks:
                            bank.direct = False

    def set_direct(self, bank) -> None:
        """``bank.direct`` from its views and the calling threads, under the lock that
        ``note_caller`` turns it off under (a bank remaking its views meanwhile cannot turn it on
        again). A lock of its own: banks remake their views while the cache plans them, under
        ``_lock``."""
        with self._direct_lock:
            bank.direct = bank.views is not None and not self.shared

    @property
    def bank_pool(self) -> ThreadPoolExecutor:
        """Threads that run the loads of several banks at once (a verified step's misses read
        together); each load's reads still go through ``demand_pool``."""
        return self._pool("_bank_pool", BANK_THREADS, "banks")

    @property
    def demand_pool(self) -> ThreadPoolExecutor:
        """Threads that run the demand reads of one load in parallel, one expert each."""
        return self._pool("_demand_pool", max(2, self.store.threads), "demand")

    def _pool(self, attr: str, threads: int, name: str) -> ThreadPoolExecutor:
        """The pool kept as ``attr``, started on first use (a closed cache raises)."""
        pool = getattr(self, attr)
        if pool is None:
            with self._lock:
                if self._closed:
                    raise ExpertIOError("the expert cache is closed (its model was released)")
                pool = getattr(self, attr)
                if pool is None:
                    pool = ThreadPoolExecutor(
                        threads, thread_name_prefix=f"mlx-lm-streaming-{name}"
                    )
                    setattr(self, attr, pool)
        return pool

    # -- background reads ------------------------------------------------------------------------

    @property
    def prefetcher(self) -> ExpertPrefetcher:
        if self._prefetcher is None:
            with self._lock:
                if self._prefetcher is None:
                    self._prefetcher = ExpertPrefetcher(self.store, self._staging_limit())
                    self._prefetcher.timeline = self.timeline
                    if self._closed:
                        self._prefetcher.close()
        return self._prefetcher

    @property
    def staging_limit(self) -> int:
        """Bytes of expert staging buffers at once: background reads, and demand reads per chunk."""
        return self._prefetcher.max_bytes if self._prefetcher is not None else self._staging_limit()

    @property
    def prefetch_stats(self):
        prefetcher = self._prefetcher
        return (prefetcher if prefetcher is not None else self.prefetcher).stats

    def _staging_limit(self) -> int:
        if self.tuning.staging_bytes is not None:
            return int(self.tuning.staging_bytes)
        biggest = max((b.layer.expert_nbytes for b in self.banks), default=0)
        total = self.total_expert_bytes  # a budget is a cap: above every expert, every expert
        budget = total if self.budget_bytes is None else min(self.budget_bytes, total)
        floor = 0 if self.direct_reads else 2 * biggest
        if self.tiers is not None:  # the fill completes the banks: room for its chunks of 8
            floor = 32 * biggest
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
        if bank.fill_requested or self._closed:
            return
        bank.fill_requested = True
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
        if self.tiers is not None:
            self.tiers.close()
        if self._prefetcher is not None:
            self._prefetcher.close(wait=wait)
        with self._lock:
            pools = (self._bank_pool, self._demand_pool)
            self._bank_pool = self._demand_pool = None
        for pool in pools:  # the bank pool's loads wait on the demand pool: it goes first
            if pool is not None:
                pool.shutdown(wait=wait)
        filler = self._filler
        if wait and filler is not None and filler is not threading.current_thread():
            filler.join()

    def ensure_planned(self) -> None:
        if not self.planned:
            with self._lock:
                if not self.planned:
                    self._plan()
                    self.planned = True

    def slots_for_budget(self) -> int:
        banks = self.banks
        per_slot = sum(b.layer.expert_nbytes for b in banks)
        most = max(b.num_experts for b in banks)
        if self.budget_bytes is None:
            return most
        slots = self.slot_budget // per_slot
        if slots < 1:
            raise ConfigurationError(
                f"expert cache budget of {self.budget_bytes / 1e9:.12g} GB is below the minimum "
                f"of one expert per MoE layer, {gb_at_least(per_slot)} GB for {len(banks)} "
                "layers: raise --expert-cache-gb / MLX_LM_STREAMING_CACHE_GB / expert_cache_gb "
                f"to at least {gb_at_least(per_slot)} GB"
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
            left = self.slot_budget - sum(n * b.layer.expert_nbytes for n, b in zip(plan, banks))
            for i, b in enumerate(banks):
                if plan[i] < b.num_experts and left >= b.layer.expert_nbytes:
                    plan[i] += 1
                    left -= b.layer.expert_nbytes
        return plan

    @property
    def slot_budget(self) -> int:
        """The bytes the slots may take: the device budget, and the host tier's where there is
        one (``tiers``)."""
        return self.budget_bytes + (self.host_bytes if self.tiers is not None else 0)

    def _plan(self) -> None:
        banks = self.banks
        for bank, slots in zip(banks, self.plan_slots()):
            bank.allocate(slots)
        for tier in filter(None, (self.tiers, self.host_cache)):
            tier.plan(banks)
        for bank, nxt in zip(banks, banks[1:] + [None]):
            bank.next_bank = nxt
        self._numbers = {id(b): i for i, b in enumerate(banks)}

    def layer_number(self, bank: LayerBank) -> int:
        """The bank's MoE layer number (0 first), in model order."""
        return self._numbers[id(bank)]

    @property
    def resident_bytes(self) -> int:
        return sum(b.resident_bytes for b in self.banks)

    @property
    def total_expert_bytes(self) -> int:
        return sum(b.layer.expert_nbytes * b.num_experts for b in self.banks)

    def summary(self) -> Dict[str, float]:
        """Counters for ``--streaming-stats`` (every key is described in docs/usage.md). GB are
        decimal (10**9 bytes), as in mlx-lm's "Peak memory"."""
        if self.steps is not None:
            self.steps.flush()
        s, st = self.stats, self.store.stats
        asked = s.hits + s.misses
        span = s.span_seconds
        return {
            "hit_rate": s.hits / asked if asked else math.nan,
            "hits": s.hits,
            "misses": s.misses,
            "evictions": s.evictions,
            "experts_read": s.misses - (self.host_cache.hits if self.host_cache else 0),
            "gb_read": st.bytes_read / 1e9,
            "io_seconds": st.seconds,
            "io_wait_seconds": s.io_wait_seconds,
            "install_seconds": s.install_seconds,
            "span_seconds": span,
            "other_seconds": max(0.0, span - s.io_wait_seconds - s.install_seconds),
            "cache_gb": self.resident_bytes / 1e9,
            "complete_layers": sum(b.complete for b in self.banks),
            **costs.summary(self.steps),
            "per_layer": [b.summary() for b in self.banks],
            **(t.summary() if (t := self.tiers or self.host_cache) is not None else {}),
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
