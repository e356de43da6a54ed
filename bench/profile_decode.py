"""cProfile of cold decode steps of a streaming model: where the host time of the expert modules goes.

    python bench/profile_decode.py [--shape qwen3] [--layers 16] [--budget 0.5]
        [--routing trace:tests/data/routing/qwen3-30b-a3b.jsonl] [--steps 10] [--variant default]

Builds (or reuses) ``bench/gpu_pipeline.py``'s checkpoint, loads the streaming model as the variant
(``gpu_pipeline.variant_options``), feeds the trace's prompt rows one token at a time, decodes a few
warm-up steps, then profiles ``--steps`` decode steps with the page cache dropped before each, and
prints the functions by own time and by cumulative time.
"""

import argparse
import cProfile
import gc
import pstats
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import experts  # noqa: E402
import gpu_pipeline as gp  # noqa: E402
from experts import GB, Config, decode_block  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ckpt-dir", default="/tmp/bench_ckpt")
    ap.add_argument("--shape", default="qwen3", choices=list(gp.SHAPES))
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--budget", type=float, default=0.5)
    ap.add_argument(
        "--routing", default="trace:" + str(ROOT / "tests/data/routing/qwen3-30b-a3b.jsonl")
    )
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--variant", default="default")
    ap.add_argument("--top", type=int, default=35)
    args = ap.parse_args()
    import mlx.core as mx

    dtype = args.dtype or ("bfloat16" if mx.default_device().type == mx.gpu else "float32")
    path = gp.build(Path(args.ckpt_dir), args.shape, args.layers, dtype)
    probe, _ = experts.load_streaming(path, expert_cache_gb=1e6)
    cache = probe.expert_streaming.cache
    total, layers, num = cache.total_expert_bytes, len(cache.banks), cache.banks[0].num_experts
    del probe, cache
    gc.collect()
    model = gp.load_variant(path, args.variant, expert_cache_gb=args.budget * total / GB)
    cfg = Config(args.variant, model, cold=True, files=experts.shards(path))
    cfg.routing = gp.make_routing(args.routing, layers, num)
    gp.wrap(cfg.model, cfg.routing)
    if gp.oracle_precision(args.variant) is not None:
        gp.set_oracle(cfg.model, cfg.routing, gp.oracle_precision(args.variant))
    rng = random.Random(1)
    vocab = model.args.vocab_size
    gp.prompt_by_token(cfg, [rng.randrange(vocab) for _ in range(28)])
    cfg.stream, cfg.pos = [rng.randrange(vocab) for _ in range(4096)], 1
    decode_block(cfg, 3)
    prof = cProfile.Profile()
    prof.enable()
    times = decode_block(cfg, args.steps)
    prof.disable()
    print(f"{args.variant}: {1 / (sum(times) / len(times)):.2f} tok/s over {len(times)} cold steps")
    for key in ("tottime", "cumulative"):
        pstats.Stats(prof).sort_stats(key).print_stats(args.top)


if __name__ == "__main__":
    main()
