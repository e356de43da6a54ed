"""Parity on the device the benchmark runs on (CUDA on the H200): streaming logits equal stock's.

    python bench/cuda_parity.py [--out FILE.json]

``mlx_lm_streaming/tools/parity.py``, as tests/test_parity.py runs it (prompt + 8 decode steps with a KV
cache, batch 1 and 2, a budget of 3 experts per layer (evictions, waves, lookahead) and one holding every expert (background
fill, then the no-sync path)) on a small table of architectures, variants and activation dtypes, on the
default device. Prints one line per case and writes a JSON summary.
"""

import argparse
import functools
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]

CASES = [
    ("qwen3_moe", "affine4", "bfloat16"),
    ("qwen3_moe", "affine4", "float16"),
    ("qwen3_moe", "affine4", "float32"),
    ("mixtral", "mxfp4", "bfloat16"),
    ("deepseek_v2", "affine8", "bfloat16"),
    ("deepseek_v3", "nvfp4", "bfloat16"),
    ("qwen3_moe", "nvfp4_global", "bfloat16"),
    ("qwen3_moe", "float32_hf", "float32"),
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--cases", type=int, default=None, help="only the first N cases")
    ap.add_argument(
        "--direct",
        default="auto",
        help="direct reads into the banks: auto (the option's default for the backend), on, off, or "
        "several, comma-separated ('on,off': each case under each, kernels compiled once)",
    )
    ap.add_argument(
        "--overrides",
        default=None,
        help='JSON of build_checkpoint overrides, e.g. \'{"hidden": 256, "moe_intermediate": 128}\' '
        "(at the default tiny dims stock's own decode logits were all NaN on the H200, finite on the CPU)",
    )
    ap.add_argument(
        "--prompt-by-token",
        action="store_true",
        help="feed the prompt one token at a time (stock and streaming alike): every call then has "
        "one token, where stock mlx-cuda 0.32.4 is deterministic (it is not for longer prompts)",
    )
    args = ap.parse_args()
    overrides = json.loads(args.overrides) if args.overrides else None
    modes = args.direct.split(",")
    if not set(modes) <= {"auto", "on", "off"}:
        ap.error(f"--direct: {args.direct!r}: each of auto, on, off")
    import mlx.core as mx

    from mlx_lm_streaming.runtime.devices import backend
    from mlx_lm_streaming.runtime.options import StreamingOptions
    from synthetic import build_checkpoint
    from mlx_lm_streaming.tools.parity import (
        DECODE_STEPS,
        GB,
        budget_of_slots,
        compare,
        load_stock,
        load_streaming,
        prompts,
        run,
    )

    if args.prompt_by_token:
        run = functools.partial(run, by_token=True)

    def check_parity(path):
        """Every expert resident, and 3 per layer (evictions within a call); batch 1 and 2."""
        probe, _ = load_streaming(path)
        cache = probe.expert_streaming.cache
        budgets = {"all": (cache.total_expert_bytes + 0.5) / GB, "small": budget_of_slots(probe, 3)}
        probe.expert_streaming.close()
        del probe, cache
        rows = compare(path, budgets, by_token=args.prompt_by_token)
        bad = [r for r in rows if r["difference"] is not None]
        if bad:
            raise AssertionError(f"streaming differs from stock: {bad}")

    def stock_nans(path):
        """NaNs in stock's logits on the default device and on the CPU (the reference)."""
        model, config = load_stock(path)
        vocab = config.get("vocab_size") or config["text_config"]["vocab_size"]
        counts = []
        for device in (mx.default_device(), mx.cpu):
            with mx.stream(device):
                out = run(model, prompts(1, vocab), DECODE_STEPS)
            counts.append(sum(int(mx.isnan(a).sum()) for a in out))
        return counts

    default_direct = StreamingOptions.use_direct_reads

    def direct_reads_as(mode):
        if mode == "auto":
            return default_direct
        return lambda self, backend: mode == "on"

    def write(report):
        if args.out:  # after each case too: a run cut short still reports what it did
            Path(args.out).write_text(json.dumps(report, indent=1))

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for arch, variant, dtype in CASES[: args.cases]:
            start = time.time()
            nans = None
            try:
                path = build_checkpoint(
                    Path(tmp) / f"{arch}-{variant}-{dtype}",
                    arch,
                    variant,
                    dtype=dtype,
                    overrides=overrides,
                )
                nans = stock_nans(path)
                print(f"stock NaNs (batch 1): {nans[0]} here, {nans[1]} on the CPU", flush=True)
            except Exception as e:
                path = None
                traceback.print_exc()
                built_err = f"{type(e).__name__}: {e}"
            for mode in modes:
                if path is None:
                    ok, err = False, built_err
                else:
                    StreamingOptions.use_direct_reads = direct_reads_as(mode)
                    try:
                        check_parity(path)
                        ok, err = True, None
                    except Exception as e:
                        ok, err = False, f"{type(e).__name__}: {e}"
                        traceback.print_exc()
                    finally:
                        StreamingOptions.use_direct_reads = default_direct
                results.append(
                    {
                        "arch": arch,
                        "variant": variant,
                        "dtype": dtype,
                        "direct": mode,
                        "exact": ok,
                        "stock_nans_here_and_on_cpu": nans,
                        "error": err,
                        "seconds": round(time.time() - start, 1),
                    }
                )
                write({"backend": backend(), "cases": results})
                print(
                    f"{arch} {variant} {dtype} direct={mode}: "
                    f"{'exact' if ok else 'FAILED ' + err}",
                    flush=True,
                )
    report = {
        "backend": backend(),
        "device": str(mx.default_device()),
        "direct": modes,
        "cases": results,
    }
    write(report)
    print(
        json.dumps(
            {
                "backend": report["backend"],
                "exact": sum(r["exact"] for r in results),
                "of": len(results),
            }
        )
    )


if __name__ == "__main__":
    main()
