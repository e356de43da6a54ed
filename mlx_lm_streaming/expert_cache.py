"""Expert cache: all slot banks of one model, sharing one byte budget, one store and its threads.

The budget is global: every layer gets the same number of slots,
``budget // sum(bytes of one expert of each layer)``, at most the layer's expert count, and what that
leaves of the budget gives one more slot to layers in model order while it lasts (``plan_slots``).
The cache owns what the banks share: the demand read threads, the background reader
(``prefetch.ExpertPrefetcher``: lookahead, next wave) and the fill thread that completes identity
banks, the settings that turn each of them on or off (``CacheTuning``), and the counters behind
``--streaming-stats``.
"""

import math
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

import numpy as np

from .bank import LayerBank
from .cooccurrence import CoactivationPredictor
from .counters import Counters
from .errors import ConfigurationError, ExpertIOError
from .index import LayerExperts, natural_key
from .options import format_size, gb_at_least
from .policy import DEFAULT_POLICY
from .prefetch import FILL, ExpertPrefetcher, StagedBatch

GB = 1 << 30
# staging buffers (background reads, and without direct reads demand reads per chunk) are bounded by
# this share of the budget; without direct reads they hold at least two experts (demand reads and the
# next wave go through them), with direct reads nothing needs them: a lookahead that does not fit is
# not read. Peak memory stays within ~2x this over the budget
STAGING_SHARE = 0.05
# experts this big and bigger are read a projection at a time (``CacheTuning.phase_min_bytes``)
PHASE_MIN_BYTES = 16 << 20
# every cache that may have background threads, for ``close_all`` at interpreter exit
_LIVE: "weakref.WeakSet[ExpertCache]" = weakref.WeakSet()


@dataclass
class CacheStats(Counters):
    """Expert requests served from the banks (hits) or read from the store (misses)."""

    hits: int = 0
    misses: int = 0
    evictions: int = 0
    # seconds the calling thread waited for expert bytes (reads and staged reads), and spent
    # writing them into the banks
    io_wait_seconds: float = 0.0
    install_seconds: float = 0.0
    # perf_counter() at the start of the first expert request and the end of the last one: the
    # span that the time split of ``--streaming-stats`` divides
    first_request: Optional[float] = None
    last_request: Optional[float] = None

    def start(self) -> None:
        if self.first_request is None:
            with self.lock:
                if self.first_request is None:
                    self.first_request = time.perf_counter()

    def add(self, hits: int, misses: int, evictions: int) -> None:
        self.add_counts(hits=hits, misses=misses, evictions=evictions)
        self.last_request = time.perf_counter()

    @property
    def span_seconds(self) -> float:
        if self.first_request is None or self.last_request is None:
            return 0.0
        return max(0.0, self.last_request - self.first_request)

    def add_time(self, io_wait: float, install: float) -> None:
        self.add_counts(io_wait_seconds=io_wait, install_seconds=install)


LANDINGS = ("each", "once", "auto")


@dataclass(frozen=True)
class CacheTuning:
    """How an ``ExpertCache`` schedules its reads, fixed at construction. Each setting only moves or
    drops work; none changes what is computed. Users choose ``direct_reads`` (``StreamingOptions``);
    loading derives ``skip_sync``; the rest are defaults that benchmarks and tests vary (through the
    internal ``tuning`` entry of the streaming options, not a user option)."""

    # demand reads straight into the banks (bank_io.py); off: through staging buffers
    direct_reads: bool = True
    # next-layer lookahead (prefetch.py); its guesses are read only while a layer's running
    # precision is at least ``lookahead_min_precision`` (a wrong guess costs a read)
    lookahead: bool = True
    lookahead_min_precision: float = 0.5
    # decode-sized calls stage the lookahead's guesses right after the layer's host sync, so that
    # they are read beside the layer's own misses; off: once the layer's own reads have landed
    # (before its compute ends). This, ``lookahead_depth`` and ``lookahead_into_slots`` are off by
    # default: on the H200 with a stand-in predictor they gain 1.21-1.53x when its guesses are all
    # right and lose on trace routing when they are right 46-60% of the time; right 70-85% (what
    # a trained router gives), one layer ahead, 0.93-1.10 on trace routing: inside the noise
    # (docs/benchmarks/gpu-oracle.md, runs 6 and 7)
    lookahead_early: bool = False
    # how many MoE layers ahead the lookahead guesses (each from its own router applied to this
    # layer's input: the further, the less precise on trained models); 1: the next layer only
    lookahead_depth: int = 1
    # with direct reads, decode-sized guesses are read straight into slots of the guessed layer's
    # bank (``LayerBank.read_ahead``: victims chosen now, the guesses on probation) instead of
    # staging buffers that its call then copies in; off: staged
    lookahead_into_slots: bool = False
    # background fill of identity banks; complete identity banks skip the host sync
    fill: bool = True
    skip_sync: bool = True
    # decode-sized calls whose experts are all resident run with no host sync per layer, checked
    # once per call (``verified_step.py``)
    verified_steps: bool = True
    # with direct reads, experts of at least this many bytes are read a projection at a time
    # (``StreamingSwitchGLU._by_projection``); None: never
    phase_min_bytes: Optional[int] = PHASE_MIN_BYTES
    # with direct reads, decode-sized calls: "each" computes the hits, then each read expert as it
    # lands; "once" all rows in one call after the reads; "auto": "once" where partial calls are
    # padded (``StreamingSwitchGLU._in_one_landing_call``)
    landings: str = "each"
    # with direct reads and "each": the hits' rows are submitted once the call's reads have been
    # handed to the demand threads, while they are read; off: before the reads are issued (the
    # submission then delays every read of the call)
    reads_first: bool = True
    # with direct reads, a demand thread hands its expert's ranges to the store's reader pool
    # (``read_many``), or reads them itself one after another (``read_serial``): fewer threads
    # and hand-offs per expert, while the demand threads still read several experts at once
    ranges_in_parallel: bool = True
    # with direct reads, experts that landed while the calling thread was busy are reported (and
    # computed, in decode-sized calls) together, in one call; off: one call per expert. Off by
    # default: within noise on the H200 (0.98-1.01 of one call each; docs/benchmarks/gpu-oracle.md)
    batch_landings: bool = False
    # lookahead guesses from the co-activation of experts in consecutive layers, learnt online
    # from the routing seen so far (cooccurrence.py), instead of the next layer's router; they are
    # staged right after the layer's host sync, so they are read beside the layer's own misses:
    # ``coactivation_limit`` guesses at most per call, each of score ``coactivation_min_score`` or
    # more, read while the layer's running precision is ``coactivation_min_precision`` or more (the
    # defaults: the best of the replays in docs/routing.md). Off: not faster on the H200 yet
    # (docs/benchmarks/gpu-pipeline.md)
    coactivation: bool = False
    coactivation_limit: int = 2
    coactivation_min_score: float = 0.275
    coactivation_min_precision: float = 0.2
    # bound on bytes staged by background reads; None: ``STAGING_SHARE`` of the budget
    staging_bytes: Optional[int] = None
    prefetch_threads: int = 2
    # hooks for experiments on where bank memory lives (bench/cuda_uvm.py): ``on_slot_written(view)``,
    # with direct reads, on a reader thread, for each part's host view of a slot once an expert's
    # bytes are in it; ``on_bank_views(bank, arrays, addresses)`` when a bank's host views are
    # (re)made. They may move bytes, never change them
    on_slot_written: Optional[Callable[[np.ndarray], None]] = None
    on_bank_views: Optional[Callable[[LayerBank, List, List[int]], None]] = None

    def __post_init__(self):
        if not isinstance(self.lookahead_depth, int) or self.lookahead_depth < 1:
            raise ConfigurationError(
                f"lookahead_depth must be a whole number of layers, 1 or more, not "
                f"{self.lookahead_depth!r}"
            )
        if self.landings not in LANDINGS:
            raise ConfigurationError(
                f"landings must be one of {', '.join(LANDINGS)}, not {self.landings!r}"
            )


class ExpertCache:
    """All slot banks of one model, sharing one byte budget and one store."""

    def __init__(
        self,
        store,
        budget_bytes: Optional[int] = None,
        tuning: CacheTuning = CacheTuning(),
        policy: str = DEFAULT_POLICY,
    ):
        self.store = store
        self.budget_bytes = budget_bytes
        self.tuning = tuning
        self.stats = CacheStats()
        # which resident expert a bank evicts (``policy.POLICIES``)
        self.policy = policy
        # routing_trace.RoutingRecorder that each layer call reports its expert ids to, or None
        self.recorder = None
        # timeline.Timeline that reads, installs, syncs and compute are recorded on, or None
        self.timeline = None
        # verified_step.StepRunner of the model, whose ``current()`` step a layer call joins
        self.steps = None
        self._callers: set = set()  # threads that called a layer; direct reads need just one
        self._demand_pool: Optional[ThreadPoolExecutor] = None
        self._prefetcher: Optional[ExpertPrefetcher] = None
        self._filler: Optional[threading.Thread] = None
        self._fill_queue: List[LayerBank] = []
        self._banks: "weakref.WeakSet[LayerBank]" = weakref.WeakSet()
        self._order: Optional[List[LayerBank]] = None
        self._planned = False
        self._numbers: Dict[int, int] = {}
        # cooccurrence.CoactivationPredictor with ``CacheTuning.coactivation`` (made by ``_plan``)
        self.coactivation = None
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
                    threads = max(2, self.store.threads)
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
                        self.store, self._staging_limit(), self.tuning.prefetch_threads
                    )
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
        return self.prefetcher.stats

    def _staging_limit(self) -> int:
        if self.tuning.staging_bytes is not None:
            return int(self.tuning.staging_bytes)
        biggest = max((b.layer.expert_nbytes for b in self.banks), default=0)
        budget = self.budget_bytes if self.budget_bytes is not None else self.total_expert_bytes
        floor = 0 if self.tuning.direct_reads else 2 * biggest
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
        if not self.tuning.fill or bank._fill_requested or self._closed:
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
                f"expert cache budget of {format_size(self.budget_bytes)} is below the minimum "
                f"of one expert per MoE layer, {format_size(per_slot)} for {len(banks)} layers: "
                f"raise --expert-cache-gb / MLX_LM_STREAMING_CACHE_GB / expert_cache_gb to at "
                f"least {gb_at_least(per_slot)} GB"
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
        banks = self.banks
        for bank, slots in zip(banks, self.plan_slots()):
            bank.allocate(slots)
        self._numbers = {id(b): i for i, b in enumerate(banks)}
        self.coactivation = None
        if self.tuning.coactivation and len(banks) > 1:
            most = max(b.num_experts for b in banks)
            self.coactivation = CoactivationPredictor(len(banks), most, ahead=2)

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
            "experts_read": s.misses,
            "gb_read": st.bytes_read / 1e9,
            "io_seconds": st.seconds,
            "io_wait_seconds": s.io_wait_seconds,
            "install_seconds": s.install_seconds,
            "span_seconds": span,
            "other_seconds": max(0.0, span - s.io_wait_seconds - s.install_seconds),
            "cache_gb": self.resident_bytes / 1e9,
            "complete_layers": sum(b.complete for b in self.banks),
            "per_layer": [b.summary() for b in self.banks],
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
