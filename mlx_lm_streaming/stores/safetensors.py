"""``safetensors`` (default): positional reads from the checkpoint in place, no conversion.

Each file is opened once; ranges are read with ``os.preadv`` straight into the caller's buffers (the GIL
is released during the read), in parallel on a small thread pool when several ranges are asked for at
once. Short reads and EINTR are retried; other errors raise ``ExpertIOError`` naming file and tensor.
Before and after a batch touches a file, its size, mtime and inode (of the open file and of the path)
are compared with what the index saw, so a checkpoint replaced, truncated, deleted or rewritten after
load (even during the read) is an error, never silently different logits.
"""

import os
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from ..errors import CheckpointChangedError, ConfigurationError, ExpertIOError
from ..safetensors_header import TensorRef
from .base import ExpertStore, shard_error, switch_option, thread_count

# reads in flight: a fast disk gives one reader less than several, and cold decode on the H200 ran
# faster with 8 than with 4, 16 no better (docs/benchmarks/README.md, "What won")
DEFAULT_THREADS = 8
MAX_RETRIES = 8
# ranges longer than this are read as pieces of this size in parallel, so that even one expert (a
# few ranges, most of its bytes in three) keeps every reader busy; None: one read per range
DEFAULT_CHUNK_BYTES: Optional[int] = None
# each reading thread opens its own descriptor of a shard instead of all sharing one (some kernels,
# gVisor's among them, may serialize reads of one open file)
DEFAULT_FD_PER_THREAD = False


def _chunk_option(value) -> Optional[int]:
    """The ``chunk_bytes`` store option: None or 0 (whole ranges), else a whole number of bytes,
    at least 512."""
    if value is None or (value == 0 and not isinstance(value, bool)):
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 512:
        raise ConfigurationError(
            f"chunk_bytes={value!r}: must be 0 (whole ranges) or a whole number of "
            "bytes, at least 512"
        )
    return value


class SafetensorsStore(ExpertStore):
    """Reads expert byte ranges straight from the safetensors shards."""

    name = "safetensors"
    option_checks = {
        "threads": thread_count,
        "chunk_bytes": _chunk_option,
        "fd_per_thread": lambda v: switch_option(v, "fd_per_thread"),
    }

    def __init__(
        self,
        files,
        threads: int = DEFAULT_THREADS,
        chunk_bytes=DEFAULT_CHUNK_BYTES,
        fd_per_thread=DEFAULT_FD_PER_THREAD,
        **options,
    ):
        super().__init__(files)
        self.threads = thread_count(threads)
        self.chunk_bytes = _chunk_option(chunk_bytes)
        self.fd_per_thread = switch_option(fd_per_thread, "fd_per_thread")
        self._fds: Dict[Path, int] = {}
        # fd_per_thread: each thread's own descriptors (path -> fd), and every one opened, to close
        self._local = threading.local()
        self._thread_fds: List[int] = []

    def _fd(self, path: Path) -> int:
        if not self.fd_per_thread:
            return self._per_file(self._fds, path, self._open)
        mine = getattr(self._local, "fds", None)
        if mine is None:
            mine = self._local.fds = {}
        fd = mine.get(path)
        if fd is None:
            fd = self._open(path)
            with self._lock:
                if self._closed:
                    os.close(fd)
                    raise self._closed_error()
                self._thread_fds.append(fd)
            mine[path] = fd
        return fd

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

    def _read(self, ref: TensorRef, out: memoryview, start: int = 0, end: int = -1) -> None:
        """Bytes ``start:end`` of ``ref`` (all by default) into the same bytes of ``out``."""
        fd = self._fd(ref.file)
        end = ref.nbytes if end < 0 else end
        done, retries = start, 0
        while done < end:
            try:
                n = os.preadv(fd, [out[done:end]], ref.offset + done)
            except InterruptedError:
                retries += 1
                if retries > MAX_RETRIES:
                    raise ExpertIOError(
                        f"{ref.file}: reading tensor {ref.name!r} was interrupted "
                        f"{MAX_RETRIES} times in a row"
                    )
                continue
            except OSError as e:
                raise ExpertIOError(
                    f"{ref.file}: reading tensor {ref.name!r} ({ref.nbytes} bytes at offset "
                    f"{ref.offset}) failed: {e}"
                ) from e
            if n == 0:
                raise CheckpointChangedError(
                    f"{ref.file}: ended early while reading tensor {ref.name!r} (file "
                    "truncated after load?)"
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
        pieces = self._pieces(jobs, self.chunk_bytes)
        if self.threads == 1 or len(pieces) == 1 or not spread:
            for piece in pieces:
                self._read(*piece)
        else:
            pool = self._reader_pool()
            # list() re-raises the first error of any read
            list(pool.map(lambda piece: self._read(*piece), pieces))
        # again after: a change that raced with the reads is caught before the bytes are used
        self._check(files)
        self.stats.add(
            len(jobs), sum(r.nbytes for r, _ in jobs), time.perf_counter() - start
        )

    def _pieces(self, jobs, size: Optional[int]):
        """``(ref, out, start, end)`` reads: whole ranges, or pieces of ``size`` of long ones."""
        if size is None or self.threads == 1:
            return [(ref, out, 0, ref.nbytes) for ref, out in jobs]
        return [
            (ref, out, a, min(a + size, ref.nbytes))
            for ref, out in jobs
            for a in range(0, max(ref.nbytes, 1), size)
        ]

    def close(self, wait: bool = True) -> None:
        """``wait=False``: do not join the reader threads (see ``ExpertCache.close``)."""
        with self._lock:
            self._closed = True
            fds = list(self._fds.values()) + self._thread_fds
            self._fds, self._thread_fds = {}, []
        if self._pool is not None:
            self._pool.shutdown(wait=wait)
            self._pool = None
        for fd in fds:
            os.close(fd)
