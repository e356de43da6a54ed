"""Counters that several threads add to: one lock, one ``add`` (the cache's and the stores' stats)."""

import threading
from dataclasses import dataclass, field


@dataclass
class Counters:
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add_counts(self, **deltas) -> None:
        """Add each of ``deltas`` to the counter of that name, all at once."""
        with self.lock:
            for name, value in deltas.items():
                setattr(self, name, getattr(self, name) + value)
