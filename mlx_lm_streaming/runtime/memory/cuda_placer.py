"""Where a managed MLX array's bytes live on mlx-cuda: ``CudaPlacer`` advises and prefetches byte
ranges through the CUDA runtime (``cuda_copy``'s library) and reads the placement back; the two
tiers (``tiers``) are its one user. None of it runs off CUDA (``cuda_placer`` gives None)."""

import ctypes
from typing import Optional

_ADVISE_PREFERRED = 3  # cudaMemAdviseSetPreferredLocation
_ADVISE_ACCESSED_BY = 5  # cudaMemAdviseSetAccessedBy
_UNSET_PREFERRED, _UNSET_ACCESSED_BY = 4, 6  # cudaMemAdviseUnset{PreferredLocation,AccessedBy}
_LOCATION_DEVICE = 1  # cudaMemLocationTypeDevice
_LOCATION_HOST = 2  # cudaMemLocationTypeHost
# cudaMemRangeAttributePreferredLocationType, ...LastPrefetchLocationType (CUDA >= 12.2), and the
# cudaMemLocationType values they give
_ATTR_PREFERRED_TYPE, _ATTR_PREFETCHED_TYPE = 5, 7
_ATTR_CONCURRENT_MANAGED = 89  # cudaDevAttrConcurrentManagedAccess
_LOCATIONS = {1: "device", 2: "host", 3: "host", 4: "host"}


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class CudaPlacer:
    """Advice and prefetch of managed byte ranges through the CUDA runtime (``cuda_copy``'s
    library): ``place(ranges, on_device)``, each range ``(address, nbytes)``."""

    def __init__(self, lib, device: int = 0):
        self.lib, self.device = lib, device
        p, size, i, u = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_uint
        version = ctypes.c_int()
        lib.cudaRuntimeGetVersion(ctypes.byref(version))
        self.version = version.value
        # CUDA 13: cudaMemAdvise / cudaMemPrefetchAsync take a cudaMemLocation; CUDA 12: the
        # _v2 calls do
        self.advise = getattr(lib, "cudaMemAdvise" if self.version >= 13000 else "cudaMemAdvise_v2")
        self.advise.argtypes = [p, size, i, _Location]
        prefetch = "cudaMemPrefetchAsync" if self.version >= 13000 else "cudaMemPrefetchAsync_v2"
        self.prefetch = getattr(lib, prefetch)
        self.prefetch.argtypes = [p, size, _Location, u, p]
        # advice works only where the GPU and the CPU may touch managed memory at once (not on
        # WSL2 or Windows, where a kernel launch migrates every managed page to the device)
        concurrent = ctypes.c_int(0)
        err = lib.cudaDeviceGetAttribute(ctypes.byref(concurrent), _ATTR_CONCURRENT_MANAGED, device)
        if err != 0 or concurrent.value != 1:
            lib.cudaGetLastError()
            raise OSError("the device has no concurrent managed access: no two tiers")
        self.stream = ctypes.c_void_p()
        if lib.cudaStreamCreateWithFlags(ctypes.byref(self.stream), 1) != 0:
            raise OSError("cudaStreamCreateWithFlags failed")

    def place(self, ranges, on_device: bool) -> None:
        device = _Location(_LOCATION_DEVICE, self.device)
        where = device if on_device else _Location(_LOCATION_HOST, 0)
        for address, nbytes in ranges:
            for advice, loc in ((_ADVISE_PREFERRED, where), (_ADVISE_ACCESSED_BY, device)):
                err = self.advise(address, nbytes, advice, loc)
                if err != 0:
                    self.lib.cudaGetLastError()
                    raise OSError(f"cudaMemAdvise({advice}) failed (CUDA error {err})")
            err = self.prefetch(address, nbytes, where, 0, self.stream)
            if err != 0:
                self.lib.cudaGetLastError()
                raise OSError(f"cudaMemPrefetchAsync failed (CUDA error {err})")

    def unplace(self, ranges) -> None:
        """``place``'s advice taken back from each range: stock's managed memory again. MLX keeps
        a freed buffer for the next array of its size (another model's weights, loaded after
        this one was closed), which would keep this advice: host-tier pages preferred on the
        host. Errors are cleared, not raised: where bytes live, not what they are."""
        device = _Location(_LOCATION_DEVICE, self.device)
        for address, nbytes in ranges:
            for advice in (_UNSET_PREFERRED, _UNSET_ACCESSED_BY):
                if self.advise(address, nbytes, advice, device) != 0:
                    self.lib.cudaGetLastError()

    def wait(self) -> None:
        self.lib.cudaStreamSynchronize(self.stream)

    def free_device_bytes(self) -> Optional[int]:
        """The device's free memory (``cudaMemGetInfo``), or None."""
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        if self.lib.cudaMemGetInfo(ctypes.byref(free), ctypes.byref(total)) != 0:
            self.lib.cudaGetLastError()
            return None
        return free.value

    def where(self, address: int, nbytes: int) -> tuple:
        """``(preferred location, last prefetch location)`` of a managed range as the runtime
        reports them: "device", "host" or None (none set, or not known)."""
        get = self.lib.cudaMemRangeGetAttribute
        out = []
        for attribute in _ATTR_PREFERRED_TYPE, _ATTR_PREFETCHED_TYPE:
            value = ctypes.c_int(0)
            err = get(ctypes.byref(value), ctypes.c_size_t(4), attribute,
                      ctypes.c_void_p(address), ctypes.c_size_t(nbytes))
            if err != 0:
                self.lib.cudaGetLastError()
            out.append(None if err else _LOCATIONS.get(value.value))
        return tuple(out)


def cuda_placer() -> Optional[CudaPlacer]:
    """The placer where MLX runs on CUDA and the runtime has the calls, else None."""
    from ..bank import cuda_copy

    if not cuda_copy.on_cuda():
        return None
    lib = cuda_copy._load_runtime()
    if lib is None:
        return None
    try:
        return CudaPlacer(lib)
    except (OSError, AttributeError):
        return None
