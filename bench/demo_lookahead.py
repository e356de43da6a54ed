"""The router lookahead of a trained model: how its guesses serve the lookahead options.

    python bench/demo_lookahead.py [--steps 200] [--slots 4]

``docs/demo-model`` (trained, 4 MoE layers of 8 experts, top 2) is too small to time, but its routers
are real: layer L+N's router applied to layer L's input is the predictor that
``CacheTuning.lookahead_early`` / ``lookahead_depth`` / ``lookahead_into_slots`` use, which a replayed
trace cannot exercise. Greedy decoding from "The", ``--slots`` of each layer's experts in memory,
cold start; for each configuration: the lookahead's precision (non-resident guesses the layer then
needed), the reads ahead staged and used, the experts read per token (misses plus wrong guesses),
the demand hit rate, and whether every step's logits equal stock's.
"""

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

DEMO = ROOT / "docs" / "demo-model"
CONFIGS = {
    "default (late, depth 1, staged)": {},
    "early": {"lookahead_early": True},
    "early, depth 2": {"lookahead_early": True, "lookahead_depth": 2},
    "early, into slots": {"lookahead_early": True, "lookahead_into_slots": True},
    "early, depth 2, into slots": {
        "lookahead_early": True,
        "lookahead_depth": 2,
        "lookahead_into_slots": True,
    },
    "no lookahead": {"lookahead": False},
}


def greedy(model, tokenizer, steps):
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    logits = model(mx.array([tokenizer.encode("The")]), cache=cache)[:, -1]
    out = [logits]
    for _ in range(steps):
        token = mx.argmax(logits, axis=-1)
        logits = model(token[None], cache=cache)[:, -1]
        out.append(logits)
        mx.eval(logits)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--slots", type=int, default=4)
    args = ap.parse_args()
    import mlx.core as mx
    import mlx_lm.utils
    from experts import load_stock, load_streaming

    from mlx_lm_streaming.expert_cache import CacheTuning

    tokenizer = mlx_lm.utils.load_tokenizer(DEMO)
    stock, _ = load_stock(DEMO)
    want = greedy(stock, tokenizer, args.steps)
    probe, _ = load_streaming(DEMO, expert_cache_gb=1e6)
    cache = probe.expert_streaming.cache
    per_slot = sum(b.layer.expert_nbytes for b in cache.banks)
    expert_bytes = cache.banks[0].layer.expert_nbytes
    probe.expert_streaming.close()
    print(
        f"docs/demo-model, {args.slots} of 8 experts per layer, greedy from 'The', {args.steps} steps"
    )
    print(
        "| configuration | precision | reads ahead used / read | experts read per token | "
        "demand hit rate | logits equal stock's |"
    )
    print("|---|---|---|---|---|---|")
    for name, fields in CONFIGS.items():
        tuning = CacheTuning(staging_bytes=4 * per_slot, **fields)
        model, _ = load_streaming(
            DEMO, expert_cache_gb=args.slots * per_slot / 2**30 * 1.0001, tuning=tuning
        )
        got = greedy(model, tokenizer, args.steps)
        cache = model.expert_streaming.cache
        st = cache.prefetch_stats
        s = model.expert_streaming.stats()
        read = cache.store.stats.bytes_read / expert_bytes / len(got)
        same = sum(bool(mx.array_equal(a, b).item()) for a, b in zip(want, got))
        prec = s.get("lookahead_precision")
        prec = f"{prec:.2f}" if prec == prec and prec is not None else "-"
        print(
            f"| {name} | {prec} | {st.used['lookahead']} / {st.staged['lookahead']} | "
            f"{read:.2f} | {s['hit_rate']:.3f} | {same}/{len(want)} |"
        )
        model.expert_streaming.close()


if __name__ == "__main__":
    main()
