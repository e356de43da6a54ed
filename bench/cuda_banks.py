"""Where streaming logits differ from stock's on a device: the banks' bytes against the store's.

    python bench/cuda_banks.py [--arch qwen3_moe --variant affine4 --dtype bfloat16]
    python bench/cuda_banks.py --quick     # 1 step, 1 stock repeat, three configurations

For each configuration (budget holding every expert or 3 per layer; direct reads on or off; with or
without a device synchronisation before each direct read), runs the parity prompt and 2 decode steps,
prints whether each step's logits equal stock's, then compares every resident slot's bytes, as MLX
sees them and through the host view, with the expert's bytes read from the store into host memory.
One process: the device compiles its kernels once.
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="qwen3_moe")
    ap.add_argument("--variant", default="affine4")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--stock-repeats", type=int, default=3, help="stock runs compared to the first")
    ap.add_argument("--overrides", default=None, help="JSON of build_checkpoint overrides")
    ap.add_argument(
        "--configs", default="all-on,all-off,all-on-sync,small-on,small-off,all-on-nofill"
    )
    ap.add_argument("--quick", action="store_true", help="1 step, 1 stock repeat, 3 configurations")
    args = ap.parse_args()
    if args.quick:
        args.steps, args.stock_repeats = 1, 1
        args.configs = "all-on-sync,small-on-sync,small-off"
    import mlx.core as mx
    import numpy as np

    from mlx_lm_streaming.bank import reads as bank_reads
    from mlx_lm_streaming.expert_cache import CacheTuning
    from mlx_lm_streaming.option_table import GB as BUDGET_GB
    from mlx_lm_streaming.synthetic import build_checkpoint
    from mlx_lm_streaming.parity import budget_of_slots, load_stock, load_streaming, prompts, run

    print("device", mx.default_device(), flush=True)
    direct_reads = bank_reads.DirectReads

    class SyncedReads(direct_reads):
        """Direct reads issued after every pending MLX computation has ended."""

        def __init__(self, *args, **kwargs):
            # whatever DirectReads takes: a fixed signature here once broke every *-sync run
            mx.synchronize()
            super().__init__(*args, **kwargs)

    def equal(a, b):
        # finite and bit-identical: NaN on both sides is not a match
        finite = mx.isfinite(a).all().item() and mx.isfinite(b).all().item()
        return bool(finite and mx.array_equal(a, b).item())

    differ = []

    with tempfile.TemporaryDirectory() as tmp:
        path = build_checkpoint(
            Path(tmp) / "ckpt",
            args.arch,
            args.variant,
            dtype=args.dtype,
            overrides=json.loads(args.overrides) if args.overrides else None,
        )
        stock, config = load_stock(path)
        vocab = config.get("vocab_size") or config["text_config"]["vocab_size"]
        tokens = prompts(1, vocab)
        t = time.time()
        expected = run(stock, tokens, args.steps)
        print(f"stock: {time.time() - t:.1f} s, NaNs {[int(mx.isnan(a).sum()) for a in expected]}")
        for again in range(args.stock_repeats):
            got = run(stock, tokens, args.steps)
            same = [equal(a, b) for a, b in zip(expected, got)]
            print(
                f"stock again ({again + 1}): equal to the first run {same}, "
                f"NaNs {[int(mx.isnan(a).sum()) for a in got]}",
                flush=True,
            )
        for name in args.configs.split(","):
            budget, direct, *extra = name.split("-")
            bank_reads.DirectReads = SyncedReads if "sync" in extra else direct_reads
            probe, _ = load_streaming(path, expert_cache_gb=1e6)
            gb = (
                (probe.expert_streaming.cache.total_expert_bytes + 0.5) / BUDGET_GB
                if budget == "all"
                else budget_of_slots(probe, 3)
            )
            del probe
            tuning = CacheTuning(fill="nofill" not in extra)
            model, _ = load_streaming(
                path, expert_cache_gb=gb, direct_reads=direct == "on", tuning=tuning
            )
            cache = model.expert_streaming.cache
            t = time.time()
            got = run(model, tokens, args.steps)  # an error is fatal: no configuration is skipped
            steps = [
                "=" if equal(a, b) else f"x(nan {int(mx.isnan(b).sum())})"
                for a, b in zip(expected, got)
            ]
            if steps.count("=") != len(steps):
                differ.append(name)
            time.sleep(0.5)  # background fill settles
            bad_mlx, bad_view, checked = [], [], 0
            for li, bank in enumerate(cache.banks):
                with bank.lock:
                    for slot, e in enumerate(bank.expert_of.tolist()):
                        if e < 0:
                            continue
                        for i, (spec, ref) in enumerate(zip(bank.layer.parts, bank.layer.refs(e))):
                            arr = bank.array(spec.proj, spec.part)[slot]
                            seen = np.array(arr.reshape(-1).view(mx.uint8))
                            want = np.empty(seen.size, dtype=np.uint8)
                            cache.store.read_many([(ref, memoryview(want))])
                            checked += 1
                            if not np.array_equal(seen, want):
                                bad_mlx.append(
                                    (li, e, slot, spec.proj, spec.part, int((seen != want).sum()))
                                )
                            if bank.views is not None and not np.array_equal(
                                bank.views[i][slot], want
                            ):
                                bad_view.append((li, e, slot, spec.proj, spec.part))
            print(
                f"{name}: {time.time() - t:.1f} s, direct={[b.direct for b in cache.banks][:1]}, "
                f"steps {' '.join(steps)}; parts checked {checked}, wrong as MLX sees them "
                f"{len(bad_mlx)} {bad_mlx[:4]}, wrong in host view {len(bad_view)} {bad_view[:4]}",
                flush=True,
            )
            del model, cache
    bank_reads.DirectReads = direct_reads
    if differ:
        sys.exit(f"logits differ from stock's in: {', '.join(differ)}")


if __name__ == "__main__":
    main()
