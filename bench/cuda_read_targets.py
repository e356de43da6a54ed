"""Does the read target slow the disk? Random expert-sized reads into plain host memory against reads
into MLX arrays' memory (unified memory on CUDA), the GPU having used that memory or not.

    python bench/cuda_read_targets.py CHECKPOINT_DIR [--mb 768] [--threads 1,2,4,8]

Per thread count and target, the page cache is dropped, then ``--mb`` of random 2.53 MB reads
(4 KiB-aligned offsets in the checkpoint's shards, the same offsets for every target) are read with
``preadv``, one buffer per thread, and GB/s printed. Targets: ``host`` (an mmap'd buffer, as
``bench/experts.disk_bandwidth`` reads into), ``mlx`` (the host view of an evaluated MLX array, the way
direct reads write a slot bank), ``mlx_gpu`` (the same, after a GPU kernel read the array, as a bank
that the layer computed from), and ``host_then_copy`` (into host memory, then a numpy copy into the
MLX array, the copy timed in), and, for the checkpoint's real layout, ``expert_ranges`` (random
experts, each read as the store reads it: its tensors' ranges, one after another on the thread) and
``expert_store`` (through ``SafetensorsStore.read_many``, which reads an expert's ranges in parallel on
its reader pool), both into host memory, and ``expert_direct`` (the same ranges in parallel on 8
threads, but with O_DIRECT: each range's 4 KiB-aligned superset into a page-aligned buffer, then the
range copied out: what an O_DIRECT default store would do). Prints one JSON line per measurement.
"""

import argparse
import json
import mmap
import os
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlx.core as mx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from experts import drop_page_cache, shards  # noqa: E402

from mlx_lm_streaming.prefetch import host_bytes  # noqa: E402

READ = 2_531_328  # one Qwen3-30B-A3B expert (4-bit, group 64), rounded up to 4 KiB


def jobs_for(files, total):
    sizes = [os.path.getsize(f) for f in files]
    rng = random.Random(0)
    out = []
    for _ in range(max(4, total // READ)):
        i = rng.randrange(len(files))
        out.append((i, rng.randrange(0, sizes[i] - READ) // 4096 * 4096))
    return out


def mlx_buffer(touch_on_gpu: bool):
    arr = mx.zeros((1, READ), dtype=mx.uint8)
    mx.eval(arr)
    if touch_on_gpu:
        mx.eval(arr.sum())  # a kernel reads it (on the GPU where there is one)
    view = host_bytes(arr)
    return arr, view[0] if view is not None else None


def run(files, jobs, threads, target):
    fds = [os.open(f, os.O_RDONLY) for f in files]
    keep = []
    bufs, copies = [], []
    for _ in range(threads):
        if target == "host":
            bufs.append(mmap.mmap(-1, READ))
        else:
            arr, view = mlx_buffer(touch_on_gpu=target == "mlx_gpu")
            keep.append(arr)
            if target == "host_then_copy":
                bufs.append(np.empty(READ, dtype=np.uint8))
                copies.append(view)
            else:
                bufs.append(view)

    def read(t, job):
        i, off = job
        n = os.preadv(fds[i], [bufs[t]], off)
        if copies:
            copies[t][:] = bufs[t]
        return n

    try:
        return timed(files, jobs, threads, read)
    finally:
        for fd in fds:
            os.close(fd)


def timed(files, jobs, threads, read):
    """GB/s of ``read(thread slot, job)`` over ``jobs`` on ``threads`` threads, page cache dropped."""
    drop_page_cache(files)
    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        got = sum(pool.map(lambda a: read(a[0] % threads, a[1]), enumerate(jobs)))
    return got / (time.perf_counter() - start) / 1e9


def expert_jobs(path, total):
    """Random (layer, expert) reads of the checkpoint's real layout: a list of ref lists."""
    from experts import load_streaming

    model, _ = load_streaming(path, expert_cache_gb=1e6)
    cache = model.expert_streaming.cache
    banks = cache.banks
    rng = random.Random(0)
    per = banks[0].layer.expert_nbytes
    out = []
    for _ in range(max(4, total // per)):
        b = banks[rng.randrange(len(banks))]
        out.append(b.layer.refs(rng.randrange(b.num_experts)))
    return out, cache.store, model  # the model keeps the store open


def run_direct(files, refs_list, threads):
    """``expert_direct``: O_DIRECT reads of each expert's ranges (aligned supersets), 8 per expert
    at once, ``threads`` experts at once."""
    fds = {f: os.open(f, os.O_RDONLY | os.O_DIRECT) for f in files}
    most = max(r.nbytes for refs in refs_list for r in refs) + 2 * 4096
    pool = ThreadPoolExecutor(8 * threads)
    outs = [[np.empty(r.nbytes, dtype=np.uint8) for r in refs_list[0]] for _ in range(threads)]
    bounce = [[mmap.mmap(-1, most) for _ in refs_list[0]] for _ in range(threads)]

    def one(t, i, ref):
        start = ref.offset // 4096 * 4096
        end = -(-(ref.offset + ref.nbytes) // 4096) * 4096
        buf = memoryview(bounce[t][i])[: end - start]
        got = os.preadv(fds[ref.file], [buf], start)
        assert got >= ref.offset + ref.nbytes - start
        head = ref.offset - start
        outs[t][i][:] = np.frombuffer(buf[head : head + ref.nbytes], dtype=np.uint8)
        return ref.nbytes

    def read(t, refs):
        return sum(pool.map(lambda a: one(t, a[0], a[1]), enumerate(refs)))

    try:
        return timed(files, refs_list, threads, read)
    finally:
        pool.shutdown()
        for fd in fds.values():
            os.close(fd)


def run_experts(files, refs_list, threads, store, through_store):
    bufs = [[np.empty(r.nbytes, dtype=np.uint8) for r in refs_list[0]] for _ in range(threads)]

    def read(t, refs):
        jobs = [(r, memoryview(b)) for r, b in zip(refs, bufs[t])]
        if through_store:
            store.read_many(jobs)
        else:
            for r, b in jobs:
                store._read(r, b)
        return sum(r.nbytes for r in refs)

    return timed(files, refs_list, threads, read)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("ckpt")
    ap.add_argument("--mb", type=int, default=768)
    ap.add_argument("--threads", default="1,2,4,8")
    ap.add_argument(
        "--targets",
        default="host,mlx,mlx_gpu,host_then_copy,expert_ranges,expert_store,expert_direct",
    )
    args = ap.parse_args()
    files = shards(Path(args.ckpt))
    jobs = jobs_for(files, args.mb * 1_000_000)
    targets = args.targets.split(",")
    if any(t.startswith("expert_") for t in targets):
        refs_list, store, _model = expert_jobs(Path(args.ckpt), args.mb * 1_000_000)
    for threads in [int(t) for t in args.threads.split(",")]:
        for target in targets:
            if target == "expert_direct":
                gbps = run_direct(files, refs_list, threads)
            elif target.startswith("expert_"):
                through = target == "expert_store"
                gbps = run_experts(files, refs_list, threads, store, through)
            else:
                gbps = run(files, jobs, threads, target)
            print(json.dumps({"threads": threads, "target": target, "gbps": round(gbps, 3)}))
            sys.stdout.flush()


if __name__ == "__main__":
    main()
