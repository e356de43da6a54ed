"""Counters that several threads add to: one lock, one ``add`` (the cache's and the stores' stats);
the cache's, ``CacheStats``."""

import threading
import time
from dataclasses import dataclass, field
from typing import Optional


@dataclass
class Counters:
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add_counts(self, **deltas) -> None:
        """Add each of ``deltas`` to the counter of that name, all at once."""
        with self.lock:
            for name, value in deltas.items():
                setattr(self, name, getattr(self, name) + value)


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
    # seconds with at least one demand read of a miss in flight, on any thread (the disk busy
    # for the misses; against ``io_wait_seconds``, the wait the decode saw): ``read_began``,
    # ``read_ended``
    miss_read_busy_seconds: float = 0.0
    _reads_in_flight: int = field(default=0, repr=False)
    _busy_since: float = field(default=0.0, repr=False)
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
        with self.lock:  # (``add_counts``, spelt out: once per layer call)
            self.hits += hits
            self.misses += misses
            self.evictions += evictions
        self.last_request = time.perf_counter()

    @property
    def span_seconds(self) -> float:
        if self.first_request is None or self.last_request is None:
            return 0.0
        return max(0.0, self.last_request - self.first_request)

    def add_time(self, io_wait: float, install: float) -> None:
        with self.lock:  # (``add_counts``, spelt out: once per load)
            self.io_wait_seconds += io_wait
            self.install_seconds += install

    def read_began(self) -> float:
        """A demand read of a miss starts (any thread): ``perf_counter()`` now."""
        now = time.perf_counter()
        with self.lock:
            if self._reads_in_flight == 0:
                self._busy_since = now
            self._reads_in_flight += 1
        return now

    def read_ended(self) -> None:
        """A demand read that ``read_began`` ended, or failed."""
        now = time.perf_counter()
        with self.lock:
            self._reads_in_flight -= 1
            if self._reads_in_flight == 0:
                self.miss_read_busy_seconds += now - self._busy_since
