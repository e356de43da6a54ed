"""Two tiers on mlx-cuda (issue 39): decode with a share of the experts on the device and the rest in
host memory read in place, against stock as a user sees it, token by token against stock.

Every configuration decodes through ``mlx_lm.stream_generate`` (greedy; the routing's ids injected
alike in all, sliced from a table sent to the device once: ``routing_replay``), timed from its
first token to its last, in interleaved rounds; stock with its own router is "stock as a user sees
it". Each round's log-probabilities are hashed bit for bit and compared with stock's first round
(stock's own round-to-round result beside them). A tiered model is loaded with the page cache
dropped, and decoded until every bank is complete (its background fill done): that time is "load
to full speed". The H200 run:

    python3 bench/tiers.py --ckpt-dir /root/ckpt --out $OUT --layers 16 --shares 1,0.5,0.25,0

On the CPU (``--quick``) the option is refused (unified memory): the script says so and times
nothing but stock. Writes ``<out>/<tag>.json`` and ``.md``.
"""

import argparse
import hashlib
import json
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import harness  # noqa: E402
import routing_replay  # noqa: E402
from harness import log  # noqa: E402

TRACE = "trace:" + str(ROOT / "tests/data/routing/qwen3-30b-a3b.jsonl")


def run_once(model, tokenizer, prompt, tokens, routing):
    """``(seconds per token, hashes)`` of one stream_generate run from a rewound routing."""
    import mlx.core as mx
    import numpy as np
    from mlx_lm import stream_generate

    if routing is not None:
        routing.reset()
    stamps, lps = [], []
    for r in stream_generate(model, tokenizer, prompt, max_tokens=tokens):
        stamps.append(time.perf_counter())
        lps.append(r.logprobs)
    hashes = [hashlib.sha1(np.array(lp.view(mx.uint8)).tobytes()).hexdigest()[:16] for lp in lps]
    return (stamps[-1] - stamps[0]) / max(1, len(stamps) - 1), hashes


def wait_complete(model, tokenizer, prompt, routing, limit_s):
    """Decode until every bank is complete; returns the seconds from now to then (None: not in
    ``limit_s``)."""
    cache = model.expert_streaming.cache
    start = time.perf_counter()
    while time.perf_counter() - start < limit_s:
        run_once(model, tokenizer, prompt, 8, routing)
        if not all(b.identity for b in cache.banks):
            return None  # no identity banks (no host tier here): never complete
        if cache.summary()["complete_layers"] == len(cache.banks):
            return time.perf_counter() - start
    return None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ckpt-dir", default="/tmp/bench_ckpt")
    ap.add_argument("--out", default=str(ROOT / "docs" / "benchmarks"))
    ap.add_argument("--tag", default="gpu-tiers")
    ap.add_argument("--shape", default="qwen3", choices=tuple(harness.ARCHS))
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--shares", default="1,0.5,0.25,0", help="device shares of the experts")
    ap.add_argument("--routings", default=TRACE + ",uniform")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--warm-runs", type=int, default=3, help="untimed runs after complete")
    ap.add_argument("--quick", action="store_true", help="tiny shape, 2 layers (CPU)")
    args = ap.parse_args(argv)
    if args.quick:
        args.shape, args.layers, args.rounds, args.tokens, args.warm_runs = "tiny", 2, 2, 8, 1
    import mlx.core as mx
    from mlx_lm.utils import load_tokenizer

    from mlx_lm_streaming.errors import ConfigurationError

    dtype = "bfloat16" if mx.default_device().type == mx.gpu else "float32"
    top_k = 6 if harness.ARCHS[args.shape]["overrides"]["experts"] == 128 else None
    path = harness.checkpoint(Path(args.ckpt_dir), args.shape, dtype, args.layers, top_k=top_k)
    files = harness.shards(path)
    sizes = harness.expert_sizes(path)
    total = sizes["total_expert_bytes"]
    tokenizer = load_tokenizer(path)
    shares = [float(x) for x in args.shares.split(",") if x]
    res = dict(command=" ".join(["tiers.py", *(argv or sys.argv[1:])]), device=str(mx.default_device()),
               mlx=mx.__version__, date=time.strftime("%Y-%m-%d %H:%M"), layers=args.layers,
               shape=args.shape, dtype=dtype, tokens=args.tokens, rounds=args.rounds,
               total_expert_gb=total / 1e9, routings=[])
    rng = random.Random(0)
    for spec in [s for s in args.routings.split(",") if s]:
        make = lambda: harness.make_routing(spec, sizes["experts"], sizes["moe_layers"])  # noqa
        models, routings = {}, {}
        own, config = harness.load_stock(path)
        models["stock_own"], routings["stock_own"] = own, None
        for name in ("stock", "stock_again"):
            m, _ = harness.load_stock(path)
            routings[name] = make()
            routings[name].wrap(m)
            models[name] = m
        rows = routings["stock"].decode_rows() if hasattr(routings["stock"], "decode_rows") else 28
        prompt = [rng.randrange(config["vocab_size"]) for _ in range(rows)]
        loads = {}
        for share in shares:
            name = f"device {share:g}"
            gb = max(share * total, 1) / 1e9
            harness.drop_page_cache(files)
            start = time.perf_counter()
            try:
                m, _ = harness.load_streaming(path, expert_cache_gb=gb)
            except ConfigurationError as e:
                log(f"{name}: {e}")
                res.setdefault("refused", str(e))
                continue
            routings[name] = make()
            routings[name].wrap(m)
            done = wait_complete(m, tokenizer, prompt, routings[name], 120)
            loads[name] = dict(load_to_complete_s=None if done is None else time.perf_counter() - start,
                               tiers=m.expert_streaming.cache.tiers is not None)
            models[name] = m
        for name, m in models.items():  # warmed alike
            for _ in range(args.warm_runs):
                run_once(m, tokenizer, prompt, args.tokens, routings[name])
        before = {n: m.expert_streaming.cache.summary() for n, m in models.items()
                  if hasattr(m, "expert_streaming")}
        rounds, hashes = [], {n: [] for n in models}
        for r in range(args.rounds):
            row = {}
            for name in rng.sample(list(models), len(models)):
                row[name], h = run_once(models[name], tokenizer, prompt, args.tokens, routings[name])
                hashes[name].append(h)
            rounds.append(row)
            log(f"[{spec}] round {r}: " + ", ".join(f"{k} {1 / v:.1f}" for k, v in row.items()))
        ref = hashes["stock"][0]
        for name, hs in hashes.items():
            for h in hs:
                if name != "stock_own" and h != ref:
                    first = next(i for i, (a, b) in enumerate(zip(h, ref)) if a != b)
                    log(f"[{spec}] {name}: differs from stock's first round at token {first}")
        out = dict(routing=harness.routing_label(spec), prompt_tokens=len(prompt), configs={})
        for name in models:
            s = [row[name] for row in rounds]
            c = dict(tok_s=len(s) / sum(s), tok_s_rounds=[1 / x for x in s],
                     ratio_to_user_stock=statistics.median(r["stock_own"] / r[name] for r in rounds),
                     ratio_to_injected_stock=statistics.median(r["stock"] / r[name] for r in rounds),
                     same_as_stock_first_round=[h == ref for h in hashes[name]]
                     if name != "stock_own" else None, **loads.get(name, {}))
            if name in before:
                now = models[name].expert_streaming.cache.summary()
                c.update({k: now.get(k) for k in ("tier_device_gb", "tier_host_gb",
                                                   "tier_device_share", "tier_moves",
                                                   "tier_error", "complete_layers")})
                c["hits_during_rounds"] = now["hits"] - before[name]["hits"]
                c["misses_during_rounds"] = now["misses"] - before[name]["misses"]
            out["configs"][name] = c
        res["routings"].append(out)
        for m in models.values():
            if hasattr(m, "expert_streaming"):
                m.expert_streaming.close()
        del models
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / f"{args.tag}.json").write_text(json.dumps(res, indent=1, default=str))
    md = table(res)
    (Path(args.out) / f"{args.tag}.md").write_text(md)
    print(md, flush=True)
    return res


def table(res) -> str:
    lines = [f"# tiers: {res['shape']} shape, {res['layers']} MoE layers, {res['dtype']}, "
             f"{res['device']} (mlx {res['mlx']}); {res['rounds']} rounds of {res['tokens']} "
             f"tokens of stream_generate each; experts {res['total_expert_gb']:.2f} GB", ""]
    for out in res["routings"]:
        lines += [f"## {out['routing']}", "",
                  "| config | tok/s | of stock as a user sees it | of injected stock | exact rounds "
                  "| device GB | host GB | uses from the device | moves | load to full speed s |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for name, c in out["configs"].items():
            same = c["same_as_stock_first_round"]
            exact = "-" if same is None else f"{sum(same)}/{len(same)}"
            cell = lambda k, f: "" if c.get(k) is None else format(c[k], f)  # noqa: E731
            lines.append(f"| {name} | {c['tok_s']:.1f} | {c['ratio_to_user_stock']:.3f} | "
                         f"{c['ratio_to_injected_stock']:.3f} | {exact} | "
                         f"{cell('tier_device_gb', '.2f')} | {cell('tier_host_gb', '.2f')} | "
                         f"{cell('tier_device_share', '.3f')} | {cell('tier_moves', 'd')} | "
                         f"{cell('load_to_complete_s', '.1f')} |")
        lines.append("")
    if res.get("refused"):
        lines.append(f"Refused here: {res['refused']}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
