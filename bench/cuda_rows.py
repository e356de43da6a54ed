"""Which ways of splitting a gather_qmm call into row subsets are bit-identical to the whole call, on
the default device (used to decide what the streaming layer may do on CUDA; CPU: all are).

    python bench/cuda_rows.py

Stock mlx-lm SwitchGLU (4-bit affine, group 64, Qwen3-30B-A3B expert shapes, bfloat16) over
``(tokens, k)`` indices, against the same module called on subsets of the (token, expert) rows, in the
two forms the streaming layer can use: per-row (``x`` gathered per row, one index each) and
per-token (``x`` of one token, a subset of its k indices).
"""

import json
import sys
import time

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.switch_layers import SwitchGLU


def main():
    dtype = mx.bfloat16
    D, H, E, K = 2048, 768, 32, 8
    mx.random.seed(0)
    glu = SwitchGLU(D, H, E)
    nn.quantize(glu, group_size=64, bits=4)
    glu.set_dtype(dtype)
    mx.eval(glu.parameters())
    out = {}
    for T in (1, 4, 64):
        x = mx.random.normal((1, T, D)).astype(dtype)
        rng = np.random.default_rng(T)
        idx_np = np.stack([rng.choice(E, K, replace=False) for _ in range(T)])[None]
        idx = mx.array(idx_np.astype(np.uint32))
        t = time.perf_counter()
        want = glu(x, idx)  # (1, T, K, D)
        mx.eval(want)
        flat_x = x.reshape(-1, D)
        rows = T * K
        res = {}
        for split in (1, 2, 3, 6) if T == 1 else (2, 8):
            # per-row form: rows in `split` groups
            parts = np.array_split(np.arange(rows), split)
            got = []
            for p in parts:
                xs = flat_x[mx.array(p // K)]
                ids = mx.array(idx_np.reshape(-1)[p][:, None].astype(np.uint32))
                got.append(glu(xs, ids)[:, 0])
            y = mx.concatenate(got, axis=0).reshape(1, T, K, D)
            res[f"rows/{split}"] = bool(mx.array_equal(y, want).item())
            # per-token form (decode): a subset of each token's k indices, x kept per token
            if T == 1:
                cols = np.array_split(np.arange(K), split)
                got = [glu(x, mx.array(idx_np[:, :, c].astype(np.uint32))) for c in cols]
                y = mx.concatenate(got, axis=2)
                res[f"token/{split}"] = bool(mx.array_equal(y, want).item())
        # the whole call in per-row form (one index per row)
        ids = mx.array(idx_np.reshape(-1, 1).astype(np.uint32))
        y = glu(flat_x[mx.array(np.arange(rows) // K)], ids)[:, 0].reshape(1, T, K, D)
        res["rows/whole"] = bool(mx.array_equal(y, want).item())
        out[f"T={T}"] = res
        print(T, res, f"{time.perf_counter() - t:.1f}s", flush=True)
    print(json.dumps({"device": str(mx.default_device()), "results": out}))


if __name__ == "__main__":
    sys.exit(main())
