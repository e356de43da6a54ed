"""Expert cache: a byte budget split into per-layer slot banks.

Each MoE layer owns a ``LayerBank``: for every tensor of an expert (``gate_proj.weight``,
``gate_proj.scales``, ...) one array of shape ``(slots, *expert_shape)``. The stock mlx-lm
``SwitchGLU`` of the layer keeps its own code, activation and quantization settings; only its arrays
are swapped for the banks. The router's expert ids become slot ids (``slot_of[expert]``) passed to
``gather_qmm`` as data, so nothing is stacked or rebuilt per token.

Loading experts into slots never evicts an expert the current call pins (the experts it is about to
compute). The budget is global: every layer gets the same number of slots,
``budget // sum(bytes of one expert of each layer)``, at most the layer's expert count.
"""

import math
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import mlx.core as mx
import numpy as np

from .errors import ConfigurationError
from .index import LayerExperts

GB = 1 << 30


@dataclass
class CacheStats:
    """Expert requests served from the banks (hits) or read from the store (misses)."""

    hits: int = 0
    misses: int = 0
    evictions: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, hits: int, misses: int, evictions: int) -> None:
        with self.lock:
            self.hits += hits
            self.misses += misses
            self.evictions += evictions


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

    @property
    def path(self) -> str:
        return self.layer.path

    def allocate(self, slots: int) -> None:
        """Give the bank ``slots`` slots, zeroed.

        The banks are evaluated here and after every update: MLX ties a lazy array to the stream of
        the thread that built it, and evaluating it from another thread fails ("There is no Stream(cpu,
        N) in current thread"), so a bank must never be left lazy for the next caller's thread.
        """
        self.slots = slots
        self.slot_of[:] = -1
        self.expert_of = np.full(slots, -1, dtype=np.int64)
        self.last_used = np.full(slots, -1, dtype=np.int64)
        for spec in self.layer.parts:
            proj = self.glu[spec.proj]
            proj[spec.part] = mx.zeros((slots, *spec.shape), dtype=_mx_dtype(spec.dtype))
        mx.eval([self.array(spec.proj, spec.part) for spec in self.layer.parts])

    def array(self, proj: str, part: str) -> mx.array:
        return self.glu[proj][part]

    @property
    def resident_bytes(self) -> int:
        return self.slots * self.layer.expert_nbytes

    def load(self, experts: np.ndarray) -> None:
        """Make every expert in ``experts`` (unique ids, at most ``slots``) resident."""
        self.cache.ensure_planned()
        if len(experts) > self.slots:
            raise ValueError(
                f"{self.path}: {len(experts)} experts asked for at once but the bank has "
                f"{self.slots} slots"
            )
        with self.lock:
            tick = self.cache.tick()
            slots = self.slot_of[experts]
            hit = slots >= 0
            self.last_used[slots[hit]] = tick
            missing = experts[~hit]
            evicted = 0
            if len(missing):
                # victims: free slots first, then least recently used; pinned slots never
                priority = self.last_used.copy()
                priority[slots[hit]] = np.iinfo(np.int64).max
                victims = np.argsort(priority, kind="stable")[: len(missing)]
                old = self.expert_of[victims]
                evicted = int((old >= 0).sum())
                self.slot_of[old[old >= 0]] = -1
                # free before reading: if the read fails, no slot may still name an evicted expert
                # (evicting that slot later would unmap the expert from wherever it lives by then)
                self.expert_of[victims] = -1
                self.last_used[victims] = -1
                self._read_into_slots(missing, victims)
                self.slot_of[missing] = victims
                self.expert_of[victims] = missing
                self.last_used[victims] = tick
            self.cache.stats.add(int(hit.sum()), len(missing), evicted)

    def _read_into_slots(self, experts: np.ndarray, slots: np.ndarray) -> None:
        parts = self.layer.parts
        staging = [np.empty((len(experts), p.nbytes), dtype=np.uint8) for p in parts]
        jobs = []
        for row, e in enumerate(experts.tolist()):
            for ref, buf in zip(self.layer.refs(e), staging):
                jobs.append((ref, memoryview(buf[row])))
        self.cache.store.read_many(jobs)
        idx = mx.array(slots.astype(np.uint32))
        for spec, buf in zip(parts, staging):
            values = mx.array(buf).view(_mx_dtype(spec.dtype))
            bank = self.array(spec.proj, spec.part)
            # in place: the SwitchGLU's own array object is updated
            bank[idx] = values.reshape(len(experts), *spec.shape)
        # evaluated now, in this thread (see ``allocate``)
        mx.eval([self.array(spec.proj, spec.part) for spec in parts])


def _mx_dtype(name: str):
    from .index import DTYPES

    return DTYPES[name][0]


class ExpertCache:
    """All slot banks of one model, sharing one byte budget and one store."""

    def __init__(self, store, budget_bytes: Optional[int] = None):
        self.store = store
        self.budget_bytes = budget_bytes
        self.stats = CacheStats()
        self._banks: "weakref.WeakSet[LayerBank]" = weakref.WeakSet()
        self._planned = False
        self._tick = 0
        self._lock = threading.Lock()

    def register(self, layer: LayerExperts, glu) -> LayerBank:
        bank = LayerBank(self, layer, glu)
        self._banks.add(bank)
        self._planned = False
        return bank

    def unregister(self, bank: LayerBank) -> None:
        """Drop a bank whose layer left the model (a pipeline stage keeps only its own layers)."""
        self._banks.discard(bank)
        self._planned = False

    @property
    def banks(self) -> List[LayerBank]:
        return sorted(self._banks, key=lambda b: b.path)

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

    def _plan(self) -> None:
        slots = self.slots_for_budget()
        for bank in self.banks:
            bank.allocate(min(slots, bank.num_experts))

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
            "cache_gb": self.resident_bytes / GB,
        }
