"""CUDA unified-memory hints for the slot banks (experimental; benchmarks only, not in the package).

MLX's CUDA backend allocates arrays with ``cudaMallocManaged``: a page lives on the host or on the GPU
and moves on a fault. With direct reads (``mlx_lm_streaming/bank_io.py``) a missed expert is written into its slot by the
CPU, so its pages move to the host, and the GPU faults them back on first use, a page group at a
time. Two hints, through the CUDA runtime that MLX itself loaded (``ctypes``; nothing is compiled):

- ``prefetch(address, nbytes)``: ``cudaMemPrefetchAsync`` of a landed expert's bytes to the GPU, so
  they move by DMA while the other experts are read, not by faults when the layer computes.
- ``prefer_host(address, nbytes)``: ``cudaMemAdvise`` preferred location host and accessed-by the GPU:
  the pages stay in host memory and the GPU reads them over the bus (no migration either way).

Hints change where bytes live, never their values: results stay bit-identical. Measured only by
``bench/experts.py`` ablations on the H200 (``docs/benchmarks/README.md``); ``hint_hooks`` gives them
as the cache's hooks (``CacheTuning.on_slot_written`` / ``on_bank_views``). Every function
returns False where the runtime or the call is unavailable (CPU, Metal, a CUDA runtime without these
entry points).
"""

import ctypes
import ctypes.util
import threading
from typing import Optional

# cudaMemLocationType and cudaMemoryAdvise values (CUDA runtime API)
_LOCATION_DEVICE = 1
_LOCATION_HOST = 2
_ADVISE_PREFERRED_LOCATION = 3
_ADVISE_ACCESSED_BY = 5
_CPU_DEVICE_ID = -1
_STREAM_PER_THREAD = ctypes.c_void_p(2)  # cudaStreamPerThread


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


_lock = threading.Lock()
_runtime = None  # (library, version) once looked up; False where there is none


def _cudart():
    global _runtime
    with _lock:
        if _runtime is None:
            _runtime = False
            for name in ("libcudart.so.13", "libcudart.so.12", ctypes.util.find_library("cudart")):
                if not name:
                    continue
                try:
                    lib = ctypes.CDLL(name)
                    version = ctypes.c_int(0)
                    if lib.cudaRuntimeGetVersion(ctypes.byref(version)) != 0:
                        continue
                except (OSError, AttributeError):
                    continue
                _runtime = (lib, version.value)
                break
        return _runtime


def available() -> bool:
    return bool(_cudart())


def _on_range(call):
    """A hint ``(address, nbytes, device=0) -> bool`` that runs ``call(lib, cuda13, pointer, size,
    device)`` with the CUDA runtime MLX loaded, and returns False where there is none."""

    def hint(address: int, nbytes: int, device: int = 0) -> bool:
        rt = _cudart()
        if not rt:
            return False
        lib, version = rt
        ptr, size = ctypes.c_void_p(address), ctypes.c_size_t(nbytes)
        return call(lib, version >= 13000, ptr, size, device)

    hint.__name__, hint.__doc__ = call.__name__, call.__doc__
    return hint


@_on_range
def prefetch(lib, v13, ptr, size, device) -> bool:
    """Start moving ``nbytes`` of managed memory at ``address`` to GPU ``device``."""
    if v13:
        location = _Location(_LOCATION_DEVICE, device)
        err = lib.cudaMemPrefetchAsync(ptr, size, location, ctypes.c_uint(0), _STREAM_PER_THREAD)
    else:
        err = lib.cudaMemPrefetchAsync(ptr, size, ctypes.c_int(device), _STREAM_PER_THREAD)
    return err == 0


@_on_range
def prefer_host(lib, v13, ptr, size, device) -> bool:
    """Keep ``nbytes`` at ``address`` in host memory, mapped for GPU ``device`` to read in place."""
    if v13:
        host, gpu = _Location(_LOCATION_HOST, 0), _Location(_LOCATION_DEVICE, device)
    else:
        host, gpu = ctypes.c_int(_CPU_DEVICE_ID), ctypes.c_int(device)
    a = lib.cudaMemAdvise(ptr, size, _ADVISE_PREFERRED_LOCATION, host)
    b = lib.cudaMemAdvise(ptr, size, _ADVISE_ACCESSED_BY, gpu)
    return a == 0 and b == 0


def last_error() -> Optional[str]:
    rt = _cudart()
    if not rt:
        return None
    lib, _ = rt
    lib.cudaGetErrorString.restype = ctypes.c_char_p
    return lib.cudaGetErrorString(lib.cudaGetLastError()).decode()


def hint_hooks(hint: str) -> dict:
    """``CacheTuning`` hooks that give ``hint`` for the banks, with direct reads: "prefetch" (each
    landed expert to the GPU) or "host" (banks that are not identity banks stay in host memory)."""
    if hint == "prefetch":
        return {"on_slot_written": lambda view: prefetch(view.ctypes.data, view.nbytes)}
    if hint == "host":

        def on_bank_views(bank, arrays, addresses):
            if not bank.identity:
                for a, at in zip(arrays, addresses):
                    prefer_host(at, a.nbytes)

        return {"on_bank_views": on_bank_views}
    raise ValueError(f"unknown unified-memory hint {hint!r}: prefetch or host")
