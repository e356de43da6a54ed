"""The store interface: read exact byte ranges of a checkpoint into caller-owned buffers.

A store gets the parsed ``CheckpointFiles`` and is asked for ``TensorRef`` ranges. It never decides
what to read; the expert cache does. To add a store, subclass ``ExpertStore``, implement
``read_into`` (and ``read_many`` if you can do better than one range at a time) and register a factory
through the ``register_stores`` hook (see docs/plugins.md).
"""

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import List, Tuple

from ..errors import CheckpointChangedError, ConfigurationError, ExpertIOError
from ..runtime.counters import Counters
from ..runtime.reads.index import CheckpointFiles
from ..runtime.reads.safetensors_header import TensorRef


# the most reader threads a store option may ask for (a typo such as threads=80 still works,
# threads=8000 is a slip; the default: docs/benchmarks/README.md, "What won")
MAX_THREADS = 256


def thread_count(value, name: str = "threads") -> int:
    """The ``threads`` store option: a whole number from 1 to ``MAX_THREADS``, else
    ``ConfigurationError`` naming the option and its value (``threads=abc``, ``0``, ``1.5``)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_THREADS:
        raise ConfigurationError(
            f"{name}={value!r}: give a whole number of reader threads, 1 to "
            f"{MAX_THREADS}"
        )
    return value


def switch_option(value, name: str) -> bool:
    """A yes/no store option (``direct``): a bool, 0 or 1, or true/false, yes/no, on/off."""
    from ..runtime.options import parse_switch

    try:
        return parse_switch(value, name)
    except ConfigurationError:
        raise ConfigurationError(
            f"{name}={value!r}: give true or false (1 or 0)"
        ) from None


def shard_error(path, error: OSError, doing: str) -> Exception:
    """The error to raise for ``error`` while ``doing`` (open, read, stat) a checkpoint shard: the
    file gone since the model was loaded, or the OS refusing."""
    if isinstance(error, FileNotFoundError):
        return CheckpointChangedError(
            f"{path} is gone from disk since the model was loaded; reload the model"
        )
    return ExpertIOError(f"{path}: cannot {doing} checkpoint shard: {error}")


@dataclass
class StoreStats(Counters):
    """Counters every store keeps; the expert cache and ``--streaming-stats`` report them."""

    reads: int = 0
    bytes_read: int = 0
    seconds: float = 0.0
    # of ``bytes_read``, those read past the page cache (O_DIRECT: the safetensors store's
    # ``direct``)
    uncached_bytes: int = 0

    def add(self, reads: int, nbytes: int, seconds: float) -> None:
        self.add_counts(reads=reads, bytes_read=nbytes, seconds=seconds)


class ExpertStore:
    """Reads byte ranges described by ``TensorRef`` into writable buffers."""

    name = "base"
    # option name -> check(value) -> value: what ``plugins.check_store_options`` runs on each
    # option's value before the store is made, so that a bad value is one line naming it (a check
    # raises ``ConfigurationError``); options without a check are the store's own to refuse
    option_checks: dict = {}
    # how many expert reads the cache runs on this store at once (its demand-read pool, at least 2)
    threads = 4

    def __init__(self, files: CheckpointFiles, **options):
        self.files = files
        self.stats = StoreStats()
        # guards what a store opens or starts lazily (files, the reader pool); set by ``close``
        self._lock = threading.Lock()
        self._closed = False
        self._pool = None

    def _closed_error(self) -> ExpertIOError:
        return ExpertIOError(f"store for {self.files.model_path} is closed")

    def _per_file(self, table: dict, path, make):
        """``table[path]``, made by ``make(path)`` on first use, under the lock (a closed store
        raises): the open descriptor or the bytes of a shard, once per store."""
        with self._lock:
            if self._closed:
                raise self._closed_error()
            value = table.get(path)
            if value is None:
                value = table[path] = make(path)
            return value

    def _reader_pool(self) -> ThreadPoolExecutor:
        """``threads`` reader threads, started on first use. Made and taken under the lock: a read
        racing ``close`` gets our ExpertIOError, and no second pool is ever made."""
        with self._lock:
            if self._closed:
                raise self._closed_error()
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    self.threads, thread_name_prefix="mlx-lm-streaming-read"
                )
            return self._pool

    def read_into(self, ref: TensorRef, out: memoryview) -> None:
        """Fill ``out`` (exactly ``ref.nbytes`` long) with the bytes of ``ref``."""
        raise NotImplementedError

    def read_many(self, jobs: List[Tuple[TensorRef, memoryview]]) -> None:
        """Fill every buffer; the default reads them one after another."""
        start = time.perf_counter()
        for ref, out in jobs:
            self.read_into(ref, out)
        self.stats.add(
            len(jobs), sum(r.nbytes for r, _ in jobs), time.perf_counter() - start
        )

    def read_on_this_thread(self, jobs: List[Tuple[TensorRef, memoryview]]) -> None:
        """``read_many`` without handing ranges to other threads: for a caller that reads several
        experts at once, one per thread, where spreading each expert's ranges over the store's
        readers costs more hand-offs than it gains. The default is ``read_many``."""
        self.read_many(jobs)

    def close(self, wait: bool = True) -> None:
        """Release files and threads; the store may not be used afterwards. ``wait=False``: do not
        join threads (the call may come from a garbage-collection finalizer, where joining a thread
        can deadlock)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def after(views: List[memoryview], skip: int) -> List[memoryview]:
    """The buffers ``views`` less their first ``skip`` bytes (a short read's rest: every store's
    ``preadv`` loop)."""
    if not skip:
        return views
    for i, view in enumerate(views):
        if skip < len(view):
            return [view[skip:], *views[i + 1 :]]
        skip -= len(view)
    return []


def copy_into(views: List[memoryview], at: int, data: memoryview) -> None:
    """``data`` into the concatenated ``views`` from byte ``at`` on (a bounce buffer's bytes read
    with O_DIRECT: the packed store, ``uncached``)."""
    for view in after(views, at):
        view = view if view.format == "B" else view.cast("B")
        n = min(len(view), len(data))
        view[:n] = data[:n]
        data = data[n:]
        if not len(data):
            return
