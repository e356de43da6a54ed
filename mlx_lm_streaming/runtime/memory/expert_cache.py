"""Expert cache: all slot banks of one model, sharing one byte budget, one store and its threads.

The budget is global: every layer gets the same number of slots,
``budget // sum(bytes of one expert of each layer)``, at most the layer's expert count, and what that
leaves of the budget gives one more slot to layers in model order while it lasts (``plan_slots``).
The cache owns what the banks share: the demand read threads, the background reader
(``prefetch.ExpertPrefetcher``: lookahead, next wave) and the fill thread that completes identity
banks, the settings that turn each of them on or off (``CacheTuning``), and the counters behind
``--streaming-stats``. A budget not pinned is a ceiling the cache follows free memory below
(``moving_budget.py``, ``follow_budget``).
"""

import contextlib
import math
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Optional

import numpy as np

from ...errors import ConfigurationError, ExpertIOError
from ..bank import LayerBank
from ..counters import CacheStats
from ..decode import share_limits
from ..decode.modes import PER_LAYER
from ..no_timeline import NO_TIMELINE
from ..policy import DEFAULT_POLICY
from ..reads.index import LayerExperts, natural_key
from ..reads.prefetch import FILL, ExpertPrefetcher, PrefetchStats, StagedBatch
from ..sizes import gb_as_given, gb_at_least
from . import moving_budget
from .queue_worker import QueueWorker
from .tuning import PHASE_MIN_BYTES, CacheTuning  # noqa: F401 (imported from here by many)

# staging buffers (background reads, and without direct reads demand reads per chunk) are bounded by
# this share of the budget; without direct reads they hold at least two experts (demand reads and the
# next wave go through them), with direct reads nothing needs them: a lookahead that does not fit is
# not read. Peak memory stays within ~2x this over the budget
STAGING_SHARE = 0.05
# every cache that may have background threads, for ``close_all`` at interpreter exit
_LIVE: "weakref.WeakSet[ExpertCache]" = weakref.WeakSet()


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
        follow_memory: bool = False,
    ):
        self.store = store
        # the user's switches, resolved for this backend (``StreamingOptions.use_direct_reads``,
        # ``use_layer_major_prefill``): demand reads straight into the banks (reads/bank_reads.py; off:
        # through staging buffers); prompts longer than one prefill chunk through decoder layer L
        # chunk after chunk before layer L+1 (layer_major.py; off: chunk by chunk, as stock)
        self.direct_reads, self.layer_major_prefill = direct_reads, layer_major_prefill
        # the budget as given (bytes) and as it is now: the moving budget starts it where free
        # memory allows, capped at every expert, when the banks are planned (at load)
        self.given_bytes = self.budget_bytes = budget_bytes
        # a ceiling that the cache follows free memory below (``moving_budget.watch``): the rule,
        # its thread, its reader (None: the backend's) and the budget it asks for (``follow_budget``)
        self.follow_memory, self.memory_reader = follow_memory, None
        self.moving = self.budget_watch = self.budget_due = None
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
        self._set_pool: Optional[ThreadPoolExecutor] = None
        self._prefetcher: Optional[ExpertPrefetcher] = None
        # the background reads' and the lookahead's counters, made before the prefetcher (an
        # attribute: ``lookahead.score`` reads it on a layer call)
        self.prefetch_stats = PrefetchStats()
        # identity banks whose remaining experts are read in the background (``request_fill``)
        self._fills = QueueWorker("mlx-lm-streaming-fill", self._fill)
        # the banks in model order (``layers.2`` before ``layers.10``): an attribute, read on every
        # decode call (``runner.StepRunner``); made anew by ``register`` and ``unregister``
        self.banks: List[LayerBank] = []
        self._numbers: Dict[int, int] = {}
        self._lock = threading.Lock()
        self._direct_lock = threading.Lock()  # (``set_direct``)
        self._closed = False
        _LIVE.add(self)

    def register(self, layer: LayerExperts, glu) -> LayerBank:
        bank = LayerBank(self, layer, glu)
        self.banks = sorted([*self.banks, bank], key=lambda b: natural_key(b.path))
        self.planned = False
        return bank

    def unregister(self, bank: LayerBank) -> None:
        """Drop a bank whose layer left the model (a pipeline stage keeps only its own layers)."""
        self.banks = [b for b in self.banks if b is not bank]
        self.planned = False

    def next_bank(self, bank: LayerBank) -> Optional[LayerBank]:
        """The MoE layer after ``bank``'s, in model order."""
        order = self.banks
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
                        for bank in self.banks:
                            bank.direct = False

    def set_direct(self, bank) -> None:
        """``bank.direct`` from its views and the calling threads, under the lock that
        ``note_caller`` turns it off under (a bank remaking its views meanwhile cannot turn it on
        again). A lock of its own: banks remake their views while the cache plans them, under
        ``_lock``."""
        with self._direct_lock:
            bank.direct = bank.views is not None and not self.shared

    @property
    def demand_pool(self) -> ThreadPoolExecutor:
        """Threads that run the demand reads of a load (or of several banks' loads at once,
        ``bank.load_together``) in parallel, one expert each: ``CacheTuning.reads_in_flight``,
        else the store's threads, at least 2."""
        in_flight = self.tuning.reads_in_flight or self.store.threads
        return self._pool("_demand_pool", max(2, in_flight), "demand")

    @property
    def set_pool(self) -> ThreadPoolExecutor:
        """The thread that fills a long prompt's next layer set (``bank.layer_set``) while this
        layer computes; its reads go through the demand pool."""
        return self._pool("_set_pool", 1, "sets")

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
                    self._prefetcher = ExpertPrefetcher(
                        self.store, self._staging_limit(), self.prefetch_stats
                    )
                    self._prefetcher.timeline = self.timeline
                    if self._closed:
                        self._prefetcher.close()
        return self._prefetcher

    @property
    def staging_limit(self) -> int:
        """Bytes of expert staging buffers at once: background reads, and demand reads per chunk."""
        return self._prefetcher.max_bytes if self._prefetcher is not None else self._staging_limit()

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
        if bank.fill_requested or self._fills.closed:  # (closed by ``stop_fills``, and ``close``)
            return
        bank.fill_requested = True
        self._fills.put(bank)

    def _fill(self, bank: LayerBank) -> None:
        """The background fill of one identity bank (``request_fill``), on its own thread."""
        chunk = max(1, min(8, self.prefetcher.max_bytes // max(1, 4 * bank.layer.expert_nbytes)))
        with bank.lock:
            todo = [
                e for e in range(bank.num_experts) if bank.slot_of[e] < 0 and e not in bank.staged
            ]
        for i in range(0, len(todo), chunk):
            if self._closed or not bank.identity:
                break
            bank.stage(np.array(todo[i : i + chunk]), "fill", FILL, block=True)

    def stop_fills(self) -> None:
        """No background fill asked for from now on: a model being closed (its close does its
        last step's host work, which would ask for its identity banks' fill, and a finalizer's
        close joins no thread: the fill would outlive the model)."""
        self._fills.close()

    def close(self, wait: bool = True) -> None:
        """Stop background reads (the store is closed by its owner). ``wait=False`` joins no thread:
        for the finalizer that runs when a model is garbage collected, which can run inside another
        thread's start-up, where joining a thread deadlocks (seen: a pytest run hung there)."""
        self.stop_fills()
        self._closed = True
        if self.budget_watch is not None:
            self.budget_watch.close(wait=wait)
        if self.tiers is not None:
            self.tiers.close(wait=wait)
        if self._prefetcher is not None:
            self._prefetcher.close(wait=wait)
        with self._lock:
            pools = (self._set_pool, self._demand_pool)
            self._set_pool = self._demand_pool = None
        checker = getattr(self.steps, "checker", None)  # (``StepRunner.check_soon``'s thread)
        for pool in (*pools, checker):  # a set's fill waits on the demand pool: it goes first
            if pool is not None:
                pool.shutdown(wait=wait)
        if wait:
            self._fills.join()

    def ensure_planned(self) -> None:
        if not self.planned:
            with self._lock:
                if not self.planned:
                    start = self.timeline.now()
                    self._plan()
                    self.planned = True
                    self.timeline.span("plan banks", start, "install", banks=len(self.banks))

    def slots_for_budget(self) -> int:
        banks = self.banks
        per_slot = sum(b.layer.expert_nbytes for b in banks)
        most = max(b.num_experts for b in banks)
        if self.budget_bytes is None:
            return most
        slots = self.slot_budget // per_slot
        if slots < 1:
            raise ConfigurationError(
                f"expert cache budget of {gb_as_given(self.budget_bytes / 1e9)} GB is below the "
                f"minimum of one expert per MoE layer, {gb_at_least(per_slot)} GB for {len(banks)} "
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
        if self.follow_memory and self.moving is None and banks and not self._closed:
            moving_budget.watch(self)
        for bank, slots in zip(banks, self.plan_slots()):
            bank.allocate(slots)
        for tier in filter(None, (self.tiers, self.host_cache)):
            tier.plan(banks)
        for bank, nxt in zip(banks, banks[1:] + [None]):
            bank.next_bank = nxt
        self._numbers = {id(b): i for i, b in enumerate(banks)}

    def follow_budget(self) -> bool:
        """Apply the budget free memory asked for (``moving_budget.follow``), between two model
        calls on the model's thread (``StepRunner.__call__``): whether it moved."""
        return moving_budget.follow(self)

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
        s, st, ahead = self.stats, self.store.stats, self.prefetch_stats
        asked = s.hits + s.misses
        # (the background reads' keys once one was set up or a guess was scored)
        background = self._prefetcher is not None or ahead.predicted or ahead.demand
        span = s.span_seconds
        return {
            "hit_rate": s.hits / asked if asked else math.nan,
            "hits": s.hits,
            "misses": s.misses,
            "evictions": s.evictions,
            "experts_read": s.misses - (self.host_cache.hits if self.host_cache else 0),
            "gb_read": st.bytes_read / 1e9,
            "gb_needed": sum(b.misses * b.layer.expert_nbytes for b in self.banks) / 1e9,
            # (a store reading past the page cache: the safetensors store's ``direct``)
            **({"gb_uncached": st.uncached_bytes / 1e9} if _uncached(self.store) else {}),
            "io_seconds": st.seconds,
            "io_wait_seconds": s.io_wait_seconds,
            "miss_read_busy_seconds": s.miss_read_busy_seconds,
            "install_seconds": s.install_seconds,
            "span_seconds": span,
            "other_seconds": max(0.0, span - s.io_wait_seconds - s.install_seconds),
            "cache_gb": self.resident_bytes / 1e9,
            "complete_layers": sum(b.complete for b in self.banks),
            **share_limits.summary(self.steps),
            "per_layer": [b.summary() for b in self.banks],
            **(t.summary() if (t := self.tiers or self.host_cache) is not None else {}),
            **(ahead.summary() if background else {}),
            **(self.moving.summary() if self.moving is not None else {}),
        }


def _uncached(store) -> bool:
    return getattr(store, "uncached", None) is not None


def close_all() -> None:
    """Stop every cache's background reads and join their threads (an ``atexit`` handler).

    A daemon thread still inside an MLX call when the interpreter finalizes is ended by Python 3.11
    as it takes the GIL back, and that unwinds through a C++ destructor: ``terminate called without
    an active exception``, exit 134 (docs/reliability.md). A cache whose model was collected with
    ``close(wait=False)`` is here too, for as long as its threads keep it alive."""
    for cache in list(_LIVE):
        cache.close(wait=True)
