"""Parity on the device the benchmark runs on (CUDA on the H200): streaming logits equal stock's.

    python bench/cuda_parity.py [--out FILE.json] [--cases N] [--direct auto|on|off,...]
        [--overrides JSON] [--prompt-by-token]

Runs ``mlx_lm_streaming.tools.parity`` as tests/test_parity.py does on a small table of
architectures, variants and activation dtypes (``CASES``) on the default device; prints one line
per case and writes a JSON summary (after each case too). What is compared:
docs/benchmarks/methods.md (cuda_parity.py). Run by bench/gpu.sh.
"""

import argparse
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]

import mlx.core as mx  # noqa: E402

from mlx_lm_streaming.runtime.devices import backend  # noqa: E402
from mlx_lm_streaming.runtime.options import StreamingOptions  # noqa: E402
from mlx_lm_streaming.tools import parity  # noqa: E402
from synthetic import build_checkpoint  # noqa: E402

CASES = [
    ("qwen3_moe", "affine4", "bfloat16"), ("qwen3_moe", "affine4", "float16"),
    ("qwen3_moe", "affine4", "float32"), ("mixtral", "mxfp4", "bfloat16"),
    ("deepseek_v2", "affine8", "bfloat16"), ("deepseek_v3", "nvfp4", "bfloat16"),
    ("qwen3_moe", "nvfp4_global", "bfloat16"), ("qwen3_moe", "float32_hf", "float32"),
]  # fmt: skip


def stock_run_to_run(path, by_token):
    """Per batch, what differs between two runs of one stock model (None: nothing). Stock
    mlx-cuda is not deterministic for calls of several rows on some shapes: there a streaming
    run cannot be judged bit for bit, and the batch is reported, not failed."""
    stock, config = parity.load_stock(path)
    vocab = parity.vocab_size(config)
    runs = {b: [parity.run(stock, parity.prompts(b, vocab), by_token=by_token) for _ in "ab"]
            for b in (1, 2)}  # fmt: skip
    return {b: parity.difference(*pair) for b, pair in runs.items()}


def check_parity(path, direct, by_token, noisy):
    """None where streaming equals stock with every expert resident and with 3 per layer
    (evictions within a call), batch 1 and 2 (a batch in ``noisy``, where stock differs from
    itself, is not judged), under direct reads ``direct``; else the error."""
    default = StreamingOptions.use_direct_reads
    if direct != "auto":
        StreamingOptions.use_direct_reads = lambda self, backend: direct == "on"
    try:
        probe, _ = parity.load_streaming(path)
        total = probe.expert_streaming.cache.total_expert_bytes
        budgets = {"all": (total + 0.5) / parity.GB, "small": parity.budget_of_slots(probe, 3)}
        probe.expert_streaming.close()
        del probe
        rows = parity.compare(path, budgets, by_token=by_token)
        bad = [r for r in rows if r["difference"] is not None and not noisy[r["batch"]]]
        if bad:
            raise AssertionError(f"streaming differs from stock: {bad}")
        return None
    except Exception as e:
        traceback.print_exc()
        return f"{type(e).__name__}: {e}"
    finally:
        StreamingOptions.use_direct_reads = default


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--cases", type=int, default=None, help="only the first N cases")
    ap.add_argument("--direct", default="auto", help="direct reads: auto, on, off, or 'on,off'")
    ap.add_argument("--overrides", default=None, help="JSON of build_checkpoint overrides")
    ap.add_argument("--prompt-by-token", action="store_true", help="feed the prompt token by token")
    args = ap.parse_args()
    overrides = json.loads(args.overrides) if args.overrides else None
    modes = args.direct.split(",")
    if not set(modes) <= {"auto", "on", "off"}:
        ap.error(f"--direct: {args.direct!r}: each of auto, on, off")
    report = {"backend": backend(), "device": str(mx.default_device()), "direct": modes}
    results = report["cases"] = []
    with tempfile.TemporaryDirectory() as tmp:
        for arch, variant, dtype in CASES[: args.cases]:
            start = time.time()
            build_error = None
            try:
                where = Path(tmp) / f"{arch}-{variant}-{dtype}"
                path = build_checkpoint(where, arch, variant, dtype=dtype, overrides=overrides)
            except Exception as e:
                traceback.print_exc()
                build_error = f"{type(e).__name__}: {e}"
            noisy = {} if build_error else stock_run_to_run(path, args.prompt_by_token)
            for mode in modes:
                error = build_error or check_parity(path, mode, args.prompt_by_token, noisy)
                case = {"arch": arch, "variant": variant, "dtype": dtype, "direct": mode}
                seconds = round(time.time() - start, 1)
                results.append({**case, "exact": error is None, "error": error, "seconds": seconds,
                                "stock_run_to_run": noisy})  # fmt: skip
                if args.out:  # after each case: a run cut short still reports what it did
                    Path(args.out).write_text(json.dumps(report, indent=1))
                verdict = "exact" if error is None else "FAILED " + error
                for b, what in noisy.items():
                    if what:
                        verdict += f" (batch {b} not judged: stock against itself: {what})"
                print(f"{arch} {variant} {dtype} direct={mode}: {verdict}", flush=True)
    exact = sum(r["exact"] for r in results)
    print(json.dumps({"backend": report["backend"], "exact": exact, "of": len(results)}))


if __name__ == "__main__":
    main()
