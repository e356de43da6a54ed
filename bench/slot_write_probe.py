"""How fast expert bytes get from the page cache into slots the GPU last touched (issue 29, item 3):
the ways in, side by side, on a bank laid out as the package's (9 part arrays of 64 slots, the
Qwen3-30B-A3B expert shape, 2.65 MB an expert), the page cache warm.

Before every trial the device reads the whole bank (as a decode step's kernels do), so its pages
sit where the GPU put them. Each trial writes ``--experts`` experts into as many slots, on
``--threads`` threads, then the device reads those slots again (``touch``: on mlx-cuda's managed
memory, pages the host wrote migrate back on that read). Ways in:

- ``direct``: ``preadv`` through the host view into the slots (what the store does today);
- ``prefetch+direct``: the slots' pages moved to the host first (``cudaMemPrefetchAsync``);
- ``pinned+memcpy``: each thread reads an expert into its own page-locked buffer, then
  ``cudaMemcpy`` per range into the slots (no host write into managed pages);
- ``pageable+memcpy``: the same from plain host memory;
- ``mlx update``: read into an MLX staging array, then one slice update per part on the device.

    python3 bench/slot_write_probe.py [--experts 24] [--threads 8] [--out FILE.json]
"""

import argparse
import ctypes
import glob
import itertools
import json
import os
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from read_path_probe import make_file, warm  # noqa: E402

PARTS = [786_432, 49_152, 49_152] * 3
EXPERT = sum(PARTS)
SLOTS = 64


def cudart():
    """The CUDA runtime through ctypes, or None."""
    names = ["libcudart.so.13", "libcudart.so.12", "libcudart.so"]
    for d in sys.path:
        names += sorted(glob.glob(os.path.join(d, "nvidia", "*", "lib", "libcudart.so*")))
    for name in names:
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        lib.cudaMemcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        lib.cudaHostAlloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_uint]
        lib.cudaMemcpyAsync.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                        ctypes.c_int, ctypes.c_void_p]
        lib.cudaStreamSynchronize.argtypes = [ctypes.c_void_p]
        return lib, name
    return None, None


class Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


def prefetcher(lib):
    """``prefetch(address, nbytes)`` to the host, by the runtime's API (CUDA 12 and 13)."""
    version = ctypes.c_int()
    lib.cudaRuntimeGetVersion(ctypes.byref(version))
    fn = getattr(lib, "cudaMemPrefetchAsync_v2", None)
    if fn is None and version.value >= 13000:
        fn = lib.cudaMemPrefetchAsync
    if fn is not None:
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, Location, ctypes.c_uint, ctypes.c_void_p]
        host = Location(2, 0)  # cudaMemLocationTypeHost
        return lambda at, n: fn(at, n, host, 0, None), version.value
    fn = lib.cudaMemPrefetchAsync
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    return lambda at, n: fn(at, n, -1, None), version.value  # cudaCpuDeviceId


def remote_reads(lib, reps: int) -> dict:
    """Experts the GPU reads from host memory inside the graph, with no host round trip (as
    truespar/paddock does on CUDA): ``gather_qmm`` over one Qwen3-shape projection of 128 experts
    (768 x 2048, 4-bit, bf16), 6 picked per token, ms per call, its memory (a) on the device, (b)
    advised to stay on the host and be read from there (``cudaMemAdvise``), (c) just written by
    the host (pages fault back on the read)."""
    import mlx.core as mx

    from mlx_lm_streaming.runtime.host_views import host_address

    fn = getattr(lib, "cudaMemAdvise_v2", None) or lib.cudaMemAdvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, Location]
    w = mx.random.normal((128, 768, 2048)).astype(mx.bfloat16)
    q, scales, biases = mx.quantize(w, group_size=64, bits=4)
    x = mx.random.normal((1, 1, 2048)).astype(mx.bfloat16)
    mx.eval(q, scales, biases, x)
    rng = np.random.default_rng(1)

    def timed():
        times = []
        for _ in range(reps):
            idx = mx.array(rng.choice(128, 6, replace=False).reshape(1, 6).astype(np.uint32))
            mx.eval(idx)
            t = time.perf_counter()
            mx.eval(mx.gather_qmm(x, q, scales, biases, rhs_indices=idx, transpose=True))
            times.append(time.perf_counter() - t)
        return statistics.median(times) * 1e3

    out = {"device": timed()}
    arrays = [q, scales, biases]
    for a in arrays:
        at = host_address(a)
        fn(at, a.nbytes, 3, Location(2, 0))  # cudaMemAdviseSetPreferredLocation: host
        fn(at, a.nbytes, 5, Location(1, 0))  # cudaMemAdviseSetAccessedBy: device 0
        prefetch, _ = prefetcher(lib)
        prefetch(at, a.nbytes)
    lib.cudaDeviceSynchronize()
    out["host, read remotely"] = timed()
    for a in arrays:
        at = host_address(a)
        fn(at, a.nbytes, 4, Location(2, 0))  # cudaMemAdviseUnsetPreferredLocation
        fn(at, a.nbytes, 6, Location(1, 0))  # cudaMemAdviseUnsetAccessedBy
    times = []
    view = np.ctypeslib.as_array((ctypes.c_uint8 * q.nbytes).from_address(host_address(q)))
    for _ in range(reps):
        view[::4096] = view[::4096]  # the host writes every page: they migrate to the host
        idx = mx.array(rng.choice(128, 6, replace=False).reshape(1, 6).astype(np.uint32))
        mx.eval(idx)
        t = time.perf_counter()
        mx.eval(mx.gather_qmm(x, q, scales, biases, rhs_indices=idx, transpose=True))
        times.append(time.perf_counter() - t)
    out["host-written, faulted back"] = statistics.median(times) * 1e3
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default="/tmp")
    ap.add_argument("--file-gb", type=float, default=2.0)
    ap.add_argument("--experts", type=int, default=24)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--remote", action="store_true", help="also time remote_reads (CUDA)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    import mlx.core as mx

    from mlx_lm_streaming.runtime.host_views import host_address, host_bytes

    path = Path(args.dir) / "read_path_probe.bin"
    make_file(path, int(args.file_gb * 1e9))
    warm(path)
    fd = os.open(path, os.O_RDONLY)
    size = path.stat().st_size
    bank = [mx.zeros((SLOTS, n), dtype=mx.uint8) for n in PARTS]
    mx.eval(bank)
    addresses = [host_address(a) for a in bank]
    views = [host_bytes(a, at) for a, at in zip(bank, addresses)]
    lib, libname = cudart()
    gpu = mx.default_device().type == mx.gpu and lib is not None
    pinned = []
    if gpu:
        prefetch, version = prefetcher(lib)
        for _ in range(args.threads):
            p = ctypes.c_void_p()
            assert lib.cudaHostAlloc(ctypes.byref(p), EXPERT, 0) == 0
            pinned.append(np.ctypeslib.as_array((ctypes.c_uint8 * EXPERT).from_address(p.value)))
    pageable = [np.ones(EXPERT, np.uint8) for _ in range(args.threads)]
    staging = mx.zeros((args.experts, EXPERT), dtype=mx.uint8)
    mx.eval(staging)
    staging_view = host_bytes(staging, host_address(staging))
    rng = np.random.default_rng(0)
    pool = ThreadPoolExecutor(args.threads)
    local, numbering = threading.local(), itertools.count()

    def buffer(kind):
        """This reading thread's own buffer."""
        if not hasattr(local, "i"):
            local.i = next(numbering)
        return (pinned if kind == "pinned" else pageable)[local.i]

    def read_expert(at, targets):
        pos = 0
        for n, out in zip(PARTS, targets):
            os.preadv(fd, [out], at + pos)
            pos += n

    def direct(at, slot, i):
        read_expert(at, [v[slot] for v in views])

    def via(kind):
        def write(at, slot, i):
            buf = buffer(kind)
            pos = 0
            for n, base in zip(PARTS, addresses):
                os.preadv(fd, [buf[pos : pos + n]], at + pos)
                assert lib.cudaMemcpy(base + int(slot) * n, buf.ctypes.data + pos, n, 4) == 0
                pos += n

        return write

    def via_async(at, slot, i):
        buf = buffer("pinned")
        if not hasattr(local, "stream"):
            local.stream = ctypes.c_void_p()
            assert lib.cudaStreamCreateWithFlags(ctypes.byref(local.stream), 1) == 0
        pos = 0
        for n in PARTS:  # the whole expert read, then its ranges copied on this thread's stream
            os.preadv(fd, [buf[pos : pos + n]], at + pos)
            pos += n
        pos = 0
        for n, base in zip(PARTS, addresses):
            assert lib.cudaMemcpyAsync(base + int(slot) * n, buf.ctypes.data + pos, n, 4,
                                       local.stream) == 0
            pos += n
        assert lib.cudaStreamSynchronize(local.stream) == 0

    def into_staging(at, slot, i):
        read_expert(at, np.split(staging_view[i], np.cumsum(PARTS)[:-1]))

    def trial(name, write, offsets, slots, before=None, after=None):
        mx.eval([a.sum() for a in bank])  # the device reads every slot
        start = time.perf_counter()
        if before is not None:
            before(slots)
        list(pool.map(lambda j: write(offsets[j], slots[j], j), range(len(slots))))
        if after is not None:
            after(slots)
        wrote = time.perf_counter() - start
        t = time.perf_counter()
        idx = mx.array(slots)
        mx.eval([a[idx].sum() for a in bank])
        touch = time.perf_counter() - t
        # the bytes the device sees are the file's
        check = os.pread(fd, PARTS[0], offsets[0])
        ok = np.array(bank[0][int(slots[0])]).tobytes() == check
        return wrote, touch, ok

    def prefetch_host(slots):
        for slot in slots.tolist():
            for n, base in zip(PARTS, addresses):
                prefetch(base + slot * n, n)
        lib.cudaDeviceSynchronize()

    def mlx_update(slots):
        idx = mx.array(slots)
        pos = 0
        for a, n in zip(bank, PARTS):
            a[idx] = staging[: len(slots), pos : pos + n]
            pos += n
        mx.eval(bank)

    ways = {"direct": (direct, None, None)}
    if gpu:
        ways["prefetch+direct"] = (direct, prefetch_host, None)
        ways["pinned+memcpy"] = (via("pinned"), None, None)
        ways["pinned+async"] = (via_async, None, None)
        ways["pageable+memcpy"] = (via("pageable"), None, None)
    ways["mlx update"] = (into_staging, None, mlx_update)
    results = {}
    for count in (1, args.experts):
        for name, (write, before, after) in ways.items():
            runs = []
            for _ in range(args.reps):
                offsets = (rng.integers(0, (size - EXPERT) // 4096, count) * 4096).tolist()
                slots = rng.choice(SLOTS, count, replace=False)
                runs.append(trial(name, write, offsets, slots, before, after))
                if name == "mlx update":  # (an update may move a bank to new memory)
                    addresses[:] = [host_address(a) for a in bank]
                    views[:] = [host_bytes(a, at) for a, at in zip(bank, addresses)]
            wrote = statistics.median(r[0] for r in runs)
            touch = statistics.median(r[1] for r in runs)
            key = f"{count} experts, {name}"
            results[key] = {
                "write_ms": wrote * 1e3,
                "touch_ms": touch * 1e3,
                "gbps_write": count * EXPERT / wrote / 1e9,
                "gbps_with_touch": count * EXPERT / (wrote + touch) / 1e9,
                "exact": all(r[2] for r in runs),
            }
            r = results[key]
            print(f"{key}: write {r['write_ms']:.2f} ms ({r['gbps_write']:.2f} GB/s), touch "
                  f"{r['touch_ms']:.2f} ms, with touch {r['gbps_with_touch']:.2f} GB/s, "
                  f"exact {r['exact']}", flush=True)
    remote = remote_reads(lib, args.reps * 3) if gpu and args.remote else None
    if remote:
        print("gather_qmm ms, 6 of 128 experts:", remote, flush=True)
    out = {"device": str(mx.default_device()), "cudart": libname, "remote_gather_ms": remote,
           "runtime": version if gpu else None, "threads": args.threads, "ways": results}
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
