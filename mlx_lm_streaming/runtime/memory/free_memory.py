"""How much memory is free now, and whether the machine is short of it: one small reader per source.

The expert cache follows these readings when no budget is pinned (``moving_budget.py``). Each source
has a parser that takes the OS's answer as given (text or numbers, so the tests feed it answers) and
a reader that asks the OS; a reader returns None where the OS does not answer, never raises:

- Linux: ``MemAvailable`` in /proc/meminfo (what the kernel can give without swapping: free pages,
  and the page cache and slab it can reclaim); the memory pressure stall information
  (/proc/pressure/memory: the share of the last 10 s in which tasks waited for memory); the cgroup
  v2 limit and usage (memory.max, memory.current) of the process's own group, where it
  runs in one with a limit (a container): the room left under the limit counts, if it is less;
- macOS: the kernel's memory pressure level (``sysctl kern.memorystatus_vm_pressure_level``: 1
  normal, 2 warning, 4 critical) and the free and inactive pages (``host_statistics64`` through
  ctypes). Parsed here from given answers; never run on a Mac (none here), so unmeasured there;
- mlx-cuda: the GPU's free memory (``cudaMemGetInfo``), for a cache whose slots are in GPU memory
  (the device tier); host memory is read as above.

``read_host()`` and ``read_device()`` combine them into a ``Reading``.
"""

import ctypes
import ctypes.util
import functools
import os
import sys
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

from .machine import _ram

# pressure levels of a ``Reading``
NORMAL, SHORT, CRITICAL = 0, 1, 2
# PSI: tasks stalled on memory for at least this share of the last 10 s ("some": at least one
# task; "full": every non-idle task) is a machine short of memory (SHORT), "full" one that is
# thrashing (CRITICAL)
PSI_SOME_SHORT = 10.0
PSI_FULL_CRITICAL = 10.0
# kern.memorystatus_vm_pressure_level's values (kern_memorystatus.h)
MACOS_LEVELS = {1: NORMAL, 2: SHORT, 4: CRITICAL}


@dataclass(frozen=True)
class Reading:
    """One look at memory: ``available``, the bytes that can still be taken without pressure
    (None: unknown); ``total``, the memory they are a part of (the machine's, or a cgroup's limit
    where lower); ``pressure``, ``NORMAL``, ``SHORT`` or ``CRITICAL``; ``source``, where it came
    from (for the stats)."""

    available: Optional[int]
    total: Optional[int]
    pressure: int = NORMAL
    source: str = ""


# -- Linux ----------------------------------------------------------------------------------------


def meminfo_field(text: str, name: str) -> Optional[int]:
    """A ``Name:  N kB`` line of /proc/meminfo as bytes, or None where it is missing."""
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key.strip() == name:
            parts = rest.split()
            try:
                value = int(parts[0])
            except (IndexError, ValueError):
                return None
            return value * 1024 if len(parts) > 1 and parts[1].lower() == "kb" else value
    return None


def psi_level(text: str) -> int:
    """/proc/pressure/memory's ``some avg10=..`` / ``full avg10=..`` lines as a pressure level."""
    avg10 = {}
    for line in text.splitlines():
        words = line.split()
        if not words:
            continue
        for word in words[1:]:
            key, _, value = word.partition("=")
            if key == "avg10":
                try:
                    avg10[words[0]] = float(value)
                except ValueError:
                    pass
    if avg10.get("full", 0.0) >= PSI_FULL_CRITICAL:
        return CRITICAL
    if avg10.get("some", 0.0) >= PSI_SOME_SHORT:
        return SHORT
    return NORMAL


def cgroup_dir(proc_cgroup: str, root: str = "/sys/fs/cgroup") -> Optional[str]:
    """The process's cgroup v2 directory from /proc/self/cgroup's ``0::/path`` line, or None (no
    v2 hierarchy: v1 only)."""
    for line in proc_cgroup.splitlines():
        if line.startswith("0::"):
            return os.path.join(root, line[3:].strip().lstrip("/"))
    return None


def cgroup_limit(max_text: str, current_text: str) -> Optional[Tuple[int, int]]:
    """``(limit, room)`` from a cgroup v2 group's memory.max and memory.current, or None
    where it has no limit (``max``) or an answer is not a number."""
    limit, current = max_text.strip(), current_text.strip()
    if limit == "max":
        return None
    try:
        limit_bytes, used = int(limit), int(current)
    except ValueError:
        return None
    return limit_bytes, max(0, limit_bytes - used)


def _read(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def read_linux(proc: str = "/proc", cgroup_root: str = "/sys/fs/cgroup") -> Optional[Reading]:
    """MemAvailable, the room under the cgroup v2 limit where less, and PSI; None without
    /proc/meminfo."""
    meminfo = _read(os.path.join(proc, "meminfo"))
    if meminfo is None:
        return None
    available = meminfo_field(meminfo, "MemAvailable")
    total = meminfo_field(meminfo, "MemTotal")
    source = "MemAvailable"
    own = _read(os.path.join(proc, "self", "cgroup"))
    where = cgroup_dir(own, cgroup_root) if own else None
    if where is not None:
        max_text = _read(os.path.join(where, "memory.max"))
        current_text = _read(os.path.join(where, "memory.current"))
        limited = cgroup_limit(max_text, current_text) if max_text and current_text else None
        if limited is not None:
            limit, room = limited
            if available is None or room < available:
                available, source = room, "cgroup memory.max"
            total = limit if total is None else min(total, limit)
    psi = _read(os.path.join(proc, "pressure", "memory"))
    pressure = psi_level(psi) if psi else NORMAL
    return Reading(available, total, pressure, source + (", PSI" if psi else ""))


# -- macOS (never run here: no Mac; the parsers are tested with given answers) -------------------


class VmStatistics64(ctypes.Structure):
    """``vm_statistics64`` (mach/vm_statistics.h)."""

    _fields_ = [
        ("free_count", ctypes.c_uint32),
        ("active_count", ctypes.c_uint32),
        ("inactive_count", ctypes.c_uint32),
        ("wire_count", ctypes.c_uint32),
        ("zero_fill_count", ctypes.c_uint64),
        ("reactivations", ctypes.c_uint64),
        ("pageins", ctypes.c_uint64),
        ("pageouts", ctypes.c_uint64),
        ("faults", ctypes.c_uint64),
        ("cow_faults", ctypes.c_uint64),
        ("lookups", ctypes.c_uint64),
        ("hits", ctypes.c_uint64),
        ("purges", ctypes.c_uint64),
        ("purgeable_count", ctypes.c_uint32),
        ("speculative_count", ctypes.c_uint32),
        ("decompressions", ctypes.c_uint64),
        ("compressions", ctypes.c_uint64),
        ("swapins", ctypes.c_uint64),
        ("swapouts", ctypes.c_uint64),
        ("compressor_page_count", ctypes.c_uint32),
        ("throttled_count", ctypes.c_uint32),
        ("external_page_count", ctypes.c_uint32),
        ("internal_page_count", ctypes.c_uint32),
        ("total_uncompressed_pages_in_compressor", ctypes.c_uint64),
    ]


HOST_VM_INFO64 = 4
HOST_VM_INFO64_COUNT = ctypes.sizeof(VmStatistics64) // ctypes.sizeof(ctypes.c_int32)


def macos_level(value: int) -> int:
    """``kern.memorystatus_vm_pressure_level`` as a pressure level (an unknown value: NORMAL)."""
    return MACOS_LEVELS.get(int(value), NORMAL)


def macos_available(stats: VmStatistics64, page_size: int) -> int:
    """Free and inactive pages, in bytes: what the kernel gives without compressing or swapping."""
    return (int(stats.free_count) + int(stats.inactive_count)) * int(page_size)


@functools.lru_cache(maxsize=1)
def _libc():
    return ctypes.CDLL(ctypes.util.find_library("c"))


def read_macos_level(libc=None) -> Optional[int]:
    libc = libc or _libc()
    value, size = ctypes.c_int(0), ctypes.c_size_t(ctypes.sizeof(ctypes.c_int))
    name = b"kern.memorystatus_vm_pressure_level"
    if libc.sysctlbyname(name, ctypes.byref(value), ctypes.byref(size), None, 0):
        return None
    return macos_level(value.value)


def read_macos_pages(libc=None) -> Optional[Tuple[VmStatistics64, int]]:
    """``host_statistics64(mach_host_self(), HOST_VM_INFO64)`` and the page size, or None."""
    libc = libc or _libc()
    libc.mach_host_self.restype = ctypes.c_uint32
    host = libc.mach_host_self()
    stats = VmStatistics64()
    count = ctypes.c_uint32(HOST_VM_INFO64_COUNT)
    if libc.host_statistics64(host, HOST_VM_INFO64, ctypes.byref(stats), ctypes.byref(count)):
        return None
    page = ctypes.c_size_t(0)
    if libc.host_page_size(host, ctypes.byref(page)) or not page.value:
        return None
    return stats, int(page.value)


def read_macos(libc=None) -> Optional[Reading]:
    try:
        libc = libc or _libc()
        pages = read_macos_pages(libc)
        level = read_macos_level(libc)
    except (OSError, AttributeError):
        return None
    if pages is None and level is None:
        return None
    available = macos_available(*pages) if pages is not None else None
    total = _ram()[0]
    return Reading(available, total, NORMAL if level is None else level, "host_statistics64")


# -- the GPU's memory on mlx-cuda -----------------------------------------------------------------


def read_cuda(runtime=None) -> Optional[Reading]:
    """``cudaMemGetInfo``'s free and total bytes of the current device, or None."""
    if runtime is None:
        from ..bank.cuda_copy import _load_runtime

        runtime = _load_runtime()  # (loaded once: this runs every check)
        if runtime is None:
            return None
    free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
    if runtime.cudaMemGetInfo(ctypes.byref(free), ctypes.byref(total)):
        return None
    return Reading(int(free.value), int(total.value), NORMAL, "cudaMemGetInfo")


def read_host() -> Optional[Reading]:
    """Host memory now: Linux or macOS, None elsewhere or where the OS does not answer."""
    try:
        if sys.platform == "darwin":
            return read_macos()
        if sys.platform.startswith("linux"):
            return read_linux()
    except Exception:  # a reader must never stop the model: no reading, the budget holds
        return None
    return None


def read_device() -> Optional[Reading]:
    """The GPU's memory now on mlx-cuda, or None."""
    try:
        return read_cuda()
    except Exception:
        return None


def reader_for(device_memory: bool) -> Callable[[], Optional[Reading]]:
    """The reader for a cache whose slots are in GPU memory (``read_device``) or in RAM."""
    return read_device if device_memory else read_host
