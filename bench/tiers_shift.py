"""Two tiers on mlx-cuda (issue 39): from a cold load to full speed, and back after a routing shift.

How long after loading with a cold page cache does a tiered model decode at full speed, and how
many tokens after the routing changes (one real trace, then another) is it back within 90% of its
steady speed? Stock, routed the same way, is timed after it; every step is compared with stock's.

    python3 bench/tiers_shift.py --ckpt-dir /root/ckpt --out $OUT --layers 16 --budget 0.25

``--try-on-cpu``: the same on the CPU at tiny size with the CUDA placement replaced by a record
of it (the script's logic, no figure). Writes ``<out>/<tag>.json``; methods.md (tiers_shift.py).
"""

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import harness
import routing_replay
from harness import BUDGET_GB, ROOT, Config, decode_block, log

TRACES = ROOT / "tests" / "data" / "routing"


def blocks(cfg, routing, tokens, block, t0):
    """``tokens`` decode steps in blocks of ``block`` under ``routing``: per block the seconds
    since ``t0`` at its end, its tok/s, the layers complete and the device tier's share."""
    routing_replay.wrap(cfg.model, routing, depends=cfg.cache is not None)
    rows = []
    for _ in range(tokens // block):
        times = decode_block(cfg, block - 1)
        row = dict(at_s=time.perf_counter() - t0, tok_s=len(times) / sum(times))
        if cfg.cache is not None:
            s = cfg.cache.summary()
            row.update(complete=s["complete_layers"], device_share=s.get("tier_device_share"),
                       moves=s.get("tier_moves"))
        rows.append(row)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ckpt-dir", default="/tmp/bench_ckpt")
    ap.add_argument("--out", default=str(ROOT / "docs" / "benchmarks"))
    ap.add_argument("--tag", default="gpu-tiers-shift")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--budget", type=float, default=0.25, help="device share of the experts")
    ap.add_argument("--tokens", type=int, default=120, help="decode steps per trace")
    ap.add_argument("--block", type=int, default=8)
    ap.add_argument("--try-on-cpu", action="store_true")
    args = ap.parse_args(argv)
    routing_replay.unwind_on_rewind()  # verified steps that run a forward again
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    shape = "qwen3"
    if args.try_on_cpu:
        from mlx_lm_streaming.runtime.memory import tiers

        set_up, placer = tiers.set_up, type("Placer", (), {"place": lambda *a, **k: None})()
        tiers.set_up = lambda cache, gb, backend, **k: set_up(cache, gb, "cuda", placer)
        shape, args.layers, args.tokens, args.block = "tiny", 4, 24, 4
    dtype = "bfloat16" if mx.default_device().type == mx.gpu else "float32"
    path = harness.checkpoint(Path(args.ckpt_dir), shape, dtype, layers=args.layers, top_k=6)
    ck = harness.expert_sizes(path)
    files = harness.shards(path)
    rng = random.Random(1)
    stream = [rng.randrange(64) for _ in range(2 * args.tokens + 8)]
    traces = [f"trace:{TRACES / n}.jsonl" for n in ("qwen3-30b-a3b", "gemma-4-26b-a4b")]
    res = dict(command=" ".join(["tiers_shift.py", *(argv or sys.argv[1:])]),
               date=time.strftime("%Y-%m-%d %H:%M"), device=str(mx.default_device()),
               layers=args.layers, budget=args.budget, traces=traces, block=args.block, runs={})
    for name in ("tiers", "stock"):
        harness.drop_page_cache(files)
        t0 = time.perf_counter()
        if name == "stock":
            model, _ = harness.load_stock(path)
        else:
            gb = args.budget * ck["total_expert_bytes"] / BUDGET_GB
            model, _ = harness.load_streaming(path, expert_cache_gb=gb, expert_host_gb=1e4)
        load_s = time.perf_counter() - t0
        cfg = Config(name, model)
        cfg.kv, cfg.stream, cfg.pos = make_prompt_cache(model), stream, 1
        run = dict(load_s=load_s, phases=[])
        for spec in traces:
            routing = harness.make_routing(spec, ck["experts"], ck["moe_layers"])
            run["phases"].append(blocks(cfg, routing, args.tokens, args.block, t0))
        run["tokens"] = cfg.tokens
        res["runs"][name] = run
        log(f"{name}: loaded in {load_s:.1f} s; " + " | ".join(
            " ".join(f"{r['tok_s']:.0f}" for r in p) for p in run["phases"]))
        if cfg.cache is not None:
            run["summary"] = {k: v for k, v in cfg.cache.summary().items() if k != "per_layer"}
            cfg.model.expert_streaming.close()
        del model, cfg
    tiers_run, stock_run = res["runs"]["tiers"], res["runs"]["stock"]
    same = [a == b for a, b in zip(tiers_run["tokens"], stock_run["tokens"])]
    res["exact_steps"], res["steps"] = sum(same), len(same)
    for i, (ours, stock) in enumerate(zip(tiers_run["phases"], stock_run["phases"])):
        steady = statistics.median(r["tok_s"] for r in ours[-5:])
        stock_tok_s = statistics.median(r["tok_s"] for r in stock[-5:])
        j = next((j for j, r in enumerate(ours) if r["tok_s"] >= 0.9 * steady), None)
        res[f"phase{i}"] = dict(
            steady_tok_s=steady, stock_tok_s=stock_tok_s, of_stock=steady / stock_tok_s,
            tokens_to_90=None if j is None else (j + 1) * args.block,
            seconds_from_load_to_90=None if j is None else ours[j]["at_s"],
        )
        log(f"phase {i}: {res[f'phase{i}']}")
    log(f"exact: {res['exact_steps']}/{res['steps']}")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"{args.tag}.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
