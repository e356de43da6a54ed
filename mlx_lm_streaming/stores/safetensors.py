"""``safetensors`` (default): positional reads from the checkpoint in place, no conversion.

Each file is opened once; ranges are read with ``os.preadv`` straight into the caller's buffers (the GIL
is released during the read), in parallel on a small thread pool when several ranges are asked for at
once. Ranges asked for together that follow each other in a file (an expert's tensors where the
checkpoint keeps them side by side, as Hugging Face's per-expert layout often does; neighbouring
experts of a stacked tensor) are one read that scatters into their buffers. Short reads and EINTR
are retried; other errors raise ``ExpertIOError`` naming file and tensor.
Option ``direct`` (default off; Linux only, refused on macOS): a range the page cache holds all of
is read from it, any other with O_DIRECT (uncached.py). Off by default until a GPU run shows it
faster: on this CPU's capped disk it was within noise, and slower for a tiny model's small ranges
(docs/benchmarks/streaming-path.md, "Reads past the page cache").
Before and after a batch touches a file, its size, mtime and inode (of the open file and of the path)
are compared with what the index saw, so a checkpoint replaced, truncated, deleted or rewritten after
load (even during the read) is an error, never silently different logits.
"""

import os
import time
from pathlib import Path
from typing import Dict, List, Tuple

from ..errors import CheckpointChangedError, ConfigurationError, ExpertIOError
from ..runtime.reads.safetensors_header import TensorRef
from .base import ExpertStore, after, shard_error, switch_option, thread_count
from .uncached import AVAILABLE, UncachedReads

# reads in flight: a fast disk serves several readers faster than one, and more than 8 gained nothing
# cold (docs/benchmarks/README.md, "What won")
DEFAULT_THREADS = 8
MAX_RETRIES = 8
# buffers of one merged read at most (the OS's limit on one preadv's is 1024 on Linux and macOS)
MAX_BUFFERS = 512


class SafetensorsStore(ExpertStore):
    """Reads expert byte ranges straight from the safetensors shards."""

    name = "safetensors"
    option_checks = {"threads": thread_count, "direct": lambda v: direct_option(v)}

    def __init__(self, files, threads: int = DEFAULT_THREADS, direct=False, **options):
        super().__init__(files)
        self.threads = thread_count(threads)
        self._fds: Dict[Path, int] = {}
        # O_DIRECT for what the page cache lacks (None: buffered reads only)
        self.uncached = UncachedReads(files.check_unchanged) if direct_option(direct) else None

    def _fd(self, path: Path) -> int:
        return self._per_file(self._fds, path, self._open)

    def _open(self, path: Path) -> int:
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError as e:
            raise shard_error(path, e, "open") from e
        try:
            self.files.check_unchanged(path, os.fstat(fd))
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _check(self, paths) -> None:
        """The open file (truncated? rewritten?) and the path (replaced? deleted?) are unchanged."""
        for path in paths:
            fd = self._fd(path)
            self.files.check_unchanged(path, os.fstat(fd))
            try:
                st = os.stat(path)
            except OSError as e:
                raise shard_error(path, e, "stat") from e
            self.files.check_unchanged(path, st)

    def read_into(self, ref: TensorRef, out: memoryview) -> None:
        self._check([ref.file])
        self._read(ref, out)
        self._check([ref.file])

    def _read(self, ref: TensorRef, out: memoryview) -> None:
        """``ref``'s bytes into ``out``."""
        self._read_run([(ref, out)])

    def _read_run(self, run: List[Tuple[TensorRef, memoryview]]) -> None:
        """The ranges of ``run``, which follow each other in one file, in one read that scatters
        into their buffers (``runs``)."""
        ref = run[0][0]
        fd = self._fd(ref.file)
        if len(run) == 1:  # (most runs: one tensor's range; the loops below cost per read)
            end = ref.nbytes
            views = [memoryview(run[0][1])[:end]]
        else:
            views = [memoryview(out)[: r.nbytes] for r, out in run]
            end = sum(r.nbytes for r, _ in run)
        done, retries = 0, 0
        if self.uncached is not None:
            done = self.uncached.read(fd, ref.file, views, ref.offset, end)
            if done:
                self.stats.add_counts(uncached_bytes=done)
        while done < end:
            try:
                n = os.preadv(fd, after(views, done), ref.offset + done)
            except InterruptedError:
                retries += 1
                if retries > MAX_RETRIES:
                    raise ExpertIOError(
                        f"{ref.file}: reading {_what(run)} was interrupted {MAX_RETRIES} times "
                        "in a row"
                    )
                continue
            except OSError as e:
                raise ExpertIOError(
                    f"{ref.file}: reading {_what(run)} ({end} bytes at offset {ref.offset}) "
                    f"failed: {e}"
                ) from e
            if n == 0:
                raise CheckpointChangedError(
                    f"{ref.file}: ended early while reading {_what(run)} (file truncated after "
                    "load?)"
                )
            # a short read is progress: ask again for the rest
            done += n
            retries = 0

    def read_many(self, jobs: List[Tuple[TensorRef, memoryview]]) -> None:
        self._read_jobs(jobs, spread=True)

    def read_on_this_thread(self, jobs: List[Tuple[TensorRef, memoryview]]) -> None:
        if type(self).read_many is not SafetensorsStore.read_many:
            self.read_many(jobs)  # a subclass's own reads: it may have reasons
        else:
            self._read_jobs(jobs, spread=False)

    def _read_jobs(self, jobs, spread: bool) -> None:
        if not jobs:
            return
        start = time.perf_counter()
        files = {ref.file for ref, _ in jobs}
        self._check(files)
        reads = runs(jobs)
        if self.threads == 1 or len(reads) == 1 or not spread:
            for run in reads:
                self._read_run(run)
        else:
            pool = self._reader_pool()
            # list() re-raises the first error of any read
            list(pool.map(self._read_run, reads))
        # again after: a change that raced with the reads is caught before the bytes are used
        self._check(files)
        self.stats.add(
            len(reads), sum(r.nbytes for r, _ in jobs), time.perf_counter() - start
        )

    def close(self, wait: bool = True) -> None:
        """``wait=False``: do not join the reader threads (see ``ExpertCache.close``)."""
        with self._lock:
            self._closed = True
            fds = list(self._fds.values())
            self._fds = {}
        if self._pool is not None:
            self._pool.shutdown(wait=wait)
            self._pool = None
        for fd in fds:
            os.close(fd)
        if self.uncached is not None:
            self.uncached.close()


def _what(run) -> str:
    """The tensors of a run, as an error names them."""
    what = f"tensor {run[0][0].name!r}"
    return what + (f" and the {len(run) - 1} after it" if len(run) > 1 else "")


def direct_option(value) -> bool:
    """The ``direct`` option: true only where the platform has O_DIRECT."""
    direct = switch_option(value, "direct")
    if direct and not AVAILABLE:
        raise ConfigurationError(
            f"direct={value!r}: reads past the page cache need O_DIRECT (Linux); give direct=false"
        )
    return direct


def runs(jobs: List[Tuple[TensorRef, memoryview]]) -> List[List[Tuple[TensorRef, memoryview]]]:
    """``jobs`` in file order, grouped into runs of ranges that follow each other in one file
    (at most ``MAX_BUFFERS`` a run): each run is one read."""
    out: List[List[Tuple[TensorRef, memoryview]]] = []
    end = None  # (file, offset) where the last run ends
    for ref, buf in sorted(jobs, key=lambda job: (str(job[0].file), job[0].offset)):
        if end == (ref.file, ref.offset) and len(out[-1]) < MAX_BUFFERS:
            out[-1].append((ref, buf))
        else:
            out.append([(ref, buf)])
        end = (ref.file, ref.offset + ref.nbytes)
    return out

