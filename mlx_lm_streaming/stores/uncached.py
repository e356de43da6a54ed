"""Reads at the disk's speed where the bytes are not in the page cache (Linux).

Before a range is read, ``mincore`` on a mapping of the file (never touched: no I/O, no memory)
says whether the page cache holds all of its pages. If it does, the caller reads it buffered, as
before. If not, the range is read with O_DIRECT on a second descriptor of the file, widened to
``ALIGN`` (4 KiB) at both ends, into a page-aligned bounce buffer of the reading thread, and copied
into the caller's buffers: the bytes a caller gets are the file's, as with a buffered read, and the
device never DMAs into the caller's memory (on mlx-cuda that is managed memory, where DMA was
measured to give wrong bytes: stores/packed.py).

Not ``preadv(..., RWF_NOWAIT)`` to ask the page cache first: on a miss it fails with EAGAIN but has
started the kernel's readahead of the range (measured here, Linux 6.18: the page asked for was
cached 0.2 s later), so the disk would read those bytes twice, once into the page cache and once
with O_DIRECT.

Why: on the H200 a stacked checkpoint's nine ranges an expert, read buffered, ran at 1.1-1.2 GB/s
where one O_DIRECT read of a whole expert gave 1.85 (docs/benchmarks/streaming-path.md). The cost:
bytes read with O_DIRECT do not enter the page cache, so an expert evicted and missed again is read
from the disk again where a buffered read might have found it cached.

Where the file cannot be mapped or O_DIRECT is refused (tmpfs on older kernels, some network
file systems) that file's reads stay buffered; a failed or short O_DIRECT read hands back how far
it got and the caller reads the rest buffered, which also reports errors and truncation. Off on
macOS (no O_DIRECT in ``os`` there; F_NOCACHE exists, unverified on a Mac: not used).
"""

import ctypes
import mmap
import os
import threading
from typing import Dict, List, Optional, Tuple

from .base import copy_into

# where the platform has O_DIRECT: Linux
AVAILABLE = hasattr(os, "O_DIRECT") and hasattr(mmap, "PROT_READ")
# O_DIRECT's alignment of file offsets, lengths and memory (the logical block size is at most this
# on the disks we know; a larger one refuses with EINVAL, and the file falls back to buffered)
ALIGN = 4096
# the bounce buffer per reading thread: a whole expert of the shapes we run in one read
BOUNCE = 8 << 20
PAGE = mmap.PAGESIZE


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]  # fmt: skip
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    return libc


LIBC = _libc() if AVAILABLE else None
MAP_FAILED = ctypes.c_void_p(-1).value


class UncachedReads:
    """A store's per-file state for reads past the page cache (on first need: a mapping for
    ``mincore`` and an O_DIRECT descriptor; None where either is refused) and its reading threads'
    bounce buffers. ``check(path, stat)`` raises where an opened file is not the one the index
    saw."""

    def __init__(self, check):
        self._check = check
        self._files: Dict[object, Optional[Tuple[int, int, int]]] = {}
        self._lock = threading.Lock()
        self._local = threading.local()
        self._closed = False

    def _file(self, path, fd: int) -> Optional[Tuple[int, int, int]]:
        """``(mapping address, file size, O_DIRECT descriptor)`` of ``path`` (``fd``: its buffered
        descriptor), or None: read it buffered."""
        with self._lock:
            if path in self._files or self._closed:  # (closed: a read racing close, buffered)
                return self._files.get(path)
            self._files[path] = None
            size = os.fstat(fd).st_size
            addr = LIBC.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0) if size else None
            if addr in (None, MAP_FAILED):
                return None
            try:
                dfd = os.open(path, os.O_RDONLY | os.O_DIRECT | getattr(os, "O_CLOEXEC", 0))
            except OSError:
                LIBC.munmap(addr, size)
                return None  # refused (or gone: the buffered read that follows says so)
            try:
                self._check(path, os.fstat(dfd))
            except BaseException:
                os.close(dfd)
                LIBC.munmap(addr, size)
                raise
            self._files[path] = (addr, size, dfd)
            return self._files[path]

    def _cached(self, addr: int, size: int, offset: int, end: int) -> bool:
        """Whether the page cache holds every page of bytes ``offset .. offset + end``."""
        first = offset // PAGE * PAGE
        n = min(size, offset + end) - first
        if n <= 0:
            return True  # past the end: the buffered read says so
        vec = ctypes.create_string_buffer(-(-n // PAGE))
        if LIBC.mincore(addr + first, n, vec) != 0:
            return True  # cannot tell: buffered, as before
        return b"\0" not in vec.raw

    def _bounce(self) -> mmap.mmap:
        buf = getattr(self._local, "buf", None)
        if buf is None:
            buf = self._local.buf = mmap.mmap(-1, BOUNCE)  # page-aligned
        return buf

    def read(self, fd: int, path, views: List[memoryview], offset: int, end: int) -> int:
        """Bytes ``offset .. offset + end`` of the file (``fd``: its buffered descriptor) into
        ``views`` (together ``end`` bytes) with O_DIRECT where the page cache lacks any of them;
        how many were read that way: 0 where the page cache holds them all or the file refuses,
        fewer than ``end`` where the file ended or a read failed (the caller reads the rest
        buffered)."""
        state = self._file(path, fd)
        if state is None or self._cached(state[0], state[1], offset, end):
            return 0
        dfd, bounce, done = state[2], self._bounce(), 0
        while done < end:
            start = (offset + done) // ALIGN * ALIGN
            skip = offset + done - start
            want = min(BOUNCE, skip + end - done)
            try:
                n = os.preadv(dfd, [memoryview(bounce)[: -(-want // ALIGN) * ALIGN]], start)
            except InterruptedError:
                continue
            except OSError:
                break  # (EINVAL: a block size above ALIGN) the buffered read takes the rest
            got = min(n, want) - skip
            if got <= 0:
                break  # the file ended: the buffered read reports it
            copy_into(views, done, memoryview(bounce)[skip : skip + got])
            done += got
        return done

    def close(self) -> None:
        with self._lock:
            states = [state for state in self._files.values() if state is not None]
            self._files, self._closed = {}, True
        for addr, size, dfd in states:
            os.close(dfd)
            LIBC.munmap(addr, size)
