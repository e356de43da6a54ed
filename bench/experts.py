"""Expert streaming benchmark: ours against stock resident, side by side in one process.

    python bench/experts.py [--quick] [--device-kind cpu|gpu] [--archs qwen3,mixtral,dsv2]
                            [--routing uniform,trace:FILE] [--ckpt-dir DIR] [--out DIR] [--tag NAME]

For each shape (``harness.ARCHS``: the experts of Qwen3-30B-A3B, Mixtral-8x7B, DeepSeek-V2-Lite at
fewer layers; ``--quick``: a tiny one) a synthetic checkpoint is built once under ``--ckpt-dir``.
Every configuration is loaded, then timed in interleaved rounds, so noise from a shared machine hits
them alike; ratios are medians of per-round ratios. Configurations: ``stock`` (every weight
resident), ``warm`` (budget = every expert, after the background fill), ``cold`` (25% of the expert
bytes, the checkpoint dropped from the page cache before every token), and the ablations
``stock_again`` (the run's noise floor) and ``cold_staged`` (direct reads off).

Measured: decode tok/s and bit-exactness with stock at every step; prefill (cold: empty banks, cold
page cache); bytes read, hit rate, I/O wait per token; lookahead precision / recall; the disk's
bandwidth for reads of one expert; the cold rows replayed through its policy, LRU and Belady; the
GB/s its reads achieved; peak RSS of stock / warm / cold, each in a process of its own. Writes
``<out>/<tag>.json``, ``.md`` and ``.png`` (``report.py``; ``--render FILE.json`` makes them again).
"""

import argparse
import gc
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402
from harness import (  # noqa: E402
    ARCHS, BUDGET_GB, COLD_SHARE, GB, MB, PREFILL_TOKENS, ROOT, CallLog, Config, ReadSpans, checkpoint,
    decode_block, delta, drop_page_cache, load_stock, load_streaming, log, make_routing,
    measure_rss, precision_recall, prefill, probe_disk, ratios, replay_figures, reset_banks,
    routing_label, rss_child, shards,
)  # fmt: skip
from report import machine, markdown, render, write  # noqa: E402

REAL_SHAPES = ["qwen3", "mixtral", "dsv2"]  # the default --archs (not "tiny")


def routing_arg(value: str) -> str:
    """One or more of uniform, model, trace:FILE, comma-separated (each is run in turn)."""
    for one in value.split(","):
        if one in ("uniform", "model"):
            continue
        if one.startswith("trace:"):
            from mlx_lm_streaming.files.routing_trace import TraceError, read_trace

            try:
                read_trace(one[len("trace:") :])
            except TraceError as e:
                raise argparse.ArgumentTypeError(str(e)) from None
            continue
        raise argparse.ArgumentTypeError(f"{one!r}: use uniform, model or trace:FILE")
    return value


def layers_arg(value: str):
    """N (every shape) or NAME=N,... (per shape)."""
    if value.isdigit():
        return int(value)
    try:
        out = {k: int(v) for k, v in (part.split("=") for part in value.split(","))}
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r}: use N or NAME=N,...") from None
    unknown = set(out) - set(ARCHS)
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown shapes {sorted(unknown)}: use {list(ARCHS)}")
    return out


def run_arch(name, path, args, device):
    import mlx.core as mx

    files = shards(path)
    spec = ARCHS[name]
    layers = args.layers or spec["layers"]
    res = {"arch": name, "label": spec["label"], "layers": layers, "path": str(path)}

    stock, config = load_stock(path)
    probe, _ = load_streaming(path, expert_cache_gb=1e6)
    probe_cache = probe.expert_streaming.cache
    total_expert = probe_cache.total_expert_bytes
    banks = probe_cache.banks
    expert_nbytes = banks[0].layer.expert_nbytes
    per_slot = sum(b.layer.expert_nbytes for b in banks)
    resident = probe.expert_streaming.resident_bytes
    res.update(
        total_expert_bytes=total_expert,
        expert_bytes=expert_nbytes,
        moe_layers=len(banks),
        experts=banks[0].num_experts,
        resident_bytes=resident,
        checkpoint_bytes=sum(os.path.getsize(f) for f in files),
    )
    del probe, probe_cache, banks
    cold_gb = COLD_SHARE * total_expert / BUDGET_GB
    cold_slots = int(COLD_SHARE * total_expert) // per_slot
    res["cold_budget_bytes"] = cold_slots * per_slot
    res["cold_slots"] = cold_slots

    # the disk's own bandwidth for reads of one expert
    total = (
        min(512 * MB, res["checkpoint_bytes"])
        if not args.quick
        else min(256 * MB, res["checkpoint_bytes"])
    )
    bw = probe_disk(files, expert_nbytes, total)
    res["disk_gbps"] = bw
    disk = max(v for v in bw.values() if v)
    res["disk_best_gbps"] = disk
    log(f"[{name}] disk GB/s: {bw}")

    configs = {"stock": Config("stock", stock)}
    warm, _ = load_streaming(path, expert_cache_gb=total_expert / BUDGET_GB * 1.001)
    configs["warm"] = Config("warm", warm)
    cold, _ = load_streaming(path, expert_cache_gb=cold_gb)
    configs["cold"] = Config("cold", cold, cold=True, files=files)
    ablations = args.ablations
    if "stock_again" in ablations:
        # a second stock model, timed like the others: stock vs stock_again is the run's noise floor
        m, _ = load_stock(path)
        configs["stock_again"] = Config("stock_again", m)
    if "cold_staged" in ablations:
        # demand reads through staging buffers and an MLX copy into the banks (before direct reads)
        m, _ = load_streaming(path, expert_cache_gb=cold_gb, direct_reads=False)
        configs["cold_staged"] = Config("cold_staged", m, cold=True, files=files)

    res["routing"] = args.routing
    fold = getattr(args, "fold", None)
    res["routing_fold"] = fold
    res["routing_label"] = routing_label(args.routing, fold, layers)
    for cfg in configs.values():
        cfg.routing = make_routing(args.routing, res["experts"], layers, fold=fold)
        if cfg.routing is not None:
            cfg.routing.wrap(cfg.model)
        cfg.calls = CallLog(cfg.routing) if cfg.routing is not None and cfg.name == "cold" else None
        cfg.spans = ReadSpans(cfg.cache.store) if cfg.cold and cfg.cache is not None else None

    # warm-up: stock once; warm until its background fill completed
    vocab = config.get("vocab_size") or config["text_config"]["vocab_size"]
    rng = random.Random(1)
    short = mx.array([rng.randrange(vocab) for _ in range(16)])
    long = mx.array([rng.randrange(vocab) for _ in range(args.prefill_tokens)])
    res["prefill_tokens"] = args.prefill_tokens
    prefill(configs["stock"], short)
    if device == "gpu":
        # mlx-cuda compiles kernels on first use: once per shape family, outside the timings
        for cfg in configs.values():
            prefill(cfg, long)
    cfg, start, calls = configs["warm"], time.perf_counter(), 0
    cache = cfg.model.expert_streaming.cache
    while True:
        prefill(cfg, short)
        calls += 1
        if all(b.complete for b in cache.banks) or calls > 200:
            break
        time.sleep(0.05)
    res["warm_fill"] = {
        "seconds": time.perf_counter() - start,
        "calls": calls,
        "complete": all(b.complete for b in cache.banks),
    }
    log(f"[{name}] warm filled: {res['warm_fill']}")

    def same_routing_from_here():
        for cfg in configs.values():
            if cfg.routing is not None:
                cfg.routing.reset()

    # prefill of 512 tokens: stock, warm; cold from empty banks and a cold page cache
    pre = {k: [] for k in ("stock", "warm", "cold") if k in configs}
    pre_stats = {}
    for rep in range(args.prefill_reps):
        same_routing_from_here()
        for key in pre:
            cfg = configs[key]
            if cfg.cold:
                reset_banks(cfg.model)
                drop_page_cache(cfg.files)
                c0 = cfg.counters()
            t, _, _ = prefill(cfg, long)
            pre[key].append(t)
            if cfg.cold:
                pre_stats[key] = delta(c0, cfg.counters())
                pre_stats[key]["prefetch"] = precision_recall(pre_stats[key].get("prefetch"))
            log(f"[{name}] prefill {key}: {t:.2f} s")
    res["prefill_s"] = {k: min(v) for k, v in pre.items()}
    res["prefill_all_s"] = pre
    res["prefill_stats"] = pre_stats

    # decode: each config prefills a short prompt, then interleaved rounds
    stream = [rng.randrange(vocab) for _ in range(4096)]
    same_routing_from_here()
    for cfg in configs.values():
        if cfg.cache is not None and cfg.cold:
            reset_banks(cfg.model)
        if cfg.calls is not None:
            cfg.calls.clear()  # from the cold start on: the rows replay_figures replays
        _, cfg.kv, logits = prefill(cfg, short)
        cfg.stream, cfg.pos = stream, 1
        # one warm-up block (allocations, first reads) outside the measurement
        decode_block(cfg, 2)
        cfg.tokens = []
        cfg.stats0 = cfg.counters()
        if cfg.calls is not None:
            cfg.decode_from = cfg.calls.rows()
        if cfg.spans is not None:
            cfg.spans.clear()
    rounds = []
    order = list(configs)
    for r in range(args.rounds):
        row = {}
        # a new order every round (seeded): rotating one order would keep each configuration's
        # predecessor fixed, so whatever one leaves behind (a dropped page cache, freed buffers)
        # would always slow the same next one
        for key in random.Random(r).sample(order, len(order)):
            cfg = configs[key]
            times = decode_block(cfg, args.block)
            cfg.decode_s.extend(times)
            row[key] = sum(times) / len(times)
        rounds.append(row)
        log(
            f"[{name}] round {r}: "
            + ", ".join(f"{k} {1 / v:.2f}" for k, v in row.items())
            + " tok/s"
        )
    res["rounds"] = rounds
    dec = {}
    for key, cfg in configs.items():
        n = len(cfg.decode_s)
        c = delta(cfg.stats0, cfg.counters())
        asked = c.get("hits", 0) + c.get("misses", 0)
        dec[key] = {
            "tokens": n,
            "s_per_token_mean": sum(cfg.decode_s) / n,
            "s_per_token_median": statistics.median(cfg.decode_s),
            "tok_s": n / sum(cfg.decode_s),
            "hit_rate": (c["hits"] / asked) if asked else None,
            "bytes_per_token": c.get("bytes_read", 0) / n,
            "miss_bytes_per_token": c.get("misses", 0) * expert_nbytes / n,
            "io_wait_s_per_token": c.get("io_wait_seconds", 0.0) / n,
            "install_s_per_token": c.get("install_seconds", 0.0) / n,
            "prefetch": precision_recall(c.get("prefetch")),
        }
        if cfg.spans is not None:
            # the GB/s the reads achieved (GB = 2**30, as the disk probe's): over the wall time at
            # least one read was in flight, and over the store's own read seconds (its stats:
            # summed over reads, which overlap on the reader threads), over the I/O wait
            f = cfg.spans.figures()
            read = c.get("bytes_read", 0)
            dec[key]["reads"] = f
            dec[key]["read_gbps_in_flight"] = (
                f["bytes"] / f["in_flight_seconds"] / GB if f["in_flight_seconds"] else None
            )
            sec = c.get("store_read_seconds", 0.0)
            dec[key]["read_gbps_store_seconds"] = read / sec / GB if sec else None
            wait = c.get("io_wait_seconds", 0.0)
            dec[key]["read_gbps_io_wait"] = read / wait / GB if wait else None
    res["decode"] = dec
    cold_cfg = configs.get("cold")
    if cold_cfg is not None and cold_cfg.calls is not None:
        banks = cold_cfg.cache.banks
        res["replay"] = replay_figures(
            cold_cfg.calls,
            cold_cfg.decode_from,
            [b.slots for b in banks],
            res["experts"],
            cold_cfg.cache.policy,
        )
        log(f"[{name}] replay of the cold rows: {res['replay']}")
    # exactness across configurations: identical greedy tokens
    ref = configs["stock"].tokens
    res["same_tokens"] = {k: cfg.tokens == ref[: len(cfg.tokens)] for k, cfg in configs.items()}
    from mlx_lm_streaming.runtime import host_views

    # whether staging buffers are MLX memory written through host views (else numpy + a copy)
    res["staging_host_views"] = host_views._HOST_VIEWS
    # whether the cold configuration read straight into its banks (host views of MLX memory)
    res["direct_reads"] = all(b.direct for b in cold.expert_streaming.cache.banks)
    res["ratios"] = ratios(res, rounds)
    del configs, stock, warm, cold
    gc.collect()
    return res


class RoutedExperts:
    """A cache's routing recorder that keeps the distinct experts each bank was asked for: the
    experts a cold prompt must read at least once."""

    def __init__(self):
        self.used = {}

    def record(self, bank, ids):
        import numpy as np

        self.used.setdefault(id(bank), (bank, set()))[1].update(np.asarray(ids).reshape(-1).tolist())

    def bytes(self) -> int:
        return sum(len(s) * b.layer.expert_nbytes for b, s in self.used.values())

    def close(self):
        pass


def layer_major_figures(args) -> None:
    """``--layer-major-prefill``: long prompts (``--prefill-tokens``, comma-separated) in chunks of
    ``--prefill-step``, cold (empty banks, checkpoint dropped from the page cache), at each budget
    of ``--shares``: today's chunk-by-chunk prefill against layer-major (layer_major.py), and stock
    mlx-lm with every expert resident. Then ``--decode-tokens`` tokens after the prompt, fed a
    fixed random token stream (the same for every run). Per run: GB read against the bytes of the
    experts the prompt routes to (what a cold prompt must read) and against the experts the budget
    cannot hold; prefill tok/s against the limit max(stock's time, bytes that must be read / disk
    bandwidth); time to first token against stock's; hidden states held between layers and MLX's
    peak memory; the decode hit rate after the prompt; whether each token after the prompt (the
    argmax of its log-probabilities) is stock's, and the first token's log-probabilities bit for
    bit. On a GPU stock runs twice: its own run-to-run. ``--hold-tokens``: one more layer-major prompt of
    that length at the first budget (held states bounded by ``CacheTuning.prefill_hold_bytes``).
    ``--rounds``: each budget's two prefills that many times, in alternating order (paired ratios).
    Writes ``<out>/<tag>.json`` (tag default ``prefill-<device kind>``)."""
    from dataclasses import replace

    import mlx.core as mx
    import numpy as np

    from mlx_lm_streaming import _bootstrap
    from mlx_lm_streaming.runtime.expert_cache import CacheTuning

    # what the installed startup hook does (a checkout on PYTHONPATH, as on the device, has none):
    # mlx-lm's modules patched, generate_step given layer-major prefill
    _bootstrap.install()
    import mlx_lm.generate  # noqa: F401

    generate = sys.modules["mlx_lm.generate"]
    stock_step = getattr(generate.generate_step, "stock", generate.generate_step)
    dtype = "bfloat16" if args.device_kind == "gpu" else "float32"
    name = (args.archs or ("tiny" if args.quick else "small")).split(",")[0]
    layers = args.layers if isinstance(args.layers, int) else None
    path = checkpoint(Path(args.ckpt_dir), name, dtype, layers=layers)
    files = shards(path)
    sizes = [int(n) for n in str(args.prefill_tokens or "4096,16384").split(",")]
    shares = [float(x) for x in args.shares.split(",")]
    step = args.prefill_step
    stock, config = load_stock(path)
    vocab = config.get("vocab_size") or config["text_config"]["vocab_size"]
    stream = [random.Random(7).randrange(vocab) for _ in range(args.decode_tokens + 4)]
    probe, _ = load_streaming(path, expert_cache_gb=1e6)
    total = probe.expert_streaming.cache.total_expert_bytes
    expert_nbytes = probe.expert_streaming.cache.banks[0].layer.expert_nbytes
    probe.expert_streaming.close()
    del probe
    os.sync()  # a checkpoint just built: dirty pages would stay in the page cache
    bw = probe_disk(files, expert_nbytes, min(256 * MB, sum(os.path.getsize(f) for f in files)))
    disk = max(v for v in bw.values() if v) * GB  # bytes/s
    log(f"disk GB/s: {bw}")
    spec = ARCHS[name]
    res = {
        "command": "python " + " ".join(sys.argv),
        "machine": machine(args.device_kind),
        "device_kind": args.device_kind,
        "shape": {"name": name, "label": spec["label"], "arch": spec["arch"], "dtype": dtype,
                  "layers": layers or spec["layers"], **spec["overrides"]},
        "expert_bytes": expert_nbytes, "total_expert_bytes": total, "prefill_step": step,
        "decode_tokens": args.decode_tokens, "disk_gbps": bw, "disk_bytes_per_s": disk,
        "runs": [],
    }  # fmt: skip

    def run(model, prompt, cold):
        """One prompt through mlx-lm's generate_step (ours wrapped where ``model`` streams), then
        the decode tokens: figures of the run."""
        state = getattr(model, "expert_streaming", None)
        if state is not None:
            state.cache.recorder = RoutedExperts()
        if cold:
            drop_page_cache(files)
        gc.collect()
        mx.synchronize()
        mx.reset_peak_memory()
        out = {"argmax": [], "first": None}
        fed = iter(stream)

        def sampler(logprobs):
            out["argmax"].append(mx.argmax(logprobs, axis=-1))
            return mx.array([next(fed)], dtype=mx.uint32)

        def progress(done, total):
            # every token but the last prefilled (the last one's step is stock's, with the
            # logits): what was read so far, against what those tokens must read
            if state is not None and done == total - 1 and "prompt_gb_read" not in out:
                out["prompt_gb_read"] = state.stats()["gb_read"]
                out["prompt_must_read_gb"] = state.cache.recorder.bytes() / 1e9

        step_fn = generate.generate_step if state is not None else stock_step
        start = time.perf_counter()
        for n, (_, logprobs) in enumerate(
            step_fn(prompt, model, max_tokens=args.decode_tokens + 1, sampler=sampler,
                    prefill_step_size=step, prompt_progress_callback=progress)
        ):  # fmt: skip
            if n == 0:
                mx.eval(logprobs)
                out["ttft_s"] = time.perf_counter() - start
                out["first"] = logprobs
                out["peak_prefill_gb"] = mx.get_peak_memory() / 1e9
                if state is not None:
                    s = state.stats()
                    out["gb_read"] = s["gb_read"]
                    out["must_read_gb"] = state.cache.recorder.bytes() / 1e9
                    h0, m0 = s["hits"], s["misses"]
        mx.synchronize()
        out["argmax"] = [int(t.item()) for t in out["argmax"]]
        if state is not None:
            s = state.stats()
            asked = s["hits"] - h0 + s["misses"] - m0
            out["decode_hit_rate"] = (s["hits"] - h0) / asked if asked else None
            out["held_gb"] = state.prefill.held_bytes / 1e9
            out["groups"] = state.prefill.groups
            out["layer_major_prompts"] = state.prefill.prompts
            out["fallbacks"] = state.prefill.fallbacks
            state.cache.recorder = None
        return out

    # a warm-up of every kind of run first (on CUDA the first prefill compiles its kernels: the
    # H200's first stock prefill of 4096 tokens took 178 s where the second took under 2)
    warm = mx.array([random.Random(i).randrange(vocab) for i in range(2 * step + 2)])
    run(stock, warm, cold=False)
    for mode in ("chunked", "layer_major"):
        tuning = replace(CacheTuning(), layer_major_prefill=mode == "layer_major")
        model, _ = load_streaming(path, expert_cache_gb=shares[0] * total / BUDGET_GB,
                                  tuning=tuning)  # fmt: skip
        run(model, warm, cold=True)
        model.expert_streaming.close()
        del model
    for tokens in sizes:
        prompt = mx.array([random.Random(i).randrange(vocab) for i in range(tokens)])
        ref = run(stock, prompt, cold=False)
        # stock's own run-to-run (on CUDA a long prompt's logits vary from run to run)
        again = run(stock, prompt, cold=False) if args.device_kind == "gpu" else None
        stock_s = ref["ttft_s"]
        base = {"tokens": tokens, "stock_ttft_s": stock_s}
        res["runs"].append({
            **base, "mode": "stock", "tokens_compared": len(ref["argmax"]), "ttft_s": stock_s, "prefill_tok_s": tokens / stock_s,
            "peak_prefill_gb": ref["peak_prefill_gb"],
        })  # fmt: skip
        if again is not None:
            res["runs"][-1].update({
                "stock_again_ttft_s": again["ttft_s"],
                "stock_run_to_run_same_tokens": again["argmax"] == ref["argmax"],
                "stock_run_to_run_tokens_equal": sum(
                    a == b for a, b in zip(again["argmax"], ref["argmax"])),
                "stock_run_to_run_same_first_logprobs": bool(
                    mx.array_equal(again["first"], ref["first"])),
            })  # fmt: skip
        log(json.dumps(res["runs"][-1]))
        for share in shares:
            budget = share * total
            modes = ("chunked", "layer_major")
            rounds = [modes if r % 2 == 0 else modes[::-1] for r in range(args.rounds or 1)]
            for r_index, mode in ((r, m) for r, order in enumerate(rounds) for m in order):
                tuning = replace(CacheTuning(), layer_major_prefill=mode == "layer_major")
                model, _ = load_streaming(path, expert_cache_gb=budget / BUDGET_GB, tuning=tuning)
                r = run(model, prompt, cold=True)
                model.expert_streaming.close()
                del model
                must = r["must_read_gb"] * 1e9
                limit = max(stock_s, must / disk)
                row = {
                    **base, "share": share, "mode": mode, "round": r_index,
                    "budget_gb": budget / 1e9,
                    "gb_read": r["gb_read"], "must_read_gb": must / 1e9,
                    "read_over_must_read": r["gb_read"] * 1e9 / must if must else None,
                    # the same for every token but the last (whose step, stock's, may read again
                    # an expert that the prompt's last wave evicted)
                    "prefix_read_over_must_read": (
                        r["prompt_gb_read"] / r["prompt_must_read_gb"]
                        if r.get("prompt_must_read_gb") else None
                    ),
                    "uncached_gb": (total - budget) / 1e9,
                    "read_over_uncached": r["gb_read"] * 1e9 / (total - budget),
                    "ttft_s": r["ttft_s"], "prefill_tok_s": tokens / r["ttft_s"],
                    "limit_s": limit, "of_limit": limit / r["ttft_s"],
                    "ttft_over_stock": r["ttft_s"] / stock_s,
                    "held_gb": r["held_gb"], "groups": r["groups"],
                    "peak_prefill_gb": r["peak_prefill_gb"],
                    "decode_hit_rate": r["decode_hit_rate"],
                    "layer_major_prompts": r["layer_major_prompts"], "fallbacks": r["fallbacks"],
                    "same_tokens_as_stock": r["argmax"] == ref["argmax"],
                    "tokens_equal_to_stock": sum(a == b for a, b in zip(r["argmax"], ref["argmax"])),
                    "tokens_compared": len(ref["argmax"]),
                    "same_first_logprobs_as_stock": bool(mx.array_equal(r["first"], ref["first"])),
                }  # fmt: skip
                res["runs"].append(row)
                log(json.dumps(row))
                gc.collect()
    if args.hold_tokens:
        tokens = args.hold_tokens
        prompt = mx.array([random.Random(i).randrange(vocab) for i in range(tokens)])
        model, _ = load_streaming(path, expert_cache_gb=shares[0] * total / BUDGET_GB,
                                  layer_major_prefill=True)  # fmt: skip
        limit = model.expert_streaming.cache.tuning.prefill_hold_bytes
        r = run(model, prompt, cold=True)
        model.expert_streaming.close()
        del model
        res["hold"] = {
            "tokens": tokens, "share": shares[0], "hold_limit_gb": limit / 1e9 if limit else None,
            "held_gb": r["held_gb"], "groups": r["groups"], "peak_prefill_gb": r["peak_prefill_gb"],
            "ttft_s": r["ttft_s"], "prefill_tok_s": tokens / r["ttft_s"],
            "gb_read": r["gb_read"], "must_read_gb": r["must_read_gb"],
        }  # fmt: skip
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
        f"chunks of {res['prefill_step']} tokens, cold; disk "
        f"{res['disk_bytes_per_s'] / 1e9:.2f} GB/s",
        "| tokens | budget | prefill | GB read | x must read (all but last token) | x uncached "
        "| tok/s | of limit "
        "| TTFT s | x stock TTFT | held GB | peak GB | decode hits | tokens = stock |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in res["runs"]:
        if r["mode"] == "stock":
            lines.append(
                f"| {r['tokens']} | all resident | stock | - | - | - | {r['prefill_tok_s']:.1f} | - "
                f"| {r['ttft_s']:.2f} | 1.00 | - | {r['peak_prefill_gb']:.2f} | - "
                + (f"| run to run: {r['stock_run_to_run_tokens_equal']}/{r['tokens_compared']} |"
                   if "stock_run_to_run_tokens_equal" in r else "| - |")
            )
            continue
        lines.append(
            f"| {r['tokens']} | {r['share']:.0%} | {r['mode'].replace('_', '-')} "
            f"| {r['gb_read']:.3f} | {r['read_over_must_read']:.2f} "
            f"({r['prefix_read_over_must_read'] or 0:.2f}) "
            f"| {r['read_over_uncached']:.2f} | {r['prefill_tok_s']:.1f} | {r['of_limit']:.2f} "
            f"| {r['ttft_s']:.2f} | {r['ttft_over_stock']:.2f} | {r['held_gb']:.3f} "
            f"| {r['peak_prefill_gb']:.2f} | {r['decode_hit_rate']:.3f} "
            f"| {r['tokens_equal_to_stock']}/{r['tokens_compared']}"
            f"{', first bits equal' if r['same_first_logprobs_as_stock'] else ''} |"
        )
    # paired: layer-major's prefill time against chunk by chunk's in the same round
    pairs = {}
    for r in res["runs"]:
        if r["mode"] != "stock":
            pairs.setdefault((r["tokens"], r["share"], r.get("round", 0)), {})[r["mode"]] = r
    by = {}
    for (tokens, share, _), p in pairs.items():
        if len(p) == 2:
            by.setdefault((tokens, share), []).append(
                p["chunked"]["ttft_s"] / p["layer_major"]["ttft_s"])
    for (tokens, share), ratios_ in sorted(by.items()):
        lines.append(
            f"\n{tokens} tokens, {share:.0%}: layer-major's speed over chunk by chunk's, per round: "
            + ", ".join(f"{x:.2f}" for x in ratios_)
        )
    h = res.get("hold")
    if h:
        lines.append(
            f"\n{h['tokens']} tokens, layer-major at {h['share']:.0%}: {h['held_gb']:.3f} GB of "
            f"hidden states held at most (bound {h['hold_limit_gb'] or 0:.2f} GB, {h['groups']} groups), "
            f"MLX peak {h['peak_prefill_gb']:.2f} GB, {h['prefill_tok_s']:.1f} tok/s, "
            f"{h['gb_read']:.3f} GB read ({h['must_read_gb']:.3f} must be read)"
        )
    return "\n".join(lines)


def main():
    import routing_replay

    routing_replay.unwind_on_rewind()  # verified steps that run a forward again
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="the tiny shape, fewer rounds (seconds)")
    ap.add_argument("--device-kind", choices=["cpu", "gpu"], default="cpu")
    ap.add_argument("--archs", default=None, help="comma-separated of " + ",".join(ARCHS))
    ap.add_argument(
        "--ckpt-dir",
        default=os.environ.get(
            "MLX_LM_STREAMING_BENCH_DIR", str(Path.home() / ".cache" / "mlx_lm_streaming_bench")
        ),
    )
    ap.add_argument("--out", default=str(ROOT / "docs" / "benchmarks"))
    ap.add_argument("--tag", default=None)
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--block", type=int, default=4, help="tokens per configuration per round")
    ap.add_argument("--prefill-reps", type=int, default=1)
    ap.add_argument(
        "--prefill-tokens",
        default=None,
        help=f"default {PREFILL_TOKENS} ({PREFILL_TOKENS // 4} with --quick: the CPU is slow); "
        "with --layer-major-prefill several, comma-separated (default 4096,16384)",
    )
    ap.add_argument(
        "--ablations",
        default=None,
        help="comma-separated: stock_again (a second stock model: the run's noise floor), "
        "cold_staged (cold with direct reads off; default)",
    )
    ap.add_argument("--no-rss", action="store_true")
    ap.add_argument(
        "--routing",
        type=routing_arg,
        default="uniform",
        help="uniform: random experts per token and layer, the same for every "
        "configuration (default; a random-weight model's own routing barely varies); "
        "model: the checkpoint's routers; trace:FILE: a routing trace's experts "
        "(bench/routing_replay.py), on checkpoints built with its MoE layer count, experts per "
        "layer and top-k (or folded onto the shape's: --trace-fold); several, comma-separated: "
        "each shape is run under each in turn",
    )
    ap.add_argument(
        "--layers",
        type=layers_arg,
        default=None,
        help="MoE layers of the checkpoints, N or per shape NAME=N,... (default: the shape's; "
        "with trace routing the trace's; fewer than the trace's replay its first ones)",
    )
    ap.add_argument(
        "--trace-fold",
        default="mixtral",
        help="comma-separated shapes whose expert count is not the trace's that replay the trace "
        "folded onto their own experts and top-k (routing_replay.fold_trace: id %% experts, the "
        "first top-k distinct ids) instead of being built with the trace's experts per layer "
        "(default mixtral: 128 of its experts would be 13 GB per layer); reported as folded",
    )
    ap.add_argument(
        "--direct-reads",
        choices=["auto", "on", "off"],
        default="auto",
        help="the direct_reads option for every streaming configuration (cold_staged: off)",
    )
    ap.add_argument(
        "--layer-major-prefill",
        action="store_true",
        help="only: today's chunked prefill against layer-major, cold, 25%% and 50%% budgets",
    )
    ap.add_argument("--prefill-step", type=int, default=2048, help="with --layer-major-prefill")
    ap.add_argument("--shares", default="0.25,0.5", help="with --layer-major-prefill: budgets")
    ap.add_argument("--decode-tokens", type=int, default=64, help="with --layer-major-prefill")
    ap.add_argument(
        "--hold-tokens", type=int, default=None,
        help="with --layer-major-prefill: one more layer-major prompt this long (held states)",
    )  # fmt: skip
    ap.add_argument("--render", default=None, help="rewrite the .md and .png of a results JSON")
    ap.add_argument("--rss-child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--rss-path", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--rss-prefill", type=int, default=PREFILL_TOKENS, help=argparse.SUPPRESS)
    ap.add_argument("--rss-decode", type=int, default=8, help=argparse.SUPPRESS)
    args = ap.parse_args()
    harness.DIRECT_READS = args.direct_reads
    if args.render:
        return print(render([Path(f) for f in args.render.split(",")], Path(args.out), args.tag))

    import mlx.core as mx

    if args.device_kind == "gpu":
        mx.set_default_device(mx.gpu)
    else:
        mx.set_default_device(mx.cpu)
    if args.rss_child:
        return rss_child(
            Path(args.rss_path),
            args.rss_child,
            args.rss_prefill,
            args.rss_decode,
            args.routing,
        )

    if args.layer_major_prefill:
        return layer_major_figures(args)
    archs = args.archs.split(",") if args.archs else (["tiny"] if args.quick else REAL_SHAPES)
    args.rounds = args.rounds or (3 if args.quick else 6)
    args.prefill_tokens = int(args.prefill_tokens) if args.prefill_tokens else (
        PREFILL_TOKENS // 4 if args.quick else PREFILL_TOKENS
    )
    args.ablations = [a for a in (args.ablations or "cold_staged").split(",") if a]
    dtype = "bfloat16" if args.device_kind == "gpu" else "float32"
    tag = args.tag or f"{args.device_kind}{'-quick' if args.quick else ''}"
    ckpt_dir = Path(args.ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)

    report = {
        "tag": tag,
        "device": args.device_kind,
        "command": " ".join(["python", "bench/experts.py"] + sys.argv[1:]),
        "when": time.strftime("%Y-%m-%d %H:%M"),
        "machine": machine(args.device_kind),
        "exact_check": "sha1 of every step's log-probabilities, compared with stock",
        "archs": [],
    }
    from mlx_lm_streaming.files.routing_trace import read_trace

    routings = args.routing.split(",")
    folded = {a for a in args.trace_fold.split(",") if a}
    runs = []
    for name in archs:
        shape = ARCHS[name]["overrides"]
        for routing in routings:
            run = argparse.Namespace(**vars(args))
            run.routing, run.fold = routing, None
            layers = args.layers.get(name) if isinstance(args.layers, dict) else args.layers
            experts = top_k = None
            if routing.startswith("trace:"):
                trace = read_trace(routing[len("trace:") :])
                layers = layers or trace.num_layers
                if shape["experts"] != trace.num_experts and name in folded:
                    run.fold = (shape["experts"], shape["top_k"])
                else:
                    experts, top_k = trace.num_experts, trace.top_k
            run.layers = layers
            runs.append((name, run, dict(layers=layers, top_k=top_k, experts=experts)))
    for name, run, shape in runs:
        path = checkpoint(ckpt_dir, name, dtype, **shape)
        res = run_arch(name, path, run, args.device_kind)
        if not args.no_rss:
            res["rss"] = measure_rss(path, run)
            cold = res["rss"].get("cold")
            if cold:
                net = cold["peak_rss"] - cold["rss_after_imports"]
                want = cold["resident_bytes"] + cold["budget"]
                res["ratios"]["rss_cold_over_budget"] = net / want - 1
        report["archs"].append(res)
        print(json.dumps({"arch": name, "ratios": res["ratios"]}, indent=1), flush=True)
        write(report, Path(args.out), tag)  # after each architecture: a cut-short run keeps some
    print(markdown(report))


if __name__ == "__main__":
    main()
