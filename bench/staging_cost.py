"""What a staged (background) read costs the calling thread besides the read: making its staging
buffers (MLX arrays, allocated and evaluated, or numpy) and writing them into a bank's slots (an MLX
slice update and evaluation, ``bank_io._install``, or a copy through the bank's host views,
``bank_io._copy_in``). Prints ms per batch of ``--experts`` experts of the checkpoint's first layer.

    python bench/staging_cost.py CHECKPOINT [--experts 4] [--repeat 20]
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("checkpoint")
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    import mlx.core as mx
    import numpy as np

    import mlx_lm_streaming
    from mlx_lm_streaming import bank_io
    from mlx_lm_streaming.prefetch import StagedBatch

    model = mlx_lm_streaming.load(args.checkpoint, expert_cache_gb=0.05)[0]
    cache = model.expert_streaming.cache
    cache.ensure_planned()
    bank = cache.banks[0]
    n = min(args.experts, bank.slots)
    slots = list(range(n))
    ids = np.arange(n)
    out = {}
    for host in (False, True):
        make, write = [], []
        for _ in range(args.repeat):
            t = time.perf_counter()
            batch = StagedBatch(bank.layer, ids, "lookahead", host=host)
            make.append(time.perf_counter() - t)
            cache.store.read_many(batch.jobs())
            t = time.perf_counter()
            with bank.lock:
                if host and bank.direct:
                    bank_io._copy_in(bank, [(batch, list(range(n)), slots)])
                else:
                    bank_io._install(bank, [(batch, list(range(n)), slots)])
            mx.synchronize()
            write.append(time.perf_counter() - t)
        key = "numpy buffers + copy through host views" if host else "MLX buffers + MLX update"
        out[key] = (statistics.median(make) * 1e3, statistics.median(write) * 1e3)
    print(
        f"{n} experts of {bank.layer.expert_nbytes / 2**20:.2f} MiB, direct={bank.direct}, "
        f"{mx.default_device()}"
    )
    for key, (m, w) in out.items():
        print(f"{key}: make {m:.3f} ms, write into slots {w:.3f} ms (median of {args.repeat})")
    model.expert_streaming.close()


if __name__ == "__main__":
    main()
