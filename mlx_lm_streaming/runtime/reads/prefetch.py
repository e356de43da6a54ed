"""Background expert reads (the reader pool): next-layer lookahead, next-wave reads and filling a
full bank.

Reads run on background threads into staging buffers (numpy, outside MLX); only the thread that calls
the layer writes the slot banks, when it next loads that layer (``LayerBank.load``). A staged expert is
used only if the layer then asks for it, so background reads never change what is computed: they only
move reading off the critical path.

Four producers:

- **lookahead** (lookahead.py): at layer L's host sync, layer L+1's router is applied to layer L's
  input (computed in the same evaluation as layer L's indices, so no extra sync) and its top-k experts
  that are not resident are read while layer L computes;
- **waves**: when a call needs more experts than the bank has slots, the next wave is read while the
  current one computes;
- **fill**: a bank that holds every expert of its layer (``slots == num_experts``) is filled in the
  background at low priority, so that it becomes complete and stops needing host syncs at all;
- **together**: where banks are written through staging (no direct reads: Metal), a verified
  step's misses read together (``bank.load_together``): the banks after the first are read ahead
  while the first one's load reads its own.

Staged bytes are bounded (``ExpertPrefetcher.max_bytes``): a lookahead that does not fit is dropped, the
fill waits for room.
"""

import heapq
import itertools
import threading
import time
from concurrent.futures import Future
from typing import List, Optional

import mlx.core as mx
import numpy as np

from ..no_timeline import NO_TIMELINE
from .host_views import staging_buffer

# priorities: lower runs first
WAVE, LOOKAHEAD, FILL = 0, 1, 2
IDLE_EXIT_S = 30.0


class StagedBatch:
    """Experts of one layer read (or being read) into staging buffers, one array per part.

    The buffers are MLX arrays made from host memory (``host_views.staging_buffer``: no evaluation,
    so no wait behind the model's pending work, and no stream of any thread); reads fill them
    through writable numpy views of their memory. Writing them into a bank is then one
    slice copy per run of slots; filling numpy buffers and making MLX arrays of them only when
    they are written in copies several times slower on the CPU backend (docs/benchmarks/README.md,
    "What won"). Where MLX memory has no writable host view, numpy buffers are used.
    """

    def __init__(self, layer, experts: np.ndarray, kind: str, host: bool = False):
        self.layer = layer
        self.experts = np.asarray(experts, dtype=np.int64)
        self.kind = kind
        self.row = {e: i for i, e in enumerate(self.experts.tolist())}
        n = len(self.experts)
        self.host = host
        self.arrays, self.buffers = [], []
        for p in layer.parts:
            # ``host``: for a bank that copies staged bytes in through its host views
            # (``reads.bank_reads.copy_in``): numpy buffers, no MLX allocation and evaluation per part
            if host:
                arr, view = None, np.empty((n, p.nbytes), dtype=np.uint8)
            else:
                arr, view = staging_buffer(n, p.nbytes)
            self.arrays.append(arr)
            self.buffers.append(view)
        self.nbytes = n * layer.expert_nbytes
        self.future: Future = Future()
        self.released = False
        # experts the batch was made for but that became resident before its read started
        # (``LayerBank.stage``): not read
        self.skip: set = set()

    def wanted(self) -> List[int]:
        """The experts the batch reads."""
        return [e for e in self.experts.tolist() if e not in self.skip]

    def part(self, i: int) -> mx.array:
        """Part ``i`` of every expert of the batch, ``(n, nbytes)`` uint8, as an MLX array."""
        arr = self.arrays[i]
        return arr if arr is not None else mx.array(self.buffers[i])

    def jobs(self):
        out = []
        for row, e in enumerate(self.experts.tolist()):
            if e in self.skip:
                continue
            for ref, buf in zip(self.layer.refs(e), self.buffers):
                out.append((ref, memoryview(buf[row])))
        return out

    def ok(self, wait: bool) -> bool:
        """True once the read succeeded; with ``wait``, blocks until it ended."""
        if not wait and not self.future.done():
            return False
        # not ``result()``: raising the stored error again would add this caller's frames to its
        # traceback, each time, and keep the model they reference alive after it is dropped
        return not self.future.cancelled() and self.future.exception() is None


class PrefetchStats:
    """How well background reads served the layers, and how good the lookahead's guesses are.

    Guesses are scored (``lookahead.score``) whether or not they were read (a layer whose running
    precision is below ``CacheTuning.lookahead_min_precision`` only guesses): ``predicted`` experts
    were guessed and neither resident nor staged already, ``predicted_hit`` of them were then
    missed by the layer, out of ``demand`` misses of guessed layers. Precision = predicted_hit /
    predicted, recall = predicted_hit / demand."""

    def __init__(self):
        self.lock = threading.Lock()
        # experts read in the background; ``together``: a verified step's misses of the banks
        # after the first, read ahead where banks are written through staging (bank.load_together)
        self.staged = {"lookahead": 0, "wave": 0, "fill": 0, "together": 0}
        self.read_bytes = 0  # the bytes of those reads that completed
        self.used = {"lookahead": 0, "wave": 0, "fill": 0, "together": 0}  # of which a load used
        self.dropped = 0  # lookaheads that did not fit the staging bound
        self.predicted = 0
        self.predicted_hit = 0
        self.demand = 0
        self.waited_s = 0.0  # time loads spent waiting for background reads
        # experts whose background read failed (a load that wants one reads it again), and the
        # first error, for ``--streaming-stats`` and for the error of a demand read that fails too
        self.failed = 0
        self.first_error: Optional[str] = None

    def add(self, what: str, kind: str, n: int) -> None:
        with self.lock:
            getattr(self, what)[kind] += n

    def fail(self, experts: int, error: BaseException) -> None:
        """``experts`` background reads failed with ``error``."""
        with self.lock:
            self.failed += experts
            if self.first_error is None:
                self.first_error = f"{type(error).__name__}: {error}"

    def summary(self):
        nan = float("nan")
        return {
            "lookahead_precision": (self.predicted_hit / self.predicted if self.predicted else nan),
            "lookahead_recall": self.predicted_hit / self.demand if self.demand else nan,
            "staged_experts": dict(self.staged),
            "background_gb": self.read_bytes / 1e9,
            "used_experts": dict(self.used),
            "dropped_lookaheads": self.dropped,
            "staged_wait_s": self.waited_s,
            "failed_background_reads": self.failed,
            "first_background_error": self.first_error,
        }


class ExpertPrefetcher:
    """A small pool of reader threads (``threads``) with priorities, and a bound on staged bytes."""

    threads = 2

    def __init__(self, store, max_bytes: int, stats: Optional[PrefetchStats] = None):
        self.store = store
        self.max_bytes = int(max_bytes)
        self.stats = stats if stats is not None else PrefetchStats()  # (the cache's)
        self._cv = threading.Condition()
        self._heap = []
        self._seq = itertools.count()
        self._workers: List[threading.Thread] = []
        self._idle = 0
        self._bytes = 0  # staged or in flight, not yet released
        self._closed = False
        # timeline.Timeline the reads are recorded on, or the null one (records nothing)
        self.timeline = NO_TIMELINE

    # -- accounting ------------------------------------------------------------------------------

    def reserve(self, nbytes: int, block: bool) -> bool:
        with self._cv:
            while not self._closed and self._bytes + nbytes > self.max_bytes and self._bytes > 0:
                if not block:
                    return False
                self._cv.wait()
            if self._closed:
                return False
            self._bytes += nbytes
            return True

    def release(self, batch: StagedBatch) -> None:
        with self._cv:
            if not batch.released:
                batch.released = True
                self._bytes -= batch.nbytes
                self._cv.notify_all()

    @property
    def staged_bytes(self) -> int:
        return self._bytes

    def room(self) -> int:
        """Bytes that can be staged now without waiting."""
        return self.max_bytes - self._bytes

    # -- reading ---------------------------------------------------------------------------------

    def submit(
        self,
        layer,
        experts: np.ndarray,
        kind: str,
        priority: int,
        block=False,
        start=True,
        host=False,
    ):
        """Start reading ``experts`` of ``layer``; None if it does not fit (and ``block`` is off).
        ``host``: numpy staging buffers (``StagedBatch``). ``start=False``: the batch is made
        and its bytes reserved, and its read waits for
        ``start(batch, priority)`` (the caller records the batch first, so that no read of its
        experts can begin before others can see it is coming)."""
        if len(experts) == 0 or self._closed:
            return None  # closed: no MLX work on this (background) thread any more
        batch = StagedBatch(layer, experts, kind, host=host)
        if not self.reserve(batch.nbytes, block):
            if kind == "lookahead":
                with self.stats.lock:
                    self.stats.dropped += 1
            return None
        self.stats.add("staged", kind, len(batch.experts))
        if start and not self.start(batch, priority):
            return None
        return batch

    def start(self, batch: StagedBatch, priority: int) -> bool:
        """Queue a batch made with ``start=False`` for reading; False (and the batch cancelled) if
        the prefetcher was closed meanwhile."""
        with self._cv:
            if self._closed:
                self._bytes -= batch.nbytes
                batch.future.cancel()
                return False
            heapq.heappush(self._heap, (priority, next(self._seq), batch))
            if self._idle == 0 and len(self._workers) < self.threads:
                t = threading.Thread(
                    target=self._work, name="mlx-lm-streaming-prefetch", daemon=True
                )
                self._workers.append(t)
                t.start()
            self._cv.notify_all()
        return True

    def _work(self):
        me = threading.current_thread()
        while True:
            with self._cv:
                self._idle += 1
                deadline = time.monotonic() + IDLE_EXIT_S
                while not self._heap and not self._closed:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._cv.wait(left)
                self._idle -= 1
                if self._closed or not self._heap:
                    self._workers.remove(me)
                    return
                _, _, batch = heapq.heappop(self._heap)
            if not batch.future.set_running_or_notify_cancel():
                continue
            tl = self.timeline
            start = tl.now()
            try:
                self.store.read_many(batch.jobs())
            except BaseException as e:  # the load that wanted it reads again and reports
                tl.batch_read(start, batch, error=e)
                self.stats.fail(len(batch.experts), e)
                batch.future.set_exception(e)
            else:
                tl.batch_read(start, batch)
                with self.stats.lock:
                    self.stats.read_bytes += batch.nbytes
                batch.future.set_result(None)

    def close(self, wait: bool = True) -> None:
        """Stop the threads; staged batches not yet read are cancelled. ``wait``: join the
        threads (their reads in flight end first)."""
        with self._cv:
            self._closed = True
            pending, self._heap = self._heap, []
            workers = list(self._workers)
            self._cv.notify_all()
        for _, _, batch in pending:
            batch.future.cancel()
        for t in workers if wait else ():
            if t is not threading.current_thread():
                t.join()
