"""Long prompts: layer-major prefill against chunk by chunk, against stock and the disk limit.

    python bench/prefill.py [--archs small] [--layers N] [--prefill-tokens 4096,16384]
        [--prefill-step N] [--shares 0.25,0.5] [--modes chunked,layer_major,...]
        [--page-cache cold|warm] [--rounds N] [--hold-tokens N] [--decode-tokens N] ...

Each prompt runs with empty banks (cold: the page cache dropped; warm: the checkpoint read first)
at each budget, by each mode (chunk by chunk; layer-major, each layer over its whole expert set;
layer-major in waves through the slots), beside stock resident: bytes read against what the prompt
must read and every routed expert's, speed against the limit, TTFT and MLX's peak against stock's,
the tokens after the prompt against stock's. Writes ``<out>/<tag>.json`` and prints its table
(docs/benchmarks/prefill.md; method: docs/benchmarks/methods.md, prefill.py).
"""

import argparse
import gc
import json
import os
import random
import shutil
import sys
import time
from pathlib import Path

import numpy as np

from harness import (
    ARCHS, BUDGET_GB, GB, MB, checkpoint, common_arguments, drop_page_cache, expert_sizes,
    load_stock, load_streaming, log, machine, probe_disk, shards, use_device,
)  # fmt: skip

from mlx_lm_streaming.runtime.memory.expert_cache import CacheTuning
from mlx_lm_streaming.tools.parity import vocab_size


class RoutedExperts:
    """A cache's routing recorder that keeps the distinct experts each bank was asked for: the
    experts a cold prompt must read at least once."""

    def __init__(self):
        self.used = {}

    def record(self, bank, ids):
        used = self.used.setdefault(id(bank), (bank, set()))[1]
        used.update(np.asarray(ids).reshape(-1).tolist())

    def bytes(self) -> int:
        return sum(len(s) * b.layer.expert_nbytes for b, s in self.used.values())


def layer_major_figures(args, dtype: str) -> None:
    """Each prompt of ``--prefill-tokens`` at each budget of ``--shares`` by each of ``--modes``."""
    import mlx.core as mx

    from mlx_lm_streaming import _bootstrap

    # what the installed startup hook does (a checkout on PYTHONPATH, as on the device, has none):
    # mlx-lm's modules patched, generate_step given layer-major prefill
    _bootstrap.install()
    import mlx_lm.generate  # noqa: F401

    generate = sys.modules["mlx_lm.generate"]
    stock_step = getattr(generate.generate_step, "stock", generate.generate_step)
    name = (args.archs or ("tiny" if args.quick else "small")).split(",")[0]
    path = checkpoint(Path(args.ckpt_dir), name, dtype, layers=args.layers)
    cold, modes, files = args.page_cache == "cold", args.modes.split(","), shards(path)
    prompt_sizes = [int(n) for n in args.prefill_tokens.split(",")]
    shares, step = [float(x) for x in args.shares.split(",")], args.prefill_step
    stock, config = load_stock(path)
    vocab = vocab_size(config)
    stream = [random.Random(7).randrange(vocab) for _ in range(args.decode_tokens + 4)]
    expert = expert_sizes(path)
    total, expert_nbytes = expert["total_expert_bytes"], expert["expert_bytes"]
    os.sync()  # a checkpoint just built: dirty pages would stay in the page cache
    bw = probe_disk(files, expert_nbytes, min(256 * MB, sum(os.path.getsize(f) for f in files)))
    disk = max(v for v in bw.values() if v) * GB  # bytes/s
    log(f"disk GB/s: {bw}")
    spec = ARCHS[name]
    res = {
        "command": "python " + " ".join(sys.argv), "machine": machine(args.device_kind),
        "device_kind": args.device_kind, "page_cache": args.page_cache,
        "shape": {"name": name, "label": spec["label"], "arch": spec["arch"], "dtype": dtype,
                  "layers": args.layers or spec["layers"], **spec["overrides"]},
        "expert_bytes": expert_nbytes, "total_expert_bytes": total, "prefill_step": step,
        "decode_tokens": args.decode_tokens, "disk_gbps": bw, "disk_bytes_per_s": disk, "runs": [],
    }  # fmt: skip

    # tokens -> (must read, by all but the last token) from each prompt's first streaming run: a
    # routing recorder makes layer sets compute the last layer's router (and attention), which a
    # user's prefill does not; routing is the same in every mode
    must_known = {}

    def run(model, prompt, cold):
        """One prompt through mlx-lm's generate_step (ours wrapped where ``model`` streams), then
        the decode tokens: figures of the run."""
        state = getattr(model, "expert_streaming", None)
        routed = RoutedExperts()  # (given to the cache on each prompt's first streaming run)
        if state is not None and prompt.size not in must_known:
            state.cache.recorder = routed
        if cold:
            drop_page_cache(files)
        elif state is not None:  # warm: every shard in the page cache
            for f in files:
                shutil.copyfileobj(open(f, "rb"), open(os.devnull, "wb"), 64 * MB)
        gc.collect()
        mx.synchronize()
        mx.reset_peak_memory()
        out = {"argmax": [], "first": None, "start_gb": mx.get_active_memory() / 1e9}
        fed = iter(stream)

        def sampler(logprobs):
            out["argmax"].append(mx.argmax(logprobs, axis=-1))
            return mx.array([next(fed)], dtype=mx.uint32)

        def progress(done, total):
            # every token but the last prefilled (the last one's step is stock's, with the
            # logits): what was read so far, against what those tokens must read
            if state is not None and done == total - 1 and "prompt_gb_read" not in out:
                out["prompt_gb_read"] = state.stats()["gb_read"]
                out["prompt_must_read_gb"] = routed.bytes() / 1e9

        step_fn = generate.generate_step if state is not None else stock_step
        start, cpu = time.perf_counter(), time.process_time()  # (the load moves CPU time less)
        for n, (_, logprobs) in enumerate(
            step_fn(prompt, model, max_tokens=args.decode_tokens + 1, sampler=sampler,
                    prefill_step_size=step, prompt_progress_callback=progress)
        ):  # fmt: skip
            if n == 0:
                mx.eval(logprobs)
                out["ttft_s"], out["ttft_cpu_s"] = time.perf_counter() - start, time.process_time()
                out["ttft_cpu_s"] -= cpu
                out["first"], out["peak_prefill_gb"] = logprobs, mx.get_peak_memory() / 1e9
                if state is not None:
                    s = state.stats()
                    out["gb_read"], out["must_read_gb"] = s["gb_read"], routed.bytes() / 1e9
                    h0, m0 = s["hits"], s["misses"]
        mx.synchronize()
        out["argmax"] = [int(t.item()) for t in out["argmax"]]
        if state is not None:
            s = state.stats()
            asked = s["hits"] - h0 + s["misses"] - m0
            out["decode_hit_rate"] = (s["hits"] - h0) / asked if asked else None
            prefill = state.prefill
            out.update(held_gb=prefill.held_bytes / 1e9, groups=prefill.groups,
                       layer_major_prompts=prefill.prompts, fallbacks=prefill.fallbacks,
                       set_gb=prefill.set_bytes / 1e9, waves_why=prefill.waves_why)
            state.cache.recorder = None
            key, known = prompt.size, (out["must_read_gb"], out.get("prompt_must_read_gb"))
            out["must_read_gb"], out["prompt_must_read_gb"] = must_known.setdefault(key, known)
        return out

    def run_streaming(prompt, share, mode):
        """``run`` (cold or warm), a model loaded with ``share`` of the expert bytes, prefill by
        ``mode``: chunked, layer_major (the sets filled straight in), waves (layer-major without
        layer sets), staged, hoststaged (the sets filled through a stage on the device, the
        default, or in page-locked host memory: ``CacheTuning.set_stage``; no stage but on
        mlx-cuda), tier_sets (over two tiers, layer-major over sets staged on the device:
        ``CacheTuning.tier_layer_sets``, the default; the other modes over two tiers: copies of
        the banks)."""
        stage = {"staged": "device", "tier_sets": "device", "hoststaged": "host"}.get(mode)
        tuning = CacheTuning(layer_sets=mode != "waves", tier_layer_sets=mode == "tier_sets",
                             set_stage=stage)  # fmt: skip
        model, _ = load_streaming(path, expert_cache_gb=share * total / BUDGET_GB, tuning=tuning,
                                  layer_major_prefill=mode != "chunked")  # fmt: skip
        r = run(model, prompt, cold=cold)
        r["hold_limit"] = model.expert_streaming.cache.tuning.prefill_hold_bytes
        model.expert_streaming.close()
        return r

    def same(r, ref):
        """How many of the tokens after the prompt are ``ref``'s, and its first logprobs' bits."""
        return sum(a == b for a, b in zip(r["argmax"], ref["argmax"])), bool(
            mx.array_equal(r["first"], ref["first"]))  # fmt: skip

    # a warm-up of every kind of run first (on CUDA the first prefill compiles its kernels: the
    # H200's first stock prefill of 4096 tokens took 178 s where the second took under 2)
    warm = mx.array([random.Random(i).randrange(vocab) for i in range(2 * step + 2)])
    run(stock, warm, cold=False)
    for mode in modes:
        run_streaming(warm, shares[0], mode)
    for tokens in prompt_sizes:
        prompt = mx.array([random.Random(i).randrange(vocab) for i in range(tokens)])
        ref = run(stock, prompt, cold=False)
        stock_s = ref["ttft_s"]
        base = {"tokens": tokens, "stock_ttft_s": stock_s}
        row = {
            **base, "mode": "stock", "tokens_compared": len(ref["argmax"]), "ttft_s": stock_s,
            "prefill_tok_s": tokens / stock_s, "peak_prefill_gb": ref["peak_prefill_gb"],
        }  # fmt: skip
        if args.device_kind == "gpu":
            # stock's own run-to-run (on CUDA a long prompt's logits vary from run to run)
            again = run(stock, prompt, cold=False)
            equal, first = same(again, ref)
            row.update(stock_again_ttft_s=again["ttft_s"],
                       stock_run_to_run_same_tokens=again["argmax"] == ref["argmax"],
                       stock_run_to_run_tokens_equal=equal,
                       stock_run_to_run_same_first_logprobs=first)  # fmt: skip
        res["runs"].append(row)
        log(json.dumps(row))
        for share in shares:
            budget = share * total
            rounds = [modes if r % 2 == 0 else modes[::-1] for r in range(args.rounds or 1)]
            stock_round = {0: ref}  # round -> stock's run again at its start
            for r_index, mode in ((r, m) for r, order in enumerate(rounds) for m in order):
                if r_index not in stock_round:
                    stock_round[r_index] = run(stock, prompt, cold=False)
                r = run_streaming(prompt, share, mode)
                must = r["must_read_gb"] * 1e9
                limit = max(stock_s, must / disk)
                equal, first = same(r, ref)
                # prefix_...: every token but the last (whose step, stock's, may read what the
                # slot banks lack); every_expert: issue 47's measure; peak_bound: stock's peak over
                # its start's memory, on this run's (stock loaded too), the sets and states held
                row = {
                    **base, "share": share, "mode": mode, "round": r_index,
                    "budget_gb": budget / 1e9, "gb_read": r["gb_read"], "must_read_gb": must / 1e9,
                    "read_over_must_read": r["gb_read"] * 1e9 / must if must else None,
                    "prefix_read_over_must_read": r["prompt_gb_read"] / r["prompt_must_read_gb"]
                    if r.get("prompt_must_read_gb") else None,
                    "uncached_gb": (total - budget) / 1e9,
                    "read_over_every_expert": r["gb_read"] * 1e9 / total,
                    "set_gb": r["set_gb"], "waves_why": r["waves_why"],
                    "peak_bound_gb": ref["peak_prefill_gb"] - ref["start_gb"] + r["start_gb"]
                    + r["set_gb"] + r["held_gb"],
                    "read_over_uncached": r["gb_read"] * 1e9 / (total - budget),
                    "ttft_s": r["ttft_s"], "prefill_tok_s": tokens / r["ttft_s"],
                    "limit_s": limit, "of_limit": limit / r["ttft_s"],
                    "stock_round_ttft_s": (again := stock_round[r_index])["ttft_s"],
                    "ttft_over_stock": r["ttft_s"] / again["ttft_s"],
                    "ttft_cpu_over_stock": r["ttft_cpu_s"] / again["ttft_cpu_s"],
                    **{k: r[k] for k in ("held_gb", "groups", "peak_prefill_gb", "decode_hit_rate",
                                         "layer_major_prompts", "fallbacks")},
                    "same_tokens_as_stock": r["argmax"] == ref["argmax"],
                    "tokens_equal_to_stock": equal, "tokens_compared": len(ref["argmax"]),
                    "same_first_logprobs_as_stock": first,
                }  # fmt: skip
                res["runs"].append(row)
                log(json.dumps(row))
                gc.collect()
    if args.hold_tokens:
        tokens = args.hold_tokens
        prompt = mx.array([random.Random(i).randrange(vocab) for i in range(tokens)])
        r = run_streaming(prompt, shares[0], "layer_major")
        limit = r["hold_limit"]
        keys = ("held_gb", "groups", "peak_prefill_gb", "ttft_s", "gb_read", "must_read_gb")
        res["hold"] = {"tokens": tokens, "share": shares[0], **{k: r[k] for k in keys},
                       "hold_limit_gb": limit / 1e9 if limit else None,
                       "prefill_tok_s": tokens / r["ttft_s"]}  # fmt: skip
        log(json.dumps(res["hold"]))
    out = Path(args.out) / f"{args.tag or 'prefill-' + args.device_kind}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    print(prefill_table(res))
    print(f"wrote {out}")


def prefill_table(res) -> str:
    """The figures of ``layer_major_figures`` as a table (also for docs/benchmarks/prefill.md)."""
    lines = [
        f"{res['shape']['label']}, {res['shape']['layers']} layers, {res['shape']['dtype']}, "
        f"chunks of {res['prefill_step']} tokens, page cache {res.get('page_cache', 'cold')}; disk "
        f"{res['disk_bytes_per_s'] / 1e9:.2f} GB/s",
        "| tokens | budget | prefill | GB read | x must read (all but last token) | x every expert "
        "| x uncached | tok/s | of limit | TTFT s | x stock TTFT | held GB | sets GB | peak GB "
        "| peak bound GB | decode hits | tokens = stock |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in res["runs"]:
        if r["mode"] == "stock":
            lines.append(
                f"| {r['tokens']} | all resident | stock | - | - | - | - "
                f"| {r['prefill_tok_s']:.1f} | - | {r['ttft_s']:.2f} | 1.00 | - | - "
                f"| {r['peak_prefill_gb']:.2f} | - | - "
                + (f"| run to run: {r['stock_run_to_run_tokens_equal']}/{r['tokens_compared']} |"
                   if "stock_run_to_run_tokens_equal" in r else "| - |")
            )
            continue
        lines.append(
            f"| {r['tokens']} | {r['share']:.0%} | {r['mode'].replace('_', '-')} "
            f"| {r['gb_read']:.3f} | {r['read_over_must_read']:.2f} "
            f"({r['prefix_read_over_must_read'] or 0:.2f}) "
            f"| {r.get('read_over_every_expert', 0):.2f} "
            f"| {r['read_over_uncached']:.2f} | {r['prefill_tok_s']:.1f} | {r['of_limit']:.2f} "
            f"| {r['ttft_s']:.2f} | {r['ttft_over_stock']:.2f} | {r['held_gb']:.3f} "
            f"| {r.get('set_gb', 0):.3f} | {r['peak_prefill_gb']:.2f} "
            f"| {r.get('peak_bound_gb', 0):.2f} | {_digits(r['decode_hit_rate'])} "
            f"| {r['tokens_equal_to_stock']}/{r['tokens_compared']}"
            f"{', first bits equal' if r['same_first_logprobs_as_stock'] else ''} |"
        )
    by = {}  # per round: each mode's TTFT over stock's
    for r in (r for r in res["runs"] if r["mode"] != "stock"):
        by.setdefault((r["tokens"], r["share"], r["mode"]), []).append(r["ttft_over_stock"])
    for (tokens, share, mode), ratios in sorted(by.items()):
        lines.append(f"\n{tokens} tokens, {share:.0%}, {mode}: TTFT over stock's per round: "
                     + ", ".join(f"{x:.2f}" for x in ratios))  # fmt: skip
    if h := res.get("hold"):
        lines.append(
            f"\n{h['tokens']} tokens, layer-major at {h['share']:.0%}: {h['held_gb']:.3f} GB of "
            f"hidden states held at most (bound {h['hold_limit_gb'] or 0:.2f} GB, {h['groups']} "
            f"groups), MLX peak {h['peak_prefill_gb']:.2f} GB, {h['prefill_tok_s']:.1f} tok/s, "
            f"{h['gb_read']:.3f} GB read ({h['must_read_gb']:.3f} must be read)"
        )
    return "\n".join(lines)


def _digits(x) -> str:
    """A rate to 3 decimals, or "-" where none was measured (two tiers: no decode hits counted)."""
    return "-" if x is None else f"{x:.3f}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common_arguments(ap, "one of " + ",".join(ARCHS) + " (default small)")
    ap.add_argument("--prefill-tokens", default="4096,16384", help="comma-separated")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--prefill-step", type=int, default=2048)
    ap.add_argument("--shares", default="0.25,0.5", help="budgets, shares of the expert bytes")
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--layers", type=int, default=None, help="MoE layers (default: the shape's)")
    ap.add_argument("--modes", default="chunked,layer_major",
                    help="chunked,layer_major,waves,tier_sets,staged,hoststaged")
    ap.add_argument("--page-cache", choices=["cold", "warm"], default="cold")
    ap.add_argument("--hold-tokens", type=int, default=None,
                    help="one more layer-major prompt this long (held states)")
    layer_major_figures(args := ap.parse_args(), use_device(args.device_kind))


if __name__ == "__main__":
    main()
