"""Where a page-cache read of an expert goes (issue 29, item 2): pread bandwidth by thread count, by
file descriptor sharing, by ranges per expert and by target memory, the page cache warm.

An expert of Qwen3-30B-A3B's shape is 2.65 MB in 9 ranges (3 weights of 786 KB, 6 scales and biases
of 49 KB) in a converted checkpoint. Each figure reads ``--experts`` such experts at random places of
one file of ``--file-gb`` GB that was read once before (so every read is a copy from the page cache):

- ``shared fd, T threads``: one descriptor for the file, T threads each reading whole experts (how
  the store reads: ``SafetensorsStore`` opens each shard once);
- ``own fd, T threads``: each thread its own descriptor of the same file;
- ``9 ranges``: the same with each expert as its 9 ranges, one ``preadv`` each;
- ``mlx slots``: into the host view of an MLX array (``host_views``) that the device touched just
  before (on mlx-cuda managed memory: host writes migrate the pages back), instead of numpy memory.

    python3 bench/read_path_probe.py [--file-gb 2] [--experts 256] [--out FILE.json]
"""

import argparse
import json
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

EXPERT = 2_654_208
RANGES = [786_432, 49_152, 49_152] * 3


def make_file(path: Path, size: int) -> None:
    if path.exists() and path.stat().st_size == size:
        return
    block = np.random.default_rng(0).integers(0, 255, 1 << 24, dtype=np.uint8).tobytes()
    with open(path, "wb") as f:
        left = size
        while left > 0:
            f.write(block[: min(left, len(block))])
            left -= len(block)


def warm(path: Path) -> None:
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(16 << 20)
        while f.readinto(buf):
            pass


def run(path, experts, threads, own_fd, ranges, targets):
    """GB/s reading ``experts`` experts into ``targets(i)`` (a writable uint8 view of EXPERT
    bytes) on ``threads`` threads."""
    size = path.stat().st_size
    rng = np.random.default_rng(threads * 7 + own_fd)
    offsets = (rng.integers(0, (size - EXPERT) // 4096, experts) * 4096).tolist()
    shared = os.open(path, os.O_RDONLY)
    local = threading.local()
    fds = []
    lock = threading.Lock()

    def fd():
        if not own_fd:
            return shared
        if not hasattr(local, "fd"):
            local.fd = os.open(path, os.O_RDONLY)
            with lock:
                fds.append(local.fd)
        return local.fd

    def read(i):
        out = targets(i)
        at, pos = offsets[i], 0
        parts = RANGES if ranges else [EXPERT]
        f = fd()
        for n in parts:
            os.preadv(f, [out[pos : pos + n]], at + pos)
            pos += n

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda _: fd(), range(threads)))  # (descriptors opened before the clock)
        start = time.perf_counter()
        list(pool.map(read, range(experts)))
        seconds = time.perf_counter() - start
    os.close(shared)
    for f in fds:
        os.close(f)
    return experts * EXPERT / seconds / 1e9


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default="/tmp")
    ap.add_argument("--file-gb", type=float, default=2.0)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--threads", default="1,2,4,8,16")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    path = Path(args.dir) / "read_path_probe.bin"
    make_file(path, int(args.file_gb * 1e9))
    warm(path)
    host = np.ones((args.experts, EXPERT), np.uint8)  # (its pages faulted in before the clock)
    mlx_views = None
    try:
        import mlx.core as mx

        from mlx_lm_streaming.runtime.host_views import host_address, host_bytes

        slots = mx.zeros((64, EXPERT), dtype=mx.uint8)
        mx.eval(slots)
        view = host_bytes(slots, host_address(slots)) if host_address(slots) else None
        view = None if view is None else view.reshape(-1)
        if view is not None:
            mlx_views = (slots, view.reshape(64, EXPERT))
        device = str(mx.default_device())
    except Exception as e:  # no mlx, or no host view: numpy only
        device = f"no mlx slots ({type(e).__name__}: {e})"
    figures = {}
    threads = [int(t) for t in args.threads.split(",")]
    for t in threads:
        for own in (False, True):
            for ranges in (False, True):
                name = f"{'own' if own else 'shared'} fd, {t} threads{', 9 ranges' if ranges else ''}"
                figures[name] = run(path, args.experts, t, own, ranges, lambda i: host[i])
        if mlx_views is not None:
            import mlx.core as mx

            slots, view = mlx_views

            def touched(i, view=view):
                return view[i % 64]

            for own in (False, True):
                # the device writes every slot first: its pages were last touched by the GPU
                slots[:] = (slots + 1).astype(mx.uint8)
                mx.eval(slots)
                view = host_bytes(slots, host_address(slots)).reshape(64, EXPERT)  # (new memory)
                name = f"{'own' if own else 'shared'} fd, {t} threads, 9 ranges, mlx slots"
                figures[name] = run(path, args.experts, t, own, True, lambda i, v=view: v[i % 64])
        print(f"[probe] {t} threads done", file=sys.stderr, flush=True)
    for k, v in figures.items():
        print(f"{k}: {v:.2f} GB/s")
    if args.out:
        Path(args.out).write_text(json.dumps({"device": device, "expert_bytes": EXPERT,
                                              "experts": args.experts, "gbps": figures}, indent=1))


if __name__ == "__main__":
    main()
