"""The memory a streaming model may use: this machine's RAM (asked of the OS in one place), its swap,
the GPU's memory on CUDA, and which of them the default expert cache budget is a share of."""

import ctypes
import os
import sys
from typing import Optional, Tuple

import mlx.core as mx

from ...option_table import GB
from ..sizes import decimal_gb

# Of the memory the resident weights leave free, this share goes to the expert cache by default.
# Where the expert cache is in the machine's RAM (CPU, Metal's unified memory) the rest holds the
# OS and other programs, the KV cache, activations and the page cache: the page cache's share is
# worth less than the same bytes of expert cache, but what the OS and other programs need is not
# measured, so half stays free. On CUDA the expert cache is in GPU memory and the page cache in host
# RAM: they do not compete, and the share is of the GPU's memory, the rest for the KV cache and
# activations (docs/benchmarks/README.md, "Page cache or expert cache").
DEFAULT_CACHE_SHARE = 0.5
CUDA_CACHE_SHARE = 0.8
# what the default budget assumes where the OS does not say how much memory there is
ASSUMED_MEMORY_BYTES = 16 * GB
_memory_warned = False


def _ram() -> Tuple[Optional[int], str]:
    """``(bytes, "")``: this machine's RAM as the OS gives it; ``(None, why)`` where it does not."""
    try:
        page, pages = os.sysconf("SC_PAGE_SIZE"), os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError) as e:
        return None, f"{type(e).__name__}: {e}"
    if page > 0 and pages > 0:
        return page * pages, ""
    return None, f"page size {page}, pages {pages}"


def physical_memory_bytes() -> int:
    """This machine's RAM; where the OS does not tell, ``ASSUMED_MEMORY_BYTES``, said once on
    stderr (the default expert budget depends on it)."""
    global _memory_warned
    ram, why = _ram()
    if ram is not None:
        return ram
    if not _memory_warned:
        _memory_warned = True
        print(
            f"mlx-lm-streaming: cannot read this machine's memory size from the OS ({why}); the "
            f"default expert cache budget assumes {ASSUMED_MEMORY_BYTES // GB} GB: set "
            "--expert-cache-gb (MLX_LM_STREAMING_CACHE_GB) to choose it",
            file=sys.stderr,
            flush=True,
        )
    return ASSUMED_MEMORY_BYTES


def _macos_swap_bytes() -> int:
    import ctypes
    import ctypes.util

    class XswUsage(ctypes.Structure):
        _fields_ = [
            ("total", ctypes.c_uint64),
            ("avail", ctypes.c_uint64),
            ("used", ctypes.c_uint64),
            ("pagesize", ctypes.c_uint32),
            ("encrypted", ctypes.c_bool),
        ]

    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    usage = XswUsage()
    size = ctypes.c_size_t(ctypes.sizeof(usage))
    if libc.sysctlbyname(b"vm.swapusage", ctypes.byref(usage), ctypes.byref(size), None, 0):
        return 0
    return int(usage.total)


def swap_bytes() -> int:
    """The swap space configured on this machine (0 where the OS does not say)."""
    try:
        if sys.platform == "darwin":
            return _macos_swap_bytes()
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("SwapTotal:"):
                    return int(line.split()[1]) * 1024
    except Exception:
        pass
    return 0


def memory_and_swap() -> Optional[tuple]:
    """``(ram, swap)`` in bytes, or None where the OS does not say how much memory there is."""
    ram, _ = _ram()
    return None if ram is None else (ram, swap_bytes())


def cuda_memory_bytes() -> Optional[int]:
    """The GPU's memory where MLX runs on CUDA (``mx.device_info()["total_memory"]``), else None:
    there the expert cache's arrays live in it, not in the machine's RAM."""
    try:
        cuda = getattr(mx, "cuda", None)
        if mx.default_device().type != mx.gpu or cuda is None or not cuda.is_available():
            return None
        total = mx.device_info().get("total_memory")
    except Exception:  # an MLX without these calls: the machine's RAM, as before
        return None
    return int(total) if isinstance(total, int) and total > 0 else None


def budget_base():
    """``(memory, share, what)``: the memory the default budget is a share of, the share
    (``DEFAULT_CACHE_SHARE``, ``CUDA_CACHE_SHARE``), and what the load line calls it."""
    gpu = cuda_memory_bytes()
    if gpu is not None:
        return gpu, CUDA_CACHE_SHARE, "GPU memory"
    return physical_memory_bytes(), DEFAULT_CACHE_SHARE, "memory"


def trim_heap() -> None:
    """On Linux with glibc: the heap's free pages back to the OS (``malloc_trim(0)``); elsewhere
    nothing (``ExpertCache.follow_budget`` after a shrink: MLX frees small buffers to the heap)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def staged_sets(cache) -> bool:
    """Whether a long prompt's layer sets are filled through a stage on the device
    (``CacheTuning.set_stage`` "device", with device copies, where MLX runs on CUDA)."""
    tuning = cache.tuning
    if not (tuning.set_stage == "device" and tuning.device_copies):
        return False
    from ..bank import cuda_copy

    return cuda_copy.on_cuda()


def layer_sets_fit(cache, resident_bytes: int) -> Tuple[int, Optional[str]]:
    """``(bytes, why)``: what two layers' whole expert sets take (a long prompt's prefill:
    ``bank.layer_set``), and None where they fit beside the budget, else why a long prompt's
    layers go in waves through the slots: the resident weights, the slots the budget gives and
    both sets within this machine's memory (the GPU's on CUDA: ``budget_base``). Where a stage
    is made on the device (``staged_sets``) the bytes are three sets', or two where three do not
    fit and two do (the prompt's sets then fill without the stage: ``LayerSets.staged``). The load
    line says which (``report.choice_line``)."""
    from ..bank.layer_set import largest_set

    banks = cache.banks
    one = largest_set(banks)
    nbytes = 2 * one
    if not cache.tuning.layer_sets:
        return nbytes, "layer sets turned off (CacheTuning.layer_sets)"
    if cache.host_cache is not None:
        return nbytes, "a host cache serves the misses (--expert-host-gb)"
    total, _, what = budget_base()
    slots = sum(n * b.layer.expert_nbytes for n, b in zip(cache.plan_slots(), banks))
    if cache.tiers is not None:  # (two tiers: the device holds the device tier's slots alone)
        slots = cache.tiers.device_bytes
    if staged_sets(cache) and resident_bytes + slots + nbytes + one <= total:
        return nbytes + one, None  # (a stage on the device beside the two: ``set_stage``)
    if resident_bytes + slots + nbytes > total:
        return nbytes, (
            f"two layers' experts, {decimal_gb(nbytes)}, do not fit beside the resident weights "
            f"and the budget in the {decimal_gb(total)} of {what}"
        )
    return nbytes, None
