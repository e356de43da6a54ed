"""``packed``: one aligned read per expert from ``experts.pack`` (made by ``mlx_lm_streaming pack``).

The expert cache asks for an expert's tensors as separate ranges of the safetensors shards; this store
finds them in the pack (by shard and offset), and when the ranges asked for are one expert's tensors
back to back it reads them with one ``preadv`` that scatters straight into the caller's buffers.

Options (``store_options``): ``path``, the pack or a directory holding ``experts.pack`` (default
``MODEL/experts.pack``; the ``pack`` option, ``--expert-pack``, sets it); ``direct=True`` opens the pack
with O_DIRECT (reads bypass the page cache, through an aligned bounce buffer per thread);
``verify``: ``"first"`` (default) checks each expert's crc32 on its first read, ``"always"`` on every
read, ``"off"`` never; ``threads`` (default 4).

Opening checks the magic, the header's sha256, that the file is exactly as long as the header says
(a partial pack is rejected), and that every source shard has the size and safetensors header the pack
was made from. A range the pack does not hold is read from the shard itself.
"""

import mmap
import os
import threading
import time
import zlib
from typing import Dict, List, Tuple

from ..errors import CheckpointChangedError, CheckpointError, ConfigurationError, ExpertIOError
from ..files.packfile import HINT, PackFile, align_up, pack_path
from ..runtime.devices import backend
from ..runtime.reads.safetensors_header import FileIdentity, TensorRef
from .base import ExpertStore, after, copy_into, switch_option, thread_count
from .safetensors import SafetensorsStore

BOUNCE = 8 << 20  # O_DIRECT bounce buffer per reader thread
VERIFY = ("first", "always", "off")


def _verify_option(value) -> str:
    if value not in VERIFY:
        raise ConfigurationError(
            f"verify={value!r}: use {', '.join(VERIFY)}"
        )
    return value


def _path_option(value):
    """``path``: a file or directory path (text from ``key=value`` that reads as a number is a
    slip, not a path), or None for the default."""
    if value is not None and not isinstance(value, (str, os.PathLike)):
        raise ConfigurationError(
            f"path={value!r}: give the pack file or its directory"
        )
    return value


class PackedStore(ExpertStore):
    """Reads experts from a pack file: one aligned read per expert."""

    name = "packed"
    option_checks = {
        "path": _path_option,
        "direct": lambda value: switch_option(value, "direct"),
        "verify": _verify_option,
        "threads": thread_count,
    }

    def __init__(self, files, path=None, direct=False, verify="first", threads=4, **options):
        super().__init__(files)
        self.verify = _verify_option(verify)
        self.threads = thread_count(threads)
        direct = switch_option(direct, "direct")
        self.pack = PackFile(
            pack_path(files.model_path, _path_option(path) or None),
            files.model_path,
            direct=direct,
        )
        self.direct = direct
        # O_DIRECT straight into the caller's buffers (when aligned) only on MLX's CPU backend: the
        # buffers can be MLX memory, which on CUDA is unified (cudaMallocManaged) memory, and DMA
        # into it was measured to give wrong bytes on the H200 (logits not bit-identical); there the
        # reads go through the bounce buffer and a CPU copy
        self.dma_into_buffers = backend() == "cpu"
        self._fallback = None
        self._local = threading.local()

    def _check(self) -> None:
        if self._closed:
            raise self._closed_error()
        if FileIdentity.of(os.fstat(self.pack.fd)) != self.pack.identity:
            raise CheckpointChangedError(f"{self.pack.path} changed on disk after it was opened")

    def _bounce(self):
        buf = getattr(self._local, "buf", None)
        if buf is None:
            buf = self._local.buf = mmap.mmap(-1, BOUNCE)  # page-aligned
        return buf

    def _read_entry(self, i: int, outs: List[Tuple[int, memoryview]]) -> None:
        """Read expert ``i``'s bytes into ``outs`` ((inner offset, buffer), contiguous from 0)."""
        entry = self.pack.entries[i]
        total = sum(len(o) for _, o in outs)
        bufs = [o for _, o in outs]
        align = self.pack.align
        if not self.direct:
            self._pread(self.pack.fd, bufs, entry["offset"], total)
        elif self.dma_into_buffers and all(
            len(b) % align == 0 and _address(b) % align == 0 for b in bufs
        ):
            self._pread(self.pack.direct_fd, bufs, entry["offset"], total)
        else:
            # O_DIRECT needs aligned memory: through a page-aligned bounce buffer, in chunks
            bounce = self._bounce()
            pos = 0
            while pos < total:
                n = min(BOUNCE, total - pos)
                self._pread(
                    self.pack.direct_fd,
                    [memoryview(bounce)[: align_up(n, align)]],
                    entry["offset"] + pos,
                    n,
                )
                copy_into(bufs, pos, memoryview(bounce)[:n])
                pos += n
        if total == entry["nbytes"] and (
            self.verify == "always" or (self.verify == "first" and not self.pack.verified[i])
        ):
            crc = 0
            for b in bufs:
                crc = zlib.crc32(b, crc)
            if f"{crc:08x}" != entry["crc32"]:
                raise CheckpointError(
                    f"{self.pack.path}: expert {entry['expert']} of {entry['layer']} fails its "
                    f"checksum (damaged pack); {HINT}"
                )
            self.pack.verified[i] = 1

    def _pread(self, fd, bufs, offset, total) -> None:
        if fd is None:  # closed while this read was on its way
            raise self._closed_error()
        done = 0
        while done < total:
            try:
                n = os.preadv(fd, after(bufs, done), offset + done)
            except InterruptedError:
                continue
            except OSError as e:
                raise ExpertIOError(
                    f"{self.pack.path}: read of {total} bytes at {offset}: {e}"
                ) from e
            if n == 0:
                raise CheckpointChangedError(f"{self.pack.path}: ended early (truncated?)")
            done += n

    def read_into(self, ref: TensorRef, out: memoryview) -> None:
        self.read_many([(ref, out)])

    def read_many(self, jobs) -> None:
        if not jobs:
            return
        start = time.perf_counter()
        self._check()
        groups: Dict[int, List[Tuple[int, memoryview]]] = {}
        rest = []
        for ref, out in jobs:
            hit = self.pack.where.get((ref.file.name, ref.offset))
            if hit is None or ref.nbytes != len(out):
                rest.append((ref, out))
            else:
                groups.setdefault(hit[0], []).append((hit[1], out))
        tasks = []
        for i, outs in groups.items():
            outs.sort(key=lambda t: t[0])
            pos = 0
            contiguous = True
            for inner, o in outs:
                contiguous &= inner == pos
                pos = inner + len(o)
            if contiguous:
                tasks.append((i, outs))
            else:
                # a subset with gaps: read each tensor on its own
                for inner, o in outs:
                    tasks.append((i, [(inner, o)], inner))

        def run(task):
            if len(task) == 2:
                self._read_entry(*task)
            else:
                i, outs, inner = task
                self._pread(
                    self.pack.fd,
                    [outs[0][1]],
                    self.pack.entries[i]["offset"] + inner,
                    len(outs[0][1]),
                )

        if self.threads == 1 or len(tasks) <= 1:
            for t in tasks:
                run(t)
        else:
            try:
                list(self._reader_pool().map(run, tasks))
            except RuntimeError:  # the pool was shut down under us: closed
                if not self._closed:
                    raise
                raise self._closed_error() from None
        if rest:
            self._fallback_store().read_many(rest)
        self._check()
        self.stats.add(len(jobs), sum(r.nbytes for r, _ in jobs), time.perf_counter() - start)

    def _fallback_store(self) -> SafetensorsStore:
        with self._lock:
            if self._closed:
                raise self._closed_error()
            if self._fallback is None:
                self._fallback = SafetensorsStore(self.files, threads=self.threads)
            return self._fallback

    def close(self, wait: bool = True) -> None:
        """``wait=False``: do not join the reader threads (see ``ExpertCache.close``)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pool, self._pool = self._pool, None
            fallback, self._fallback = self._fallback, None
        if pool is not None:
            pool.shutdown(wait=wait)
        if fallback is not None:
            fallback.close(wait=wait)
        self.pack.close()


def _address(buf: memoryview) -> int:
    import ctypes

    return ctypes.addressof(ctypes.c_char.from_buffer(buf))
