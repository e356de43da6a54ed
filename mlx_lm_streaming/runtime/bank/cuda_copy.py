"""Slot writes on mlx-cuda through the CUDA runtime's copy engine, instead of host writes.

mlx-cuda allocates arrays in managed memory. A host write into a page the GPU last touched
migrates that page to the host, and the next kernel that reads it faults it back: a direct read
into a slot bank's host view pays for the bytes three times (the read, the migration of the old
bytes out, the migration of the new bytes in, during the next layer's compute). Here a demand read
goes into a page-locked host buffer of the reading thread and is copied into the slot with
``cudaMemcpyAsync`` on that thread's stream: the slot's pages stay on the device. Measured on the
H200 (docs/design.md, "Device copies on mlx-cuda"): several times faster per expert, counting the
device's next read of the slots.

Used only where every check passes (``copier_for``): the default device is a GPU, the CUDA runtime
loads through ctypes with the functions used here, and the bank's memory is managed memory the
runtime knows (``cudaPointerGetAttributes``). Anywhere else (the CPU backend, Metal, whose shared
memory does not migrate, a runtime that will not load) the caller writes through the host views as
before. The bytes written are the same either way, so results are unchanged (exactness).
"""

import ctypes
import functools
import ctypes.util
import dataclasses
import glob
import os
import sys
import threading
from typing import List, Optional, Tuple

import numpy as np

from ...errors import ExpertIOError

# bytes of each reading thread's page-locked buffer: an expert of Qwen3-30B-A3B's shape (2.65 MB) in
# one go; bigger experts in pieces of this size
BUFFER_BYTES = 8 << 20
_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: the runtime works out the direction from the addresses
_MEMORY_TYPE_MANAGED = 3  # cudaMemoryTypeManaged
_STREAM_NON_BLOCKING = 1


class _PointerAttributes(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_int),
        ("device", ctypes.c_int),
        ("devicePointer", ctypes.c_void_p),
        ("hostPointer", ctypes.c_void_p),
        ("reserved", ctypes.c_byte * 256),  # (room for fields a later runtime adds)
    ]


def _runtime_candidates() -> List[str]:
    names = ["libcudart.so.13", "libcudart.so.12", "libcudart.so"]
    found = ctypes.util.find_library("cudart")
    if found:
        names.append(found)
    for d in sys.path:  # the nvidia-cuda-runtime wheels
        names += sorted(glob.glob(os.path.join(d, "nvidia", "*", "lib", "libcudart.so*")))
    return names


@functools.lru_cache(maxsize=1)
def _load_runtime():
    """The CUDA runtime with the signatures used here, or None (looked for once)."""
    for name in _runtime_candidates():
        try:
            lib = ctypes.CDLL(name)
            p, size, i = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
            lib.cudaMemcpyAsync.argtypes = [p, p, size, i, p]
            lib.cudaStreamSynchronize.argtypes = [p]
            lib.cudaStreamCreateWithFlags.argtypes = [ctypes.POINTER(p), ctypes.c_uint]
            lib.cudaStreamDestroy.argtypes = [p]
            lib.cudaHostAlloc.argtypes = [ctypes.POINTER(p), size, ctypes.c_uint]
            lib.cudaFreeHost.argtypes = [p]
            lib.cudaPointerGetAttributes.argtypes = [ctypes.POINTER(_PointerAttributes), p]
            lib.cudaGetLastError.argtypes = []
            lib.cudaMalloc.argtypes = [ctypes.POINTER(p), size]
            lib.cudaFree.argtypes = [p]
        except (OSError, AttributeError):
            continue
        return lib
    return None


class _ThreadBuffer:
    """A reading thread's page-locked buffer and stream, given back when the thread ends."""

    def __init__(self, lib, nbytes: int):
        self.lib = lib
        self.pointer, self.stream = ctypes.c_void_p(), ctypes.c_void_p()
        if lib.cudaHostAlloc(ctypes.byref(self.pointer), nbytes, 0) != 0:
            raise MemoryError(f"cudaHostAlloc of {nbytes} bytes failed")
        if lib.cudaStreamCreateWithFlags(ctypes.byref(self.stream), _STREAM_NON_BLOCKING) != 0:
            lib.cudaFreeHost(self.pointer)
            raise MemoryError("cudaStreamCreateWithFlags failed")
        raw = (ctypes.c_uint8 * nbytes).from_address(self.pointer.value)
        self.array = np.ctypeslib.as_array(raw)

    def __del__(self):
        self.lib.cudaStreamSynchronize(self.stream)
        self.lib.cudaStreamDestroy(self.stream)
        self.lib.cudaFreeHost(self.pointer)


class SlotCopier:
    """Reads ranges into the calling thread's page-locked buffer, then copies them to device
    addresses (``read``)."""

    def __init__(self, lib, buffer_bytes: int = BUFFER_BYTES):
        self.lib = lib
        self.buffer_bytes = buffer_bytes
        self._local = threading.local()

    def manages(self, address: int) -> bool:
        """Whether ``address`` is managed memory the runtime knows (an mlx-cuda array's)."""
        attributes = _PointerAttributes()
        if self.lib.cudaPointerGetAttributes(ctypes.byref(attributes), address) != 0:
            self.lib.cudaGetLastError()  # (clear the runtime's sticky error)
            return False
        return attributes.type == _MEMORY_TYPE_MANAGED

    def _buffer(self) -> _ThreadBuffer:
        buffer = getattr(self._local, "buffer", None)
        if buffer is None:
            buffer = self._local.buffer = _ThreadBuffer(self.lib, self.buffer_bytes)
        return buffer

    def read(self, read_ranges, pieces: List[Tuple[object, int]]) -> None:
        """Each ``(ref, address)`` of ``pieces``: the ref's bytes (a ``TensorRef``) read with
        ``read_ranges`` (a store's ``read_many`` or ``read_on_this_thread``) into this thread's
        buffer, as many at once as fit, then copied to ``address``. Returns once every copy ended."""
        buffer = self._buffer()
        cap = self.buffer_bytes
        group, used = [], 0
        for ref, address in pieces:
            for start in range(0, ref.nbytes, cap):
                n = min(cap, ref.nbytes - start)
                if used + n > cap:
                    self._flush(buffer, read_ranges, group)
                    group, used = [], 0
                part = ref if n == ref.nbytes else _piece(ref, start, n)
                group.append((part, address + start, used))
                used += n
        self._flush(buffer, read_ranges, group)

    def _flush(self, buffer: _ThreadBuffer, read_ranges, group) -> None:
        if not group:
            return
        data = buffer.array
        read_ranges([(ref, memoryview(data[at : at + ref.nbytes])) for ref, _, at in group])
        base = buffer.pointer.value
        err = 0
        for address, at, nbytes in _spans(group):
            err = self.lib.cudaMemcpyAsync(address, base + at, nbytes, _MEMCPY_DEFAULT, buffer.stream)
            if err != 0:
                break
        else:
            err = self.lib.cudaStreamSynchronize(buffer.stream)
        if err != 0:
            self.lib.cudaStreamSynchronize(buffer.stream)  # the buffer is free again either way
            raise ExpertIOError(f"cudaMemcpyAsync into an expert slot failed (CUDA error {err})")


class DeviceStage:
    """Device memory outside MLX (``cudaMalloc``) that a layer set's fill copies its reads into
    while the device computes; ``move`` copies them on into the set's arrays, device to device,
    once the set's layer is about to run and the device is idle (``layer_set.LayerSet.ready``).

    Why (the H200, docs/benchmarks/prefill.md, "The fill's stage, measured"): beside a layer's
    kernels a set's fill straight into the set's managed memory ended 26-28 ms after it began (17
    ms with the device idle), through this stage 20-21 ms, the move 0.3 ms; a 4K prompt's first
    token came 6-15% sooner. The bytes are the same either way (exactness)."""

    host = False  # (``HostStage``: page-locked host memory the readers write themselves)

    def __init__(self, lib, nbytes: int):
        self.lib, self.nbytes = lib, nbytes
        self.pointer, self.stream = ctypes.c_void_p(), ctypes.c_void_p()
        if self._allocate() != 0:
            lib.cudaGetLastError()
            raise MemoryError(f"{nbytes} bytes for a layer set's stage: the allocation failed")
        if lib.cudaStreamCreateWithFlags(ctypes.byref(self.stream), _STREAM_NON_BLOCKING) != 0:
            self._release()
            raise MemoryError("cudaStreamCreateWithFlags failed")
        self.base = self.pointer.value

    def _allocate(self) -> int:
        return self.lib.cudaMalloc(ctypes.byref(self.pointer), self.nbytes)

    def _release(self) -> None:
        self.lib.cudaFree(self.pointer)

    def move(self, copies) -> None:
        """Each ``(address, stage offset, bytes)`` of ``copies`` copied from the stage to
        ``address``; returns once every copy ended."""
        err = 0
        for address, at, nbytes in copies:
            err = self.lib.cudaMemcpyAsync(address, self.base + at, nbytes, _MEMCPY_DEFAULT,
                                           self.stream)  # fmt: skip
            if err != 0:
                break
        else:
            err = self.lib.cudaStreamSynchronize(self.stream)
        if err != 0:
            self.lib.cudaStreamSynchronize(self.stream)
            raise ExpertIOError(f"cudaMemcpyAsync from a layer set's stage: CUDA error {err}")

    def close(self) -> None:
        if self.pointer is not None:
            self.lib.cudaStreamSynchronize(self.stream)
            self.lib.cudaStreamDestroy(self.stream)
            self._release()
            self.pointer = None


class HostStage(DeviceStage):
    """Page-locked host memory (``cudaHostAlloc``) laid out as a layer set, that the fill's
    readers read into with no CUDA call at all while the device computes; ``move`` copies the
    experts read into the set when its layer starts. Costs one set's page-locked host memory; on
    the H200 a 4K prompt was no faster so than straight into the set (docs/benchmarks/prefill.md),
    so it is not the default."""

    host = True

    def _allocate(self) -> int:
        return self.lib.cudaHostAlloc(ctypes.byref(self.pointer), self.nbytes, 0)

    def _release(self) -> None:
        self.lib.cudaFreeHost(self.pointer)

    def view(self) -> np.ndarray:
        """The stage's bytes, for the readers."""
        return np.ctypeslib.as_array((ctypes.c_uint8 * self.nbytes).from_address(self.base))


def _spans(group) -> List[Tuple[int, int, int]]:
    """``(address, buffer offset, bytes)`` of each copy a flush makes: ranges of ``group`` that
    follow each other both in the buffer and at their addresses joined into one (a layer set's
    consecutive experts of one part, ``layer_set.by_expert``: one copy of megabytes instead of
    one per expert and part, many of those a scale's 49 KB on Qwen3-30B-A3B)."""
    spans: List[Tuple[int, int, int]] = []
    for ref, address, at in group:
        if spans:
            last, last_at, n = spans[-1]
            if address == last + n and at == last_at + n:
                spans[-1] = (last, last_at, n + ref.nbytes)
                continue
        spans.append((address, at, ref.nbytes))
    return spans


def _piece(ref, start: int, nbytes: int):
    """Bytes ``start : start + nbytes`` of ``ref``, as a ref of their own."""
    return dataclasses.replace(ref, offset=ref.offset + start, nbytes=nbytes)


_COPIER: Optional[SlotCopier] = None
_CHECKED = False
_LOCK = threading.Lock()


def copier_for(addresses) -> Optional[SlotCopier]:
    """The copier, if every check passes for a bank at ``addresses`` (its parts' memory); else
    None (module docstring)."""
    copier = _shared_copier()
    if copier is None or not all(copier.manages(a) for a in addresses):
        return None
    return copier


def _shared_copier() -> Optional[SlotCopier]:
    """The one copier on mlx-cuda where the runtime loads (looked for once), else None."""
    global _COPIER, _CHECKED
    if not on_cuda():
        return None
    with _LOCK:
        if not _CHECKED:
            _CHECKED = True
            lib = _load_runtime()
            _COPIER = SlotCopier(lib) if lib is not None else None
    return _COPIER


def on_cuda() -> bool:
    """Whether MLX computes on a GPU through its CUDA backend (the checks of ``copier_for``,
    ``cuda_placer`` and the layer sets' stage)."""
    import mlx.core as mx

    return mx.default_device().type == mx.gpu and _cuda_backend(mx)


def _cuda_backend(mx) -> bool:
    cuda = getattr(mx, "cuda", None)
    try:
        return bool(cuda is not None and cuda.is_available())
    except Exception:
        return False
