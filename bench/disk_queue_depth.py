"""The reads' queue depth this disk needs: GB/s of cold expert-sized random reads, 1..32 in flight.

    python3 bench/disk_queue_depth.py [--file F ...] [--out docs/benchmarks] [--tag disk-queue-depth]

Each figure reads ``--mb`` MB of experts at random 4 KiB-aligned offsets of the files (a scratch
file of ``--scratch-gb`` GB written first where none is given), the page cache dropped before it
with ``os.posix_fadvise(POSIX_FADV_DONTNEED)`` (no root needed), ``N`` reads in flight on ``N``
threads. An expert is read three ways (``--expert-bytes``, default the Qwen3-30B-A3B expert at 4
bits, 2.654 MB):

- ``whole``: one read per expert (the packed store, an HF checkpoint's expert with its ranges
  merged): ``N`` experts in flight;
- ``split``: the stacked layout's nine ranges of an expert (three weights, six scales and biases),
  each at its own offset, read one after the other by the thread that reads the expert (the
  safetensors store's ``read_on_this_thread``): ``N`` experts in flight;
- ``ranges``: the same ranges, each its own job: ``N`` ranges in flight;
- ``advised``: every range of every expert handed to the kernel first with
  ``posix_fadvise(POSIX_FADV_WILLNEED)`` (it queues their reads at once, the device's own queue
  depth), then read as ``split``.

Buffered (the stores' default) and O_DIRECT. Writes ``TAG.json`` and ``TAG.md`` to ``--out``.
"""

import argparse
import json
import mmap
import os
import random
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GB = 1e9
ALIGN = 4096
# the Qwen3-30B-A3B expert at 4 bits, group 64: three (768 x 2048) weights and their bf16 scales
# and biases (the synthetic checkpoints' ``qwen3`` shape)
QWEN3_RANGES = [786432] * 3 + [49152] * 6


def drop_page_cache(files) -> None:
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def scratch_file(path: Path, nbytes: int) -> Path:
    """A file of ``nbytes`` random-looking bytes (written once, kept for the next run)."""
    if path.exists() and path.stat().st_size >= nbytes:
        return path
    block = os.urandom(8 << 20)
    with open(path, "wb") as f:
        for _ in range(-(-nbytes // len(block))):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    return path


def plan(files, ranges, total_bytes, seed):
    """Experts to read: each a list of ``(file index, offset, nbytes)`` at random aligned
    offsets."""
    sizes = [os.path.getsize(f) for f in files]
    rng = random.Random(seed)
    expert = sum(ranges)
    experts = []
    for _ in range(max(4, int(total_bytes // expert))):
        parts = []
        for n in ranges:
            i = rng.randrange(len(files))
            span = -(-n // ALIGN) * ALIGN
            off = rng.randrange(0, max(1, sizes[i] - span)) // ALIGN * ALIGN
            parts.append((i, off, n))
        experts.append(parts)
    return experts


def measure(files, experts, threads: int, how: str, direct: bool) -> float:
    """GB/s of reading ``experts`` with ``threads`` in flight, ``how`` as the module says."""
    drop_page_cache(files)
    flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)
    fds = [os.open(f, flags) for f in files]
    biggest = max(n for parts in experts for _, _, n in parts)
    size = -(-max(biggest, sum(n for _, _, n in experts[0])) // ALIGN) * ALIGN
    local = threading.local()

    def buf():
        b = getattr(local, "buf", None)
        if b is None:
            b = local.buf = mmap.mmap(-1, size)  # page-aligned: fit for O_DIRECT
        return b

    def read_range(job):
        i, off, n = job
        span = -(-n // ALIGN) * ALIGN if direct else n
        return os.preadv(fds[i], [memoryview(buf())[:span]], off)

    def read_expert(parts):
        if how == "whole":
            i, off, _ = parts[0]
            return read_range((i, off, sum(n for _, _, n in parts)))
        return sum(read_range(p) for p in parts)

    jobs = [p for parts in experts for p in parts] if how == "ranges" else experts
    work = read_range if how == "ranges" else read_expert
    start = time.perf_counter()
    try:
        if how == "advised":
            for i, off, n in (p for parts in experts for p in parts):
                os.posix_fadvise(fds[i], off, n, os.POSIX_FADV_WILLNEED)
        with ThreadPoolExecutor(threads) as pool:
            got = sum(pool.map(work, jobs))
    finally:
        for fd in fds:
            os.close(fd)
    return got / (time.perf_counter() - start) / GB


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--file", action="append", default=[], help="files to read (default: scratch)")
    p.add_argument("--scratch", default="/tmp/disk-queue-depth.bin")
    p.add_argument("--scratch-gb", type=float, default=4.0)
    p.add_argument("--mb", type=int, default=400, help="MB read per figure")
    p.add_argument("--threads", default="1,2,4,8,16,32")
    p.add_argument("--ways", default="whole,split,ranges,advised")
    p.add_argument("--rounds", type=int, default=2, help="figures per cell (the median is kept)")
    p.add_argument("--out", default=str(ROOT / "docs" / "benchmarks"))
    p.add_argument("--tag", default="disk-queue-depth")
    args = p.parse_args(argv)
    files = args.file or [str(scratch_file(Path(args.scratch), int(args.scratch_gb * GB)))]
    threads = [int(t) for t in args.threads.split(",")]
    ways = args.ways.split(",")
    res = {"command": "disk_queue_depth.py " + " ".join(argv or sys.argv[1:]),
           "date": time.strftime("%Y-%m-%d %H:%M"), "files": files,
           "file_bytes": sum(os.path.getsize(f) for f in files), "expert_ranges": QWEN3_RANGES,
           "mb_per_figure": args.mb, "rounds": args.rounds, "gbps": {}}
    for r in range(args.rounds):
        for direct in (False, True):
            for how in ways:
                if direct and how == "advised":
                    continue  # (advice fills the page cache, which O_DIRECT reads pass by)
                for n in threads:
                    experts = plan(files, QWEN3_RANGES, args.mb * 1e6, seed=1000 * r + n)
                    key = f"{how}{'_direct' if direct else ''}"
                    try:
                        bw = measure(files, experts, n, how, direct)
                    except OSError as e:  # O_DIRECT where the file system refuses it
                        print(f"{key} t{n}: {e}", file=sys.stderr)
                        bw = None
                    res["gbps"].setdefault(key, {}).setdefault(str(n), []).append(bw)
                    print(f"round {r} {key} t{n}: {bw if bw is None else round(bw, 3)} GB/s",
                          file=sys.stderr, flush=True)
    out = Path(args.out)
    (out / f"{args.tag}.json").write_text(json.dumps(res, indent=1) + "\n")
    (out / f"{args.tag}.md").write_text(markdown(res, threads))
    print(markdown(res, threads))


def median(values):
    values = sorted(v for v in values if v is not None)
    return values[len(values) // 2] if values else None


def markdown(res, threads) -> str:
    lines = [
        "# Reads in flight against GB/s, cold (this disk)", "",
        f"`{res['command']}` ({res['date']}): {res['mb_per_figure']} MB of random expert-sized "
        f"reads per figure over {res['file_bytes'] / GB:.1f} GB, page cache dropped before each "
        f"(`posix_fadvise DONTNEED`); median of {res['rounds']} rounds. An expert: "
        f"{sum(res['expert_ranges']) / 1e6:.3f} MB; `whole` one read, `split` its nine ranges one "
        "after the other on one thread, `ranges` each range its own job, `advised` every range "
        "handed to the kernel first (`POSIX_FADV_WILLNEED`), then as `split` "
        "(bench/disk_queue_depth.py says more). GB/s decimal.", "",
        "| way | " + " | ".join(f"{n} in flight" for n in threads) + " |",
        "|---" * (len(threads) + 1) + "|",
    ]
    for key, cells in res["gbps"].items():
        row = [median(cells.get(str(n), [])) for n in threads]
        lines.append(f"| {key} | " + " | ".join("-" if v is None else f"{v:.2f}" for v in row)
                     + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
