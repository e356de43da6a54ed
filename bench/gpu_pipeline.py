"""Decode in three regimes (hit, ram, cold) against stock or the disk's limit, stock beside.

How fast does the streaming model decode when every expert it uses is resident (hit), when its
misses are copies from the page cache (ram) and when they come from the disk (cold), against stock
on the same checkpoint, every step compared with stock's bit for bit? The H200 run (16 MoE layers,
bf16, the Qwen3-30B-A3B expert shape; or ``BENCH=pipeline bash bench/gpu.sh <the same arguments>``):

    python3 bench/gpu_pipeline.py --ckpt-dir /root/ckpt --out $OUT --layers 16 \
        --regimes hit,ram,cold \
        --routings uniform,trace:tests/data/routing/qwen3-30b-a3b.jsonl \
        --variants default,default_tl --rounds 4

A trained checkpoint's own router: ``--routings model:DIR``. ``--placed``: stock with each layer's
most used experts placed on the device by ``cudaMemAdvise`` alone, the placement's limit, beside
(``stock_placed``; every row's ``of_placed``). A variant is "_"-joined words:
``default``, ``tl`` (records a timeline) and the words ``--tuning-variant NAME:field=value,...``
defines (``CacheTuning`` fields: ``--tuning-variant nocopy:device_copies=false --variants
default,nocopy``). On the CPU, everything at tiny size in ~10 s:
``python3 bench/gpu_pipeline.py --quick --regimes hit,ram,cold --out /tmp/q``.

Writes ``<out>/<tag>.json`` (after every group) and ``<out>/<tag>.md`` (a table per regime). What
the regimes, ratios, limits and columns are: docs/benchmarks/methods.md (gpu_pipeline.py).
"""

import argparse
import dataclasses
import gc
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

import harness
import routing_replay
from harness import GB, MB, ROOT, Config, decode_block, log


def trace_top_k(shape):
    """The top-k of a ``harness.ARCHS`` shape's checkpoint: those of 128 experts at 6, the routing
    traces' (a trace routes only a checkpoint of its own expert count); None: the shape's own."""
    return 6 if harness.ARCHS[shape]["overrides"]["experts"] == 128 else None


def default_routings(shape):
    """uniform, and where the shape's experts can replay it its family's trace (gemma-4's for the
    gemma4 shapes, Qwen3-30B-A3B's for the other 128-expert ones)."""
    trace = "gemma-4-26b-a4b" if shape.startswith("gemma4") else "qwen3-30b-a3b"
    traced = [f"trace:{ROOT}/tests/data/routing/{trace}.jsonl"] if trace_top_k(shape) else []
    return ["uniform", *traced]

# -- variants -------------------------------------------------------------------------------------

# Words defined on the command line (``--tuning-variant NAME:field=value,...``): NAME sets those
# ``CacheTuning`` fields, alone or "_"-joined with other words ("nolk_tl").
TUNING_VARIANTS = {}


def _tuning_value(text: str):
    """A field's value: "8" -> 8, "0.5" -> 0.5, "false" ("off", "no") -> False, "true" ("on",
    "yes") -> True, "none" -> None; anything else stays text."""
    text = text.strip()
    words = {"on": "true", "yes": "true", "off": "false", "no": "false", "none": "null"}
    try:
        return json.loads(words.get(text.lower(), text.lower()))
    except ValueError:
        return text


def tuning_variant(spec: str):
    """``NAME:field=value,...`` -> ``(NAME, {field: value})``, checked before anything is built."""
    from mlx_lm_streaming.runtime.memory.expert_cache import CacheTuning

    known = {f.name for f in dataclasses.fields(CacheTuning)} | {"direct", "pack", "direct_reads"}
    name, _, body = spec.partition(":")
    name = name.strip()
    items = [item.partition("=") for item in body.split(",") if item.strip()]
    fields = {field.strip(): _tuning_value(value) for field, _, value in items}
    well_formed = items and all(eq for _, eq, _ in items) and set(fields) <= known
    if not (well_formed and name.isidentifier() and "_" not in name):
        raise SystemExit(
            f"--tuning-variant {spec!r}: use NAME:field=value,... (NAME a word without '_', "
            f"each field one of CacheTuning's: {', '.join(sorted(known))})"
        )
    return name, fields


def variant_tuning(name: str):
    """``(records a timeline, CacheTuning or None, load options)`` of a variant: "_"-joined words,
    "default", "tl", ``TUNING_VARIANTS``' (``direct``: the store's; ``pack``, ``direct_reads``: load's)."""
    from mlx_lm_streaming.runtime.memory.expert_cache import CacheTuning

    timeline, tuning = False, {}
    for word in name.split("_"):
        if word in TUNING_VARIANTS:
            tuning.update(TUNING_VARIANTS[word])
        elif word == "tl":
            timeline = True
        elif word != "default":
            known = ", ".join(["default", "tl", *TUNING_VARIANTS])
            raise SystemExit(f"variant {name!r}: unknown word {word!r} (known: {known})")
    load = dict(store_options={"direct": tuning.pop("direct")} if "direct" in tuning else {})
    load.update({k: tuning.pop(k) for k in ("pack", "direct_reads") if k in tuning})  # (load's)
    return timeline, CacheTuning(**tuning) if tuning else None, load


# -- the placement's limit (issue 49): stock, its experts placed by cudaMemAdvise alone -----------


def count_uses(model, places) -> None:
    """Each expert module of ``places`` keeps the ids of its calls (``_kept``): the uses
    ``place_hottest`` places by (the routed ids, where a routing wraps it); ``model._counted``."""
    object.__setattr__(model, "_counted", places)
    for _, _, module in places:
        base = type(module)

        def call(self, x, indices, base=base):
            self._kept.append(indices)
            return base.__call__(self, x, indices)

        object.__setattr__(module, "_kept", [])
        module.__class__ = type(base.__name__, (base,), {"__call__": call})


def place_hottest(places, budget, placer) -> float:
    """Stock's experts placed by ``placer`` (``cuda_placer.CudaPlacer``: advice and prefetch) and
    no package code in the decode: each layer's ``budget`` share most used in the calls kept since
    the last placement preferred on the device, the rest on the host. The share of those uses the
    device experts had."""
    import numpy as np
    from mlx.utils import tree_flatten

    from mlx_lm_streaming.runtime.reads.host_views import host_address

    on = used = 0
    for _, _, module in places:
        arrays = [a for _, a in tree_flatten(module.parameters())]  # each (experts, ...)
        experts = arrays[0].shape[0]
        ids = np.concatenate([np.array(i).reshape(-1) for i in module._kept]).astype(np.int64)
        module._kept.clear()
        counts = np.bincount(ids, minlength=experts)
        hot = np.zeros(experts, dtype=bool)
        hot[np.argsort(-counts, kind="stable")[: int(budget * experts)]] = True
        on, used = on + counts[hot].sum(), used + counts.sum()
        per = [(host_address(a), a.nbytes // experts) for a in arrays]
        for flag in (False, True):  # out of the device first
            chosen = np.flatnonzero(hot == flag)
            placer.place([(at + int(e) * n, n) for at, n in per for e in chosen], on_device=flag)
    placer.wait()
    return float(on / used) if used else None


def limit_placer(quick: bool):
    """``cuda_placer``'s placer on mlx-cuda; off it with ``--quick`` one that places nothing (the
    script's logic, no figure); else a one-line exit."""
    from mlx_lm_streaming.runtime.memory.cuda_placer import cuda_placer

    placer = cuda_placer()
    if placer is None and not quick:
        raise SystemExit("--placed: stock placed by cudaMemAdvise needs mlx-cuda (--quick: a try)")
    return placer or type("NoPlacer", (), {"place": lambda *a, **k: None, "wait": lambda _: None})()


# -- one group: a regime x routing x budget -------------------------------------------------------

# regime -> (the page cache dropped before every token, a pass over the measured steps before the
# rounds: "replay" replays the same routing after it (every expert the rounds use is resident
# where the budget holds them), "fill" goes on after it (the cache in its steady state))
REGIMES = {"hit": dict(cold=False, warm_pass="replay"), "ram": dict(cold=False, warm_pass="fill"),
           "cold": dict(cold=True, warm_pass=None)}


def warm_page_cache(files) -> float:
    """Read ``files`` once, whole, so later reads of them are copies from RAM; returns seconds."""
    start = time.perf_counter()
    view = memoryview(bytearray(16 << 20))
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while fh.readinto(view):
                pass
    return time.perf_counter() - start


def user_seconds(model, tokenizer, prompt, tokens):
    """Stock as a user sees it: ``tokens`` tokens of ``mlx_lm.stream_generate`` (greedy, own
    router, new KV cache) timed first token to last (mlx-lm's generation_tps: n / (n - 1) higher);
    ``(seconds per token, tokens, generation_tps)``."""
    from mlx_lm import stream_generate

    stamps, last = [], None
    for last in stream_generate(model, tokenizer, prompt, max_tokens=tokens):
        stamps.append(time.perf_counter())
    n = len(stamps)
    if n < 3:
        return None, n, None
    return (stamps[-1] - stamps[0]) / (n - 1), n, last.generation_tps


def run_group(stocks, path, spec, budget, regime, args, ck, files, prompt, stream):
    """One group: variants and stocks in interleaved rounds, stock as a user sees it in each."""
    import mlx.core as mx
    from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache
    from mlx_lm.utils import load_tokenizer

    mode = REGIMES[regime]
    configs = {name: Config(name, model) for name, model in stocks.items()}
    kind, _, where = spec.partition(":")
    group = f"{regime}-{kind}{'-' + Path(where).stem if where else ''}-{int(round(budget * 100))}"
    timelines = {v: Path(args.out) / f"{args.tag}-{group}-{v}.trace.json" for v in args.variants}
    gb = budget * ck["total_expert_bytes"] / harness.BUDGET_GB
    host = {} if args.expert_host_gb is None else dict(expert_host_gb=args.expert_host_gb)
    for v in args.variants:
        timelines[v].unlink(missing_ok=True)
        traced, tuning, load = variant_tuning(v)
        trace = str(timelines[v]) if traced else None
        model, _ = harness.load_streaming(path, expert_cache_gb=gb, trace=trace, tuning=tuning,
                                          **load, **host)
        configs[v] = Config(v, model, cold=mode["cold"], files=files)
    for cfg in configs.values():
        own = cfg.name == "stock_own"  # the router's own ids: what the injection costs
        cfg.routing = None if own else harness.make_routing(spec, ck["experts"], ck["moe_layers"])
        if cfg.routing is not None:  # (None: model:DIR, its own router)
            # a streaming model reads its ids on the host: tied to the router, as a trained model's
            routing_replay.wrap(cfg.model, cfg.routing, depends=cfg.cache is not None)
    warm_s = 0.0 if mode["cold"] else warm_page_cache(files)

    def rewind(cfg, pos):  # the KV cache and token stream back to ``pos`` where it can trim
        if can_trim_prompt_cache(cfg.kv):
            trim_prompt_cache(cfg.kv, cfg.pos - pos)
            cfg.pos = pos
            return True
        return False

    def start(cfg):  # the prompt one token at a time, into a new KV cache
        cfg.kv = make_prompt_cache(cfg.model)
        for tok in prompt:
            mx.eval(cfg.model(mx.array([[tok]]), cache=cfg.kv))
        cfg.stream, cfg.pos = stream, 1
        decode_block(cfg, args.warmup)  # warm-up: allocations, kernels, a tier's counts
        rewind(cfg, 1)  # (not the routing: a long warm-up keeps stock's KV under 256 entries)

    for cfg in configs.values():
        if cfg.routing is not None:
            cfg.routing.reset()
        if cfg.cache is not None:
            harness.reset_banks(cfg.model)
        start(cfg)
        if mode["warm_pass"]:
            # the rounds' steps once, untimed: "replay" then rewinds the routing, so the rounds
            # ask for exactly the experts this pass made resident (the model's own router: the
            # same tokens at the same positions). KV cache and token stream rewound in both: stock
            # on mlx-cuda differs from itself past 256 KV entries (seen on the H200, issue 36).
            routing = cfg.routing
            cursor = dict(routing.cursor) if routing is not None else None
            pos = cfg.pos
            for _ in range(args.rounds):
                decode_block(cfg, args.block)
            if not rewind(cfg, pos):
                start(cfg)
            if mode["warm_pass"] == "replay" and routing is not None:
                routing.cursor = cursor
        if cfg.name == "stock_placed":  # placed by the uses so far (the warm pass's, where one)
            placed = place_hottest(cfg.model._counted, budget, args.placer)
        cfg.tokens, cfg.decode_s = [], []
        cursor = getattr(cfg.routing, "cursor", None)  # (where ``--profile`` rewinds to)
        cfg.start = (dict(cursor) if cursor is not None else None, cfg.pos)
        cfg.stats0 = cfg.counters()
        log(f"[{regime} {spec} {budget}] {cfg.name} warmed")  # (how far a run cut short got)
    # stock as a user sees it: the own-router stock (model:DIR: stock) through stream_generate,
    # warmed like the others, then timed once a round among them
    user_model = configs["stock_own" if "stock_own" in configs else "stock"].model
    tokenizer = load_tokenizer(Path(path))
    user_seconds(user_model, tokenizer, prompt, args.warmup + 2)
    user = dict(tokens=[], tps=[])
    if not mode["cold"]:
        warm_s += warm_page_cache(files)
    rounds, users = [], ["stock_user"]
    if args.user_streaming and "default" in configs and not mode["cold"]:
        users.append("default_user")  # (the default through stream_generate too)
    for r in range(args.rounds):
        row = {}
        for key in random.Random(r).sample([*configs, *users], len(configs) + len(users)):
            if key in users:
                cfg = configs["default"] if key == "default_user" else None
                cursor = dict(cfg.routing.cursor) if cfg and cfg.routing else None
                if cursor is not None:  # the rounds' rows (a hit regime's: resident), then back
                    cfg.routing.cursor = dict(cfg.start[0])
                seconds, n, tps = user_seconds(cfg.model if cfg else user_model, tokenizer,
                                               prompt, args.user_tokens)  # fmt: skip
                if cursor is not None:
                    cfg.routing.cursor = cursor
                if key == "stock_user":
                    user["tokens"].append(n)
                    user["tps"].append(tps)
                if seconds is not None:
                    row[key] = seconds
                continue
            times = decode_block(configs[key], args.block)
            configs[key].decode_s.extend(times)
            row[key] = sum(times) / len(times)
        rounds.append(row)
        speeds = ", ".join(f"{k} {1 / v:.2f}" for k, v in row.items())
        log(f"[{regime} {spec} {budget}] round {r}: {speeds}")
    out = {"regime": regime, "rounds": rounds, "configs": {}, "page_cache_warm_s": warm_s}
    out["stock_basis"] = basis = stock_basis(configs, rounds, user)
    for key, cfg in configs.items():
        entry = config_figures(cfg, configs["stock"], rounds, regime, ck, basis["used"])
        if regime == "hit" and entry.get("hit_rate", 1.0) != 1.0:
            slots = f"{min(entry['slots'])}-{max(entry['slots'])}"
            warning = (f"WARNING: regime hit, {spec} {budget}, {key}: measured hit rate "
                       f"{entry['hit_rate']} (not 1.0; slots {slots} per layer)")
            log(warning)
            out.setdefault("warnings", []).append(warning)
        if cfg.cache is not None and cfg.cache.timeline:
            timeline_figures(entry, cfg, timelines[key])
        out["configs"][key] = entry
    profiles = step_profiles(configs, args.profile, args.profile_blocks) if args.profile else {}
    for key, p in profiles.items():  # (their steps in no figure above)
        out["configs"][key]["step_profile"] = p
        log(f"[{regime} {spec} {budget}] {key} profile: {json.dumps(p)}")
    out["stock_vs_stock"] = out["configs"]["stock_again"]["ratio_to_harness_stock"]
    out["stock_differs_at"] = exact_to_stocks_own(out["configs"])
    if "stock_placed" in configs:  # every row against the placement's limit too
        for key, entry in out["configs"].items():
            entry["of_placed"] = statistics.median(r["stock_placed"] / r[key] for r in rounds)
        out["configs"]["stock_placed"]["placed_device_share"] = placed
    both = [r["stock_user"] / r["default_user"] for r in rounds if len({*users} & {*r}) == 2]
    if both:  # the default as a user sees it, against stock so
        out["default_user_of_stock_user"] = statistics.median(both)
    if "stock_own" in out["configs"]:
        c = out["configs"]
        out["injection_cost"] = 1 - c["stock"]["tok_s"] / c["stock_own"]["tok_s"]
    log(f"[{regime} {spec} {budget}] {basis_line(out)}")
    return out


AGREE = 0.05  # the harness's stock stands for stock as a user sees it within this


def stock_basis(configs, rounds, user):
    """Which stock the ratios divide by: the harness's (``stock``: forced ids and token stream,
    ``decode_block``) where its tok/s is within ``AGREE`` of stock as a user sees it
    (``stock_user``), else ``stock_user``, and why."""
    harness_tok_s = len(configs["stock"].decode_s) / sum(configs["stock"].decode_s)
    user_s = [r["stock_user"] for r in rounds if "stock_user" in r]
    out = dict(harness_tok_s=harness_tok_s, user_tokens=user["tokens"], user_tps=user["tps"])
    if not user_s:
        return dict(out, used="stock", user_tok_s=None,
                    why="stream_generate stopped before 3 tokens (an end-of-sequence token)")
    out["user_tok_s"] = user_tok_s = len(user_s) / sum(user_s)
    out["user_tok_s_rounds"] = [1 / s for s in user_s]
    out["harness_off"] = off = harness_tok_s / user_tok_s - 1
    if abs(off) <= AGREE:
        return dict(out, used="stock", why=f"the harness's stock is {off:+.1%} off stock as a "
                    f"user sees it (within {AGREE:.0%})")
    return dict(out, used="stock_user", why=f"the harness's stock ({harness_tok_s:.1f} tok/s) is "
                f"{off:+.1%} off stock as a user sees it ({user_tok_s:.1f}): beyond {AGREE:.0%}")


def basis_line(g) -> str:
    b = g["stock_basis"]
    user = "-" if b["user_tok_s"] is None else f"{b['user_tok_s']:.1f}"
    own = g["configs"].get("stock_own")
    line = f"stock tok/s: harness {b['harness_tok_s']:.1f}"
    if own:
        line += (f", own router {own['tok_s']:.1f} (the injected ids cost "
                 f"{g['injection_cost']:+.1%})")
    if "default_user_of_stock_user" in g:
        user += f" (the default so: {g['default_user_of_stock_user']:.3f} of it)"
    return (line + f"; as a user sees it (stream_generate) {user}; stock/stock "
            f"{g['stock_vs_stock']:.3f}; ratios against {b['used']}: {b['why']}")


def exact_to_stocks_own(entries) -> Optional[int]:
    """The first step where ``stock_again`` is not stock's (stock's own run-to-run: mlx-cuda's
    cuDNN attention past 256 KV entries, methods.md), or None; where there is one, each compared
    entry of ``entries`` is ``exact`` if it is stock's at every step before it."""
    again = entries["stock_again"]["same_as_stock"]
    differs = again.index(False) if False in again else None
    for entry in entries.values() if differs is not None else ():
        if entry["exact"] is not None:
            entry["exact"] = all(entry["same_as_stock"][:differs])
    return differs


def config_figures(cfg, stock, rounds, regime, ck, basis="stock"):
    """One configuration's figures over the rounds, against ``basis`` (``stock_basis``'s) and the
    limit; bit for bit against ``stock`` (the first stock model). Its headline ``ratio``: to stock
    for hit and ram, to the limit for cold (stock configurations: to stock); ram rows get the ram
    limit where the checkpoint has a ram probe."""
    n = len(cfg.decode_s)
    c = harness.delta(cfg.stats0, cfg.counters())
    ref = stock.tokens
    same = [a == b for a, b in zip(cfg.tokens, ref)]
    # (the own-router stock computes other experts: not compared)
    own = cfg.name == "stock_own"
    timed = [r for r in rounds if basis in r]
    entry = dict(
        tokens=n, tok_s=n / sum(cfg.decode_s), s_per_token=sum(cfg.decode_s) / n,
        same_as_stock=None if own else same, exact_steps=None if own else sum(same),
        total_steps=len(ref), exact=None if own else len(cfg.tokens) == len(ref) and all(same),
        call_s_per_token=c["call_seconds"] / n,
        ratio_to_stock=statistics.median(r[basis] / r[cfg.name] for r in timed),
        ratio_to_harness_stock=statistics.median(r["stock"] / r[cfg.name] for r in rounds),
    )
    entry["ratio"] = entry["ratio_to_stock"]
    if cfg.cache is None:
        return entry
    asked = c["hits"] + c["misses"]
    named = c.get("verified_named")
    banks = cfg.cache.banks
    entry.update(
        hit_rate=c["hits"] / asked if asked else None, misses_per_token=c["misses"] / n,
        bytes_per_token=c["bytes_read"] / n, io_wait_s_per_token=c["io_wait_seconds"] / n,
        uncached_share=c["uncached_bytes"] / c["bytes_read"] if c["bytes_read"] else None,
        install_s_per_token=c["install_seconds"] / n,
        # the disk busy for the misses (at least one demand read in flight) and the GB/s then
        busy_s_per_token=c["miss_read_busy_seconds"] / n,
        gbps_while_busy=(c["bytes_read"] / GB / c["miss_read_busy_seconds"]
                         if c["miss_read_busy_seconds"] else None),
        store_s_per_token=c["store_read_seconds"] / n, store_reads_per_token=c["store_reads"] / n,
        slots=[b.slots for b in banks], direct=all(b.direct for b in banks),
        policy=getattr(cfg.cache, "policy", None),
        prefetch=harness.precision_recall(c.get("prefetch")),
        verified_share=c.get("verified_steps", 0) / n,  # (verified steps' share, replays, named)
        replays_per_token=c.get("verified_replays", 0) / n, named_per_token=(named or 0) / n,
        named_used=c["verified_named_used"] / named if named else None,
        late_share=c.get("checked_late", 0) / n, dropped_per_token=c["checked_late_dropped"] / n,
        in_pass_per_token=c.get("verified_read_in_pass", 0) / n,  # (``reads_in_pass``, and
        first_per_token=c.get("verified_first_call_reads", 0) / n,  # ``first_call_reads``)
        **{k: v for k, v in cfg.cache.summary().items() if k.startswith(("tier", "host_", "comp"))},
    )
    if c.get("tier_uses"):  # (the summary's tier figures count from the load; these the rounds)
        entry.update(timed_device_share=c["tier_on"] / c["tier_uses"],
                     timed_moves_per_token=c["tier_moved"] / n)
    # the limit: 1 / max(stock's step, the missed experts' bytes / the disk's best GB/s), per round
    need = entry["needed_bytes_per_token"] = entry["misses_per_token"] * ck["expert_bytes"]
    entry["read_over_needed"] = entry["bytes_per_token"] / need if need else None
    stock_s = statistics.mean(r[basis] for r in timed)
    read_s = need / (ck["disk_best_gbps"] * GB)
    limit_s = max(stock_s, read_s)
    entry.update(
        limit_tok_s=1 / limit_s, ratio_to_limit=entry["tok_s"] * limit_s,
        ratio_to_limit_median=statistics.median(max(r[basis], read_s) / r[cfg.name] for r in timed),
    )
    if regime == "cold":
        entry["ratio"] = entry["ratio_to_limit_median"]
    if regime == "ram" and ck.get("ram_probe"):
        ram_limit(entry, stock_s, ck)
    return entry


def ram_limit(c, stock_s, ck) -> None:
    """``c["ram_limit"]``: 1 / (stock's step + missed bytes per token / the ram probe's parallel
    reads into slots, at the probed K nearest this row's misses per layer call), and this row's
    tok/s as a fraction of it."""
    probe = ck["ram_probe"]
    per_call = c["misses_per_token"] / ck["moe_layers"]
    figures = {k: gbps for k in probe["k"] if (gbps := probe["gbps"].get(f"slots k{k}"))}
    if not figures:
        return
    k = min(figures, key=lambda k: (abs(k - per_call), k))
    missed = c["misses_per_token"] * ck["expert_bytes"]
    limit_s = stock_s + missed / (figures[k] * 1e9)
    c["ram_limit"] = dict(
        tok_s=1 / limit_s, of_limit=c["tok_s"] * limit_s, k=k, gbps=figures[k],
        missed_bytes_per_token=missed, misses_per_layer_call=per_call,
    )


def timeline_figures(entry, cfg, path) -> None:
    """The timeline's per-layer split of a token's time (bench/timeline_summary.py)."""
    from timeline_summary import summarize as timeline_summary

    # closed, not flushed: the last decode step's span is written when the step ends
    cfg.cache.timeline.close()
    entry["timeline"] = timeline_summary(path, last=entry["tokens"])
    entry["timeline_file"] = path.name
    per_token = entry["timeline"].get("split", {}).get("ms per token")
    if per_token:
        # the timeline's step runs from the first MoE layer call to the last: the rest of the
        # token's measured time (embedding, first attention, head, sampling, mlx-lm)
        token_ms = entry["s_per_token"] * 1e3
        per_token["outside"] = round(token_ms - entry["timeline"]["step ms"], 4)
        per_token["token"] = round(token_ms, 4)


# the text a model:DIR routing decodes (its tokens by that checkpoint's tokenizer): the prompt,
# then the stream fed in place of sampling, the same for every configuration
TEXT = (
    "Return a new list of the items of the sequence, sorted by the key function. The sort is "
    "stable: items that compare equal keep their order. If the key is None, the items are "
    "compared directly. This function is used by the module to read the configuration file, "
    "which is a list of sections, each a list of name and value pairs. Raise ValueError if the "
    "file cannot be parsed, and OSError if it cannot be opened. The default is to read the file "
    "in text mode with the locale's encoding; pass encoding to read it otherwise. Each section "
    "name is a string; each value is a string, an integer or a boolean, converted by the "
    "functions given in the converters argument. A missing option falls back to the value in the "
    "default section, and then to the fallback argument if it was given. Write the configuration "
    "to the file object, which must be opened in text mode. The class keeps a dictionary of the "
    "sections and returns a proxy for each, so that the options of a section can be read and set "
    "like the items of a mapping. Return True if the given section exists and contains the given "
    "option, False otherwise. If the section is None or empty, the default section is checked."
)


def text_tokens(path, prompt_len: int):
    """``(prompt, stream)``: ``TEXT`` encoded by the checkpoint's tokenizer, split after
    ``prompt_len`` tokens."""
    from mlx_lm.utils import load_tokenizer

    tokens = load_tokenizer(Path(path)).encode(TEXT)
    if len(tokens) <= prompt_len + 1:
        raise SystemExit(f"{path}: the text is {len(tokens)} tokens, not more than --prompt")
    return tokens[:prompt_len], tokens[prompt_len:]


# -- where a decode step's time goes (``--profile N``) ---------------------------------------------


def step_profiles(configs, n, blocks):
    """After the rounds, ``blocks`` passes over ``configs`` (in turn, every other pass reversed),
    each of ``n`` steps from the rounds' start (the same ids: a hit regime's hits): host ms per
    step building the graph (the model's call; ``call_ms``: the median call but the first, which
    checks in itself), launching it (``mx.async_eval``), checking it (``StepRunner.check``), the
    step, the decode thread's CPU (near the step's where the host bounds it); medians of the
    passes, and of each pass's difference from stock's (``minus_stock``: the host's speed moves
    between passes, less within one); then, where torch is installed, its CUPTI trace of the
    device: kernels per step, their busy ms (docs/benchmarks/methods.md)."""
    import mlx.core as mx

    def timed_block(cfg):
        back_to_start(cfg)
        spent, calls = dict(build=0.0, launch=0.0, check=0.0), []

        def timed(key, f):
            def run(*a, **k):
                start = time.perf_counter()
                try:
                    return f(*a, **k)
                finally:
                    took = time.perf_counter() - start
                    spent[key] += took
                    if key == "build":
                        calls.append(took)
            return run

        cls, launch = type(cfg.model), mx.async_eval
        call, runner = cls.__call__, getattr(cfg.model, "expert_streaming", None)
        runner = getattr(runner, "steps", None)
        cls.__call__, mx.async_eval = timed("build", call), timed("launch", launch)
        if runner is not None:
            runner.check = timed("check", runner.check)
        try:
            start, cpu = time.perf_counter(), time.thread_time()  # (this thread's CPU)
            decode_block(cfg, n)
            spent["step"], spent["step_cpu"] = time.perf_counter() - start, time.thread_time() - cpu
        finally:
            cls.__call__, mx.async_eval = call, launch
            if runner is not None:
                del runner.check
        out = {f"{k}_ms": 1e3 * v / (n + 1) for k, v in spent.items()}
        return dict(out, call_ms=1e3 * statistics.median(calls[1:] or calls))

    blocks_of = {name: [] for name in configs}
    for b in range(blocks):  # (in turn, every other pass the other way round)
        for name in list(configs)[:: 1 if b % 2 == 0 else -1]:
            blocks_of[name].append(timed_block(configs[name]))
    res, stock = {}, blocks_of["stock"]
    for name, mine in blocks_of.items():
        out = {k: round(statistics.median(m[k] for m in mine), 3) for k in mine[0]}
        less = {k: statistics.median(m[k] - s[k] for m, s in zip(mine, stock)) for k in mine[0]}
        out["minus_stock"] = {k: round(v, 3) for k, v in less.items()}
        res[name] = dict(out, **device_trace(configs[name], n))
    return res


def back_to_start(cfg) -> None:
    """``cfg``'s KV cache trimmed and its routing's cursor put back to where its rounds began."""
    from mlx_lm.models.cache import trim_prompt_cache

    cursor, pos = cfg.start
    trim_prompt_cache(cfg.kv, cfg.pos - pos)
    cfg.pos = pos
    if cursor is not None:
        cfg.routing.cursor = dict(cursor)


def device_trace(cfg, n) -> dict:
    """Kernels per step and their busy ms over ``n`` steps from the rounds' start, under torch's
    CUPTI profiler ({} where torch is not installed)."""
    try:
        from torch.profiler import ProfilerActivity, profile
    except ImportError:
        return {}
    back_to_start(cfg)
    try:  # (a profiler that cannot trace this device says so in the entry)
        with profile(activities=[ProfilerActivity.CUDA]) as trace:
            decode_block(cfg, n)
        kernels = [e for e in trace.events() if str(e.device_type).endswith("CUDA")]
    except Exception as e:  # noqa: BLE001 (torch's errors are many)
        return dict(kernels_error=repr(e))
    busy = sum(e.time_range.elapsed_us() for e in kernels) / 1e3
    return dict(kernels=round(len(kernels) / (n + 1), 1), kernel_ms=round(busy / (n + 1), 3))


# -- a checkpoint: its figures, probes and stock models -------------------------------------------


def open_checkpoint(path, args, first_routing):
    """``(figures, shard files, stock models)`` of one checkpoint: its expert bytes, layers and
    experts, the disk and ram probes, and the stocks (routed through ``first_routing``)."""
    from mlx_lm_streaming.tools.parity import vocab_size

    files = harness.shards(path) + sorted(Path(path).glob("experts.pack"))  # (dropped when cold)
    ck = dict(path=str(path), **harness.expert_sizes(path))
    gc.collect()  # the probe's model
    bw = harness.probe_disk(files, ck["expert_bytes"], args.probe_mb * MB, args.probe_threads)
    ck.update(disk_gbps=bw, disk_best_gbps=max(v for v in bw.values() if v))
    log(f"{path}: disk GB/s: {bw}")
    if "ram" in args.regimes and args.ram_probe_mb > 0:
        ck["ram_probe"] = ram_probe(path, files, ck, args)
        gc.collect()  # the probe's model
        log(f"{path}: ram probe GB/s: {ck['ram_probe']['gbps']}")
    stocks = {}
    own = () if first_routing.startswith("model:") else ("stock_own",)
    placed = ("stock_placed",) if args.placed else ()
    for name in ("stock", "stock_again") + own + placed:
        model, config = harness.load_stock(path)
        places = routing_replay.expert_modules(model)
        routing = harness.make_routing(first_routing, ck["experts"], ck["moe_layers"])
        if routing is not None and name != "stock_own":
            routing_replay.wrap(model, routing)
        if name == "stock_placed":
            count_uses(model, places)
        stocks[name] = model
    ck["vocab"] = vocab_size(config)
    return ck, files, stocks


RAM_PROBE_REPS = 100  # a forward each: small experts must not make the probe long


def ram_probe(path, files, ck, args):
    """GB/s (decimal) of the ram regime's read path into one layer's bank slots, page cache warm,
    one expert alone and K in parallel (docs/benchmarks/methods.md (gpu_pipeline.py))."""
    import mlx.core as mx

    from mlx_lm_streaming.runtime.memory.expert_cache import CacheTuning
    from mlx_lm_streaming.runtime.reads import bank_reads

    start_s = time.perf_counter()
    gb = args.ram_budget[0] * ck["total_expert_bytes"] / harness.BUDGET_GB
    model, _ = harness.load_streaming(path, expert_cache_gb=gb, tuning=CacheTuning(lookahead=False))
    cache = model.expert_streaming.cache
    cache.ensure_planned()
    bank = cache.banks[0]
    parts, nbytes = bank.layer.parts, bank.layer.expert_nbytes
    members = list(range(len(parts)))
    pool = cache.demand_pool
    token = mx.array([[1]])
    warm_page_cache(files)
    mx.eval(model(token))  # the banks filled as far as one token fills them

    def figure(k, spread):
        reps = min(RAM_PROBE_REPS, max(2, args.ram_probe_mb * 1_000_000 // (k * nbytes)))
        read = bank_reads.slot_reader(bank, spread=spread)
        slots = list(range(k))
        idx = mx.array(slots)
        seconds = 0.0
        for rep in range(reps):
            experts = [(rep * k + j) % bank.num_experts for j in range(k)]
            mx.eval(model(token))
            mx.eval([bank.array(p.proj, p.part)[idx] for p in parts])
            with bank.lock:
                t = time.perf_counter()
                for job in [pool.submit(read, e, s, members) for e, s in zip(experts, slots)]:
                    job.result()
                # the device's next read of the slots (managed pages come back)
                mx.eval([bank.array(p.proj, p.part)[idx].sum() for p in parts])
                seconds += time.perf_counter() - t
        return reps * k * nbytes / seconds / 1e9

    ks = [k for k in sorted(set(args.ram_probe_k)) if k <= bank.slots]
    gbps = {}
    if bank.views is not None:  # (none where direct reads are off: no figures, no ram limit)
        gbps["slots alone"] = figure(1, spread=True)
        for k in ks:
            gbps[f"slots k{k}"] = figure(k, spread=False)
            gbps[f"slots k{k} spread"] = figure(k, spread=True)
    return dict(
        layer=bank.path, slots=bank.slots, expert_bytes=nbytes, k=ks, mb=args.ram_probe_mb,
        gbps=gbps, seconds=time.perf_counter() - start_s)


# -- the run --------------------------------------------------------------------------------------

QUICK = dict(
    shape="tiny", layers=4, rounds=2, block=2, warmup=2, user_tokens=6, probe_mb=8, prompt=6,
    probe_threads="1,4", ram_probe_mb=2, variants="default,default_tl", budgets="0.25,0.5",
    ckpt_dir="/tmp/bench_ckpt_quick",
)


def _list(kind):
    return lambda text: [kind(x) for x in text.split(",") if x]


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add = ap.add_argument
    add("--ckpt-dir", default="/tmp/bench_ckpt")
    add("--out", default=str(ROOT / "docs" / "benchmarks"))
    add("--tag", default="gpu-trace")
    add("--shape", default="qwen3", choices=tuple(harness.ARCHS), help="tiny, *_tiny: for a CPU")
    add("--layers", type=int, default=16)
    add("--dtype", default=None, help="default: bfloat16 on a GPU, float32 on the CPU")
    add("--regimes", type=_list(str), default="hit,ram,cold", help="of hit, ram, cold")
    add("--budgets", type=_list(float), default="0.25,0.5", help="the cold regime's budgets")
    add("--hit-budget", type=float, default=0.99)
    add("--ram-budget", type=_list(float), default="0.90", help="(the ram probe: at the first)")
    add("--placed", action="store_true", help="also time stock_placed: the placement's limit")
    add("--routings", type=_list(str), default=None,
        help="uniform, trace:FILE, model:DIR (default: uniform and the shape's trace if any)")
    add("--variants", type=_list(str), default="default", help="(the module's docstring)")
    add("--tuning-variant", type=tuning_variant, action="append", default=[],
        metavar="NAME:field=value,...", help="a variant word setting CacheTuning fields")
    add("--expert-host-gb", type=float, default=None,
        help="the variants' host tier (mlx-cuda; 0: none, misses from disk; default: theirs)")
    add("--rounds", type=int, default=4)
    add("--block", type=int, default=32, help="decode steps per round and configuration, + 1")
    add("--warmup", type=int, default=8, help="untimed steps per configuration first")
    add("--user-tokens", type=int, default=48, help="tokens of each stream_generate run")
    add("--user-streaming", action="store_true", help="the default through stream_generate too "
        "(on the rounds' rows; its counters count those runs: keep --prompt + --user-tokens "
        "within --rounds x --block for a hit regime's hits)")
    add("--prompt", type=int, default=None, help="default: a trace's prefill rows, else 28")
    add("--probe-mb", type=int, default=768, help="the disk probe's MB")
    add("--probe-threads", type=_list(int), default="1,2,4,8,16")
    add("--ram-probe-mb", type=int, default=256, help="MB (decimal) per figure (0: no probe)")
    add("--ram-probe-k", type=_list(int), default="2,4,8", help="experts read at once")
    add("--profile", type=int, default=0, help="steps of each configuration's step_profile")
    add("--profile-blocks", type=int, default=8, help="step_profile's passes over them all")
    add("--quick", action="store_true", help="a CPU try of everything in well under a minute: "
        + ", ".join(f"{k}={v}" for k, v in QUICK.items()) + " (flags given still win)")
    args = ap.parse_args(argv)
    if args.quick:
        ap.set_defaults(**QUICK)
        args = ap.parse_args(argv)
    args.routings = args.routings or default_routings(args.shape)
    if set(args.regimes) - set(REGIMES):
        raise SystemExit(f"--regimes {args.regimes}: known: {', '.join(REGIMES)}")
    TUNING_VARIANTS.update(args.tuning_variant)
    for v in args.variants:
        variant_tuning(v)  # an unknown word fails before anything is built
    return args


def plan(args, routings):
    """``(regime, routing, budget)`` of every group, in run order."""
    budgets = {"hit": [args.hit_budget], "ram": args.ram_budget, "cold": args.budgets}
    return [(regime, r, b) for regime in args.regimes for r in routings for b in budgets[regime]]


def main(argv=None):
    routing_replay.unwind_on_rewind()  # verified steps that run a forward again
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    args.placer = limit_placer(args.quick) if args.placed else None

    import mlx.core as mx

    dtype = args.dtype or ("bfloat16" if mx.default_device().type == mx.gpu else "float32")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    res = dict(
        command=" ".join([Path(sys.argv[0]).name] + list(argv)),
        date=time.strftime("%Y-%m-%d %H:%M"), device=str(mx.default_device()), mlx=mx.__version__,
        machine=platform.node(), shape=args.shape, layers=args.layers, dtype=dtype,
        expert_host_gb=args.expert_host_gb, rounds=args.rounds, block=args.block,
        warmup=args.warmup, user_tokens=args.user_tokens, tuning_variants=TUNING_VARIANTS,
        checkpoints={}, groups=[],
    )
    # the synthetic checkpoint's routings first, then each model:DIR's on its own checkpoint
    synthetic = [r for r in args.routings if not r.startswith("model:")]
    runs = [(None, synthetic)] if synthetic else []
    runs += [(r, [r]) for r in args.routings if r.startswith("model:")]
    rng = random.Random(1)
    bad = []  # configurations not exact
    for model_spec, specs in runs:
        if model_spec is None:
            path = harness.checkpoint(Path(args.ckpt_dir), args.shape, dtype, layers=args.layers,
                                      top_k=trace_top_k(args.shape))
        else:
            path = Path(model_spec[len("model:") :])
        ck, files, stocks = open_checkpoint(path, args, specs[0])
        name = "synthetic" if model_spec is None else harness.routing_label(model_spec)
        res["checkpoints"][name] = ck
        for k in ("total_expert_bytes", "expert_bytes", "moe_layers", "experts", "disk_gbps",
                  "disk_best_gbps"):
            res.setdefault(k, ck[k])  # the first checkpoint's
        if model_spec is None:
            stream = [rng.randrange(ck["vocab"]) for _ in range(4096)]
            prompts = {}
            for spec in specs:
                routing = harness.make_routing(spec, ck["experts"], ck["moe_layers"])
                rows = routing.decode_rows() if hasattr(routing, "decode_rows") else 28
                prompts[spec] = [rng.randrange(ck["vocab"]) for _ in range(args.prompt or rows)]
        else:
            prompt, stream = text_tokens(path, args.prompt or 28)
            prompts = {model_spec: prompt}
        for regime, spec, budget in plan(args, specs):
            prompt = prompts[spec]
            g = run_group(stocks, path, spec, budget, regime, args, ck, files, prompt, stream)
            gc.collect()  # the group's streaming models
            g.update(routing=spec, budget=budget, prompt_tokens=len(prompt), checkpoint=name)
            where = f"{harness.routing_label(spec)} {budget}"
            bad += [f"{regime} {where} {k}" for k, c in g["configs"].items()
                    if c["exact"] is False]
            res["groups"].append(g)
            save(res, args)  # after every group: a run cut short keeps what it measured
            log(regime_tables(dict(res, groups=[g])))
        del stocks
        gc.collect()
    print(regime_tables(res), flush=True)
    if bad:
        log("NOT EXACT: " + "; ".join(bad))
    return res


def save(res, args):
    out = Path(args.out)
    (out / f"{args.tag}.json").write_text(json.dumps(res, indent=1, default=str))
    (out / f"{args.tag}.md").write_text(markdown(res))


# -- the report -----------------------------------------------------------------------------------

# the timeline's split (bench/timeline_summary.py), as the tables name its parts
SPLIT = {"ids wait": "ids", "host to submit": "host", "reads": "reads", "installs": "inst",
         "compute": "comp", "rest": "rest", "between layers": "between"}


def _split_cell(c, per, more=()):
    ms = ((c.get("timeline") or {}).get("split") or {}).get(per)
    return " / ".join(f"{ms.get(k, 0):.3f}" for k in [*SPLIT, *more]) if ms else ""


def regime_tables(res):
    """One markdown table per regime, a row per configuration of each group."""
    lines = []
    for regime in REGIMES:
        groups = [g for g in res["groups"] if g["regime"] == regime]
        if not groups:
            continue
        ram = regime == "ram"
        against = "limit" if regime == "cold" else "stock"
        head = ["routing", "budget", "config", "tok/s", f"ratio to {against}"]
        head += ["ram limit tok/s (K)", "of ram limit"] if ram else []
        head += ["stock/stock", "user stock tok/s", "exact", "hit", "read / needed",
                 "ms per layer: " + " / ".join(SPLIT.values()),
                 "ms per token: same / outside / token"]
        lines += ["", f"### {regime}", "", "| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
        for g in groups:
            for key, c in g["configs"].items():
                lim = c.get("ram_limit")
                hit = c.get("hit_rate")
                cells = [harness.routing_label(g["routing"]), g["budget"], key, f"{c['tok_s']:.2f}",
                         f"{c['ratio']:.3f}"]
                if ram and lim:
                    cells += [f"{lim['tok_s']:.2f} ({lim['k']})", f"{lim['of_limit']:.3f}"]
                elif ram:
                    cells += ["", ""]
                user = g["stock_basis"]["user_tok_s"]
                exact = "-" if c["exact"] is None else f"{c['exact_steps']}/{c['total_steps']}"
                if g.get("stock_differs_at") is not None and c["exact"] is not None:
                    exact += f" ({'' if c['exact'] else 'NOT '}stock's to {g['stock_differs_at']})"
                cells += [f"{g['stock_vs_stock']:.3f}", "-" if user is None else f"{user:.1f}",
                          exact, "" if hit is None else f"{hit:.3f}",
                          f"{c['read_over_needed']:.2f}" if c.get("read_over_needed") else "",
                          _split_cell(c, "ms per layer"),
                          _split_cell(c, "ms per token", ("outside", "token"))]
                lines.append("| " + " | ".join(map(str, cells)) + " |")
            lines += [f"\n{w}\n" for w in g.get("warnings", [])]
        for g in groups:
            where = f"{harness.routing_label(g['routing'])} {g['budget']}"
            lines += ["", f"- {where}: {basis_line(g)}"]
    return "\n".join(lines).lstrip("\n")


def markdown(res):
    what = [f"{res['shape']} shape" if k == "synthetic" else k for k in res["checkpoints"]]
    head = [
        f"# gpu_pipeline: {', '.join(what)}, {res['moe_layers']} MoE layers, {res['dtype']}, "
        f"{res['device']} (mlx {res['mlx']})", "",
        f"`{res['command']}` ({res['date']}; {res['rounds']} rounds of {res['block'] + 1} decode "
        f"steps per configuration after {res.get('warmup')} untimed; stock as a user sees it: "
        f"{res.get('user_tokens')} tokens of stream_generate a round). What the regimes, ratios "
        "and columns are: docs/benchmarks/methods.md (gpu_pipeline.py).", "",
    ]
    for name, ck in res["checkpoints"].items():
        head += [f"Checkpoint {name}: {ck['moe_layers']} MoE layers x {ck['experts']} experts, "
                 f"{ck['expert_bytes'] / 1e6:.3f} MB per expert; disk best "
                 f"{ck['disk_best_gbps']:.2f} GB/s.", ""]
        probe = ck.get("ram_probe")
        if probe:
            gbps = ", ".join(f"{k} {v:.2f}" for k, v in probe["gbps"].items())
            head += [f"Ram probe ({probe['layer']}, page cache warm; GB/s decimal): {gbps}.", ""]
    return "\n".join(head) + "\n" + regime_tables(res) + "\n"


if __name__ == "__main__":
    main()
