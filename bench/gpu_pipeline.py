"""Decode in three regimes (hit, ram, cold) against stock or the disk's limit, stock floors beside.

The H200 run (issue 22; 16 MoE layers, bf16, Qwen3-30B-A3B expert shape):

    python3 bench/gpu_pipeline.py --ckpt-dir /root/ckpt --out $OUT --layers 16 \
        --regimes hit,ram,cold --floors \
        --routings uniform,trace:tests/data/routing/qwen3-30b-a3b.jsonl \
        --variants default,default_tl --rounds 4

(or ``BENCH=pipeline bash bench/gpu.sh <the same arguments>``). On the CPU, everything at tiny size
in ~10 s: ``python3 bench/gpu_pipeline.py --quick --regimes hit,ram,cold --floors --out /tmp/q``
(``tests/test_bench_regimes.py`` runs it). A trained checkpoint's own routing (``model:DIR``,
below):

    python3 bench/gpu_pipeline.py --out $OUT --regimes hit,ram,cold --floors \
        --routings model:/root/qwen3-moe-16l --variants default,default_tl --rounds 4

(CPU: ``--quick --regimes hit,ram --routings model:docs/demo-model``,
``tests/test_bench_model_routing.py``). Without ``--regimes``: the cold regime alone at
``--budgets``, as before this option existed:

    python bench/gpu_pipeline.py --ckpt-dir /root/ckpt --out $OUT --layers 16 \
        --budgets 0.25,0.5 --routings uniform,trace:tests/data/routing/qwen3-30b-a3b.jsonl \
        --variants staged,staged_t16,direct,direct_t16

One checkpoint with Qwen3-30B-A3B's expert shape (hidden 2048, moe_intermediate 768, 128 experts,
affine 4-bit) and top-k 6, the routing traces' (``--layers`` MoE layers, at most the trace's: 48 for
``qwen3-30b-a3b.jsonl``, 30 for ``gemma-4-26b-a4b.jsonl``; a trace of more layers is replayed on its
first ones: ``bench/routing_replay.py``). Groups: regime x routing (uniform random experts, a
trace, or ``model:DIR``) x budget (share of the expert bytes). ``model:DIR``: DIR is a real mlx-lm
MoE checkpoint (``mlx_lm.convert``'s output, e.g. docs/demo-model/); its groups run on that
checkpoint, not the synthetic one: its streaming variants and stocks are loaded from DIR and route
with the model's own router (no forced ids, no wrapper), fed ``TEXT`` encoded by DIR's tokenizer
(the first ``--prompt`` tokens, 28 by default, as the prompt; the rest as the token stream); its
expert size, disk probe and ram probe are its own (``checkpoints`` in the JSON); reported as
"model NAME (its own router)". In each group every variant of the streaming model
runs in interleaved rounds with two separately loaded stock models (``stock``, ``stock_again``: stock's
own run-to-run) and, with ``--floors``, two stock models patched here (never in the package):
``stock_synclayer`` (one ``np.array(indices)`` of the router's ids per MoE layer, then the stock
module) and ``stock_synctoken`` (``mx.eval(logits)`` inside the model call, once per token).

Regimes:
- ``hit``: budget ``--hit-budget`` (0.99: below "all", so the streaming path runs), page cache warm
  (the files read once), and the rounds' steps decoded once before them, untimed, after which the
  routing is rewound: the rounds ask for exactly the experts that pass made resident. The measured
  hit rate is reported; a warning is printed (and kept in the JSON) where it is not 1.0.
- ``ram``: budget ``--ram-budget`` (0.90), page cache warm, the rounds' steps decoded once before
  them (the cache in its steady state): every miss is a copy from RAM (the safetensors store's
  buffered reads; the ``packdirect`` store's O_DIRECT reads still go to the disk). Its limit: a
  probe of the read path (``ram_probe``, page cache warm, the package's own store): one expert
  alone and K (``--ram-probe-k``) in parallel on the demand threads, into a bank's slots (on a GPU
  pages the device touched last: a forward and a device read of those slots before each rep) and
  into plain numpy memory (fresh, reused), GB/s decimal, ``--ram-probe-mb`` per figure; each ram
  row gets ``ram_limit`` = 1 / (stock's step + missed bytes per token / the slots' parallel GB/s at
  the probed K nearest its misses per layer call), and its tok/s as a fraction of that.
- ``cold``: the page cache dropped before every token, at ``--budgets``.

Each configuration first feeds the same prompt one token at a time (one-token calls are
deterministic on stock mlx-cuda 0.32.4, multi-token prompts are not on small shapes), then decodes a
fixed token stream through mlx-lm's ``generate_step`` (``--block`` + 1 steps per round); each step's
log-probabilities are hashed, and every configuration is compared with the first stock model token
by token. With ``--regimes`` the routing's ids are made to depend on the layer's router
(``--graph-ids``): a host readback of them then waits for the graph, as with a trained model.

Per configuration: tok/s, ``ratio`` (median over rounds of the per-round ratio: to stock for hit and
ram, to the limit for cold, to stock for stock configurations), exact steps, hit rate, bytes read
per token, seconds per token in I/O waits, installs, the store's reads and the expert modules'
calls; the disk's best bandwidth by the probe (random reads of one expert's size, ``--probe-threads``,
buffered and O_DIRECT); limit = 1 / max(stock step time, bytes read per token / best bandwidth); for
trace routing (ram, cold), the hit rates a replay of the same rows gives (``mlx_lm_streaming.tools.replay``:
LRU, decay, Belady) with the same slots. Variants with the word ``tl`` record a timeline, summarized
(``bench/timeline_summary.py``) into a per-layer split of a token's time: waiting for the router's
ids, host work from then to the layer's compute submission, reads, installs, compute, the rest, and
the time between layer calls, in ms per MoE layer call and per token; ``default`` beside
``default_tl`` shows the timeline's own cost. ``--tuning-variant NAME:field=value,...`` defines a
variant word for any ``CacheTuning`` fields (``nolk:lookahead=false``; ``--variants default,nolk``).

Writes ``<out>/<tag>.json`` (after every group) and ``<out>/<tag>.md`` (a table per regime: config,
tok/s, ratio, the ram limit and the fraction of it (ram), stock/stock, exact steps, hit rate,
per-layer split; then the detailed table).
"""

import argparse
import gc
import json
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import harness  # noqa: E402
from harness import GB, MB, Config, decode_block, log  # noqa: E402

# harness.ARCHS's shapes at top-k 6, the routing traces' ("tiny": for trying the script out on a CPU)
SHAPES = ("qwen3", "tiny")

# A variant is a name made of "_"-joined words: "default" (the package's defaults), "staged" /
# "direct" (direct reads off / on, 4 store threads unless a "tN" word says otherwise), "tN" (N store
# threads), "nolookahead" (no
# next-layer lookahead), "gateN" (lookahead guesses read once their running precision is N% or
# more), "pack" / "packdirect" (the ``packed`` store, buffered / O_DIRECT), "tl" (records a
# timeline, ``--streaming-trace``, summarized by bench/timeline_summary.py). Words of settings that
# left ``CacheTuning`` are listed in bench/README.md with the commit they last existed in.
# E.g. "direct_t8", "staged_gate25_tl".
VARIANT_WORDS = "default, staged, direct, tN, nolookahead, gateN, pack, packdirect, tl"


# Variants defined on the command line (``--tuning-variant NAME:field=value,...``): a word NAME
# that sets those ``CacheTuning`` fields, alone or "_"-joined with other words ("nolk_tl").
TUNING_VARIANTS = {}


def _tuning_value(text: str):
    low = text.strip().lower()
    if low in ("true", "on", "yes"):
        return True
    if low in ("false", "off", "no"):
        return False
    if low == "none":
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text.strip()


def tuning_variant(spec: str):
    """``NAME:field=value,field=value`` -> ``(NAME, {field: value})``; fields must be
    ``CacheTuning``'s (checked here, before anything is built)."""
    import dataclasses

    from mlx_lm_streaming.runtime.expert_cache import CacheTuning

    name, sep, body = spec.partition(":")
    name = name.strip()
    if not sep or not name or "_" in name or not name.isidentifier():
        raise SystemExit(
            f"--tuning-variant {spec!r}: use NAME:field=value,... (NAME a word without '_')"
        )
    known = {f.name for f in dataclasses.fields(CacheTuning)}
    fields = {}
    for item in filter(None, (x.strip() for x in body.split(","))):
        field, eq, value = item.partition("=")
        field = field.strip()
        if not eq or field not in known:
            raise SystemExit(
                f"--tuning-variant {spec!r}: {item!r} is not field=value of a CacheTuning field "
                f"(known: {', '.join(sorted(known))})"
            )
        fields[field] = _tuning_value(value)
    if not fields:
        raise SystemExit(f"--tuning-variant {spec!r}: no field=value")
    return name, fields


def variant_options(name: str):
    """``(load options, CacheTuning fields)`` of a variant name (see above)."""
    opts, tuning = {}, {}
    store = {}
    for word in name.split("_"):
        if word in TUNING_VARIANTS:
            tuning.update(TUNING_VARIANTS[word])
        elif word in ("staged", "direct"):
            opts["direct_reads"] = word == "direct"
            store.setdefault("threads", 4)
        elif word == "nolookahead":
            tuning["lookahead"] = False
        elif word in ("pack", "packdirect"):
            # the packed store (one read per expert; the pack is made once, before the runs), its
            # first-read crc32 left out (CPU time, not I/O); packdirect: O_DIRECT
            opts["store"] = "packed"
            store["verify"] = "off"
            store.setdefault("threads", 8)
            if word == "packdirect":
                store["direct"] = True
        elif word == "tl":
            opts["trace"] = True  # the caller names the file
        elif word.startswith("gate") and word[4:].isdigit():
            tuning["lookahead_min_precision"] = int(word[4:]) / 100
        elif word[:1] == "t" and word[1:].isdigit():
            store["threads"] = int(word[1:])
        elif word != "default":
            raise SystemExit(f"variant {name!r}: unknown word {word!r} (known: {VARIANT_WORDS})")
    if store:
        opts["store_options"] = store
    return opts, tuning


def load_variant(path, name: str, timeline=None, **opts):
    """A streaming model configured as the variant ``name`` (``timeline``: its file, for "tl")."""
    from harness import load_streaming

    from mlx_lm_streaming.runtime.expert_cache import CacheTuning

    more, tuning = variant_options(name)
    opts.update(more)
    if opts.get("trace"):
        opts["trace"] = str(timeline)
    if tuning:
        opts["tuning"] = CacheTuning(**tuning)
    model, _ = load_streaming(path, **opts)
    return model


# The routing's ids made to depend on the router's own (``ids + 0 * router ids``): the values are
# the routing's, but they exist only once the layer's router has run, as with a trained model, so a
# host readback of them waits for the graph up to that router. Without it (``--no-graph-ids``, the
# default without ``--regimes``), the ids are host data: a host sync on them waits for nothing
# unless something else it evaluates (the lookahead's guesses) depends on the layer's input.
GRAPH_IDS = False
_GRAPH_ROUTED = None


def _graph_routed(inner, routing, layer_no):
    global _GRAPH_ROUTED
    import routing_replay

    if _GRAPH_ROUTED is None:
        base = type(routing_replay.routed(None, None, 0))

        class GraphRouted(base):
            def __call__(self, x, indices):
                start = time.perf_counter()
                ids = self._routing.indices(self._layer_no, indices.shape)
                ids = ids + (indices * 0).astype(ids.dtype)
                out = self._inner(x, ids)
                routing = self._routing
                routing.call_seconds = getattr(routing, "call_seconds", 0.0) + (
                    time.perf_counter() - start
                )
                return out

        _GRAPH_ROUTED = GraphRouted
    return _GRAPH_ROUTED(inner, routing, layer_no)


def wrap(model, routing):
    """Route ``model`` through ``routing`` (its ``call_seconds``: host time in the expert modules)."""
    from routing_replay import expert_modules, routed

    found = expert_modules(model)
    if hasattr(routing, "check"):
        from routing_replay import _expert_counts

        routing.check(len(found), *_expert_counts(model))
    for layer_no, (parent, name, module) in enumerate(found):
        parent[name] = (_graph_routed if GRAPH_IDS else routed)(module, routing, layer_no)


def prompt_by_token(cfg, prompt):
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cfg.kv = make_prompt_cache(cfg.model)
    for tok in prompt:
        mx.eval(cfg.model(mx.array([[tok]]), cache=cfg.kv))


def counters(cfg):
    c = cfg.counters()
    if cfg.cache is not None:
        st = cfg.cache.store.stats
        c["store_seconds"] = st.seconds
        c["store_reads"] = st.reads
    c["call_seconds"] = getattr(cfg.routing, "call_seconds", 0.0)
    return c


# -- the stock floors (bench only: they patch stock models in this process, never the package) ---

FLOORS = ("stock_synclayer", "stock_synctoken")


def _sync_layer_class():
    import mlx.nn as nn
    import numpy as np

    class SyncLayer(nn.Module):
        """Stock's expert module after one host readback of the router's own ids
        (``np.array(indices)``, which waits for everything the router depends on)."""

        def __init__(self, inner):
            super().__init__()
            self.inner = inner  # a child, so ``_set_routing`` still finds the routed module

        def __call__(self, x, indices):
            np.array(indices)
            return self.inner(x, indices)

    return SyncLayer


def sync_per_layer(model) -> int:
    """Wrap every routed expert module of stock ``model`` in a ``SyncLayer`` (outside the routing
    wrapper: the readback is of the router's real ids, computed from the layer's input; a model
    not routed, ``model:DIR``: its expert modules)."""
    import routing_replay

    cls = type(routing_replay.routed(None, None, 0))
    sync = _sync_layer_class()
    found = [(p, m) for p, m in model.named_modules() if isinstance(m, cls)]
    if not found:
        modules = routing_replay.expert_modules(model)
        for parent, name, module in modules:
            parent[name] = sync(module)
        return len(modules)
    for path, module in found:
        parent = model
        parts = path.split(".")
        for q in parts[:-1]:
            parent = parent[int(q)] if isinstance(parent, list) else parent[q]
        parent[parts[-1]] = sync(module)
    return len(found)


def sync_per_token(model) -> None:
    """Stock ``model`` with one host wait per token: its ``__call__`` evaluates the logits before
    returning (mlx-lm's ``generate_step`` then cannot build step t+1 while step t runs)."""
    import mlx.core as mx

    base = type(model)

    class SyncToken(base):
        def __call__(self, *a, **k):
            out = base.__call__(self, *a, **k)
            mx.eval(out)
            return out

    SyncToken.__name__ = SyncToken.__qualname__ = base.__name__
    model.__class__ = SyncToken


# -- regimes ---------------------------------------------------------------------------------------

# regime -> (the page cache dropped before every token, a pass over the measured steps before the
# rounds: "replay" replays the same routing after it (every expert the rounds use is resident
# where the budget holds them), "fill" goes on after it (the cache in its steady state))
REGIMES = {
    "hit": dict(cold=False, warm_pass="replay"),
    "ram": dict(cold=False, warm_pass="fill"),
    "cold": dict(cold=True, warm_pass=None),
}


def warm_page_cache(files) -> float:
    """Read ``files`` once, whole, so later reads of them are copies from RAM; returns seconds."""
    start = time.perf_counter()
    buf = bytearray(16 << 20)
    view = memoryview(buf)
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while fh.readinto(view):
                pass
    return time.perf_counter() - start


def routing_state(routing):
    """A copy of the routing's position (``ForcedRouting.calls``, ``TraceRouting.cursor``)."""
    return {k: dict(getattr(routing, k)) for k in ("calls", "cursor") if hasattr(routing, k)}


def set_routing_state(routing, state) -> None:
    for k, v in state.items():
        setattr(routing, k, dict(v))


def run_group(stocks, path, routing_spec, budget, variants, args, ck, files, prompt, stream,
              regime="cold"):
    """One regime x routing x budget: the variants and the stocks, interleaved rounds (``ck``: the
    checkpoint's figures, ``open_checkpoint``)."""
    import random

    from harness import delta, reset_banks

    mode = REGIMES[regime]
    total = ck["total_expert_bytes"]
    configs = {}
    for name, model in stocks.items():
        cfg = Config(name, model)
        configs[name] = cfg
    timelines = {}
    kind = routing_spec.split(":")[0]
    if kind in ("model", "trace"):
        kind += "-" + Path(routing_spec[len(kind) + 1 :]).stem
    group = f"{regime}-{kind}-{int(round(budget * 100))}"
    all_files = list(files)
    for v in variants:
        timelines[v] = Path(args.timeline_dir or args.out) / f"{args.tag}-{group}-{v}.trace.json"
        if timelines[v].exists():
            timelines[v].unlink()
        model = load_variant(path, v, timelines[v], expert_cache_gb=budget * total / harness.BUDGET_GB)
        packed = variant_options(v)[0].get("store") == "packed"
        vfiles = harness.pack_files(path) if packed else files
        all_files += [f for f in vfiles if f not in all_files]
        configs[v] = Config(v, model, cold=mode["cold"], files=vfiles)
    for cfg in configs.values():
        cfg.routing = harness.make_routing(routing_spec, ck["experts"], ck["moe_layers"])
        if cfg.routing is None:
            continue  # model:DIR, its own router
        if cfg.name in stocks:
            _set_routing(cfg.model, cfg.routing)
        else:
            wrap(cfg.model, cfg.routing)
    warm_s = warm_page_cache(all_files) if not mode["cold"] else 0.0
    def start(cfg):
        prompt_by_token(cfg, prompt)
        cfg.stream, cfg.pos = stream, 1
        decode_block(cfg, 2)  # warm-up: allocations, kernels

    for cfg in configs.values():
        if cfg.routing is not None:
            cfg.routing.reset()
        if cfg.cache is not None:
            reset_banks(cfg.model)
        start(cfg)
        if mode["warm_pass"]:
            # the rounds' steps once, untimed: "replay" then rewinds the routing, so the rounds
            # ask for exactly the experts this pass made resident (the model's own router: the
            # same tokens again from the prompt on, a new KV cache)
            state = routing_state(cfg.routing) if cfg.routing is not None else None
            for _ in range(args.rounds):
                decode_block(cfg, args.block)
            if mode["warm_pass"] == "replay":
                if state is None:
                    start(cfg)
                else:
                    set_routing_state(cfg.routing, state)
        cfg.tokens = []
        cfg.decode_s = []
        cfg.stats0 = counters(cfg)
    if not mode["cold"]:
        warm_s += warm_page_cache(all_files)
    rounds = []
    for r in range(args.rounds):
        row = {}
        for key in random.Random(r).sample(list(configs), len(configs)):
            times = decode_block(configs[key], args.block)
            configs[key].decode_s.extend(times)
            row[key] = sum(times) / len(times)
        rounds.append(row)
        log(
            f"[{regime} {routing_spec} {budget}] round {r}: "
            + ", ".join(f"{k} {1 / v:.2f}" for k, v in row.items())
        )
    out = {"regime": regime, "rounds": rounds, "configs": {}, "page_cache_warm_s": warm_s}
    ref = configs["stock"].tokens
    for key, cfg in configs.items():
        n = len(cfg.decode_s)
        c = delta(cfg.stats0, counters(cfg))
        asked = c.get("hits", 0) + c.get("misses", 0)
        same = [a == b for a, b in zip(cfg.tokens, ref)]
        entry = {
            "tokens": n,
            "tok_s": n / sum(cfg.decode_s),
            "s_per_token": sum(cfg.decode_s) / n,
            "same_as_stock": same,
            "exact_steps": sum(same),
            "total_steps": len(ref),
            "exact": len(cfg.tokens) == len(ref) and all(same),
            "call_s_per_token": c["call_seconds"] / n,
            "ratio_to_stock": statistics.median(r["stock"] / r[key] for r in rounds),
        }
        if cfg.cache is not None:
            entry.update(
                hit_rate=c["hits"] / asked if asked else None,
                misses_per_token=c["misses"] / n,
                bytes_per_token=c["bytes_read"] / n,
                io_wait_s_per_token=c["io_wait_seconds"] / n,
                install_s_per_token=c["install_seconds"] / n,
                store_s_per_token=c["store_seconds"] / n,
                store_reads_per_token=c["store_reads"] / n,
                slots=[b.slots for b in cfg.cache.banks],
                direct=all(b.direct for b in cfg.cache.banks),
                policy=getattr(cfg.cache, "policy", None),
                prefetch=harness.precision_recall(c.get("prefetch")),
                verified_share=c.get("verified_steps", 0) / n,
                replays_per_token=c.get("verified_replays", 0) / n,
                named_per_token=c.get("verified_named", 0) / n,
                named_used=(c["verified_named_used"] / c["verified_named"]
                            if c.get("verified_named") else None),
            )
            if regime == "hit" and entry["hit_rate"] != 1.0:
                msg = (
                    f"WARNING: regime hit, {routing_spec} {budget}, {key}: measured hit rate "
                    f"{entry['hit_rate']} (not 1.0; slots {min(entry['slots'])}-"
                    f"{max(entry['slots'])} per layer)"
                )
                log(msg)
                out.setdefault("warnings", []).append(msg)
        if cfg.cache is not None and cfg.cache.timeline is not None:
            from timeline_summary import summarize as timeline_summary

            # closed, not flushed: the last decode step's span is written when the step ends
            cfg.cache.timeline.close()
            entry["timeline"] = timeline_summary(timelines[key], last=n)
            entry["timeline_file"] = timelines[key].name
            per_token = entry["timeline"].get("split", {}).get("ms per token")
            if per_token:
                # the timeline's step runs from the first MoE layer call to the last: the rest of
                # the token's measured time (embedding, first attention, head, sampling, mlx-lm)
                per_token["outside"] = round(
                    entry["s_per_token"] * 1e3 - entry["timeline"]["step ms"], 4
                )
                per_token["token"] = round(entry["s_per_token"] * 1e3, 4)
        out["configs"][key] = entry
    out["stock_vs_stock"] = out["configs"]["stock_again"]["ratio_to_stock"]
    # warm-up decode rows of the trace: 3 (generate_step computes one ahead), the warm pass's
    # (hit: replayed by the rounds; ram: before them), then the measured ones
    measured = len(configs["stock"].tokens)
    out["decode_rows"] = {
        "warmup": 3 + (measured if mode["warm_pass"] == "fill" else 0),
        "measured": measured,
        "replayed": mode["warm_pass"] == "replay",
    }
    for cfg in configs.values():
        if cfg.name not in stocks:
            del cfg.model
    del configs
    gc.collect()
    return out


def _set_routing(model, routing):
    """Point an already wrapped stock model at ``routing``; wrap it on first use."""
    import routing_replay

    cls = type(routing_replay.routed(None, None, 0))
    found = [m for _, m in model.named_modules() if isinstance(m, cls)]
    if not found:
        wrap(model, routing)
        return
    for m in found:
        object.__setattr__(m, "_routing", routing)


def replay_figures(trace_spec, layers, slots, prompt_rows, warmup, measured):
    """Decode hit rates of a replay of the rows the benchmark used, with ``slots`` per layer."""
    from dataclasses import replace

    from mlx_lm_streaming.runtime import policy
    from mlx_lm_streaming.tools import replay
    from mlx_lm_streaming.files.routing_trace import read_trace

    trace = read_trace(trace_spec.split(":", 1)[1])
    rows = trace.rows[: prompt_rows + warmup + measured]
    used = []
    for i, row in enumerate(rows):
        phase = "decode" if i >= prompt_rows + warmup else "prefill"
        used.append(replace(row, phase=phase, experts=row.experts[:layers]))
    header = dict(trace.header, num_layers=layers)
    sub = type(trace)(header=header, rows=used, path=trace.path)
    out = {}
    for name in ("lru", "decay"):
        out[name] = replay.replay(sub, slots, name).hit_rate("decode")
    out["belady"] = replay.belady(sub, slots).hit_rate("decode")
    out["default_policy"] = policy.DEFAULT_POLICY
    return out


# the text a model:DIR routing decodes (its tokens by that checkpoint's tokenizer): the prompt, then
# the stream fed in place of sampling, the same for every configuration (cycled if the run is
# longer)
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


def routing_cell(spec: str) -> str:
    """A routing as the tables name it ("trace NAME" by the trace file's stem, "uniform", "model
    NAME (its own router)")."""
    if spec.startswith("trace:"):
        return "trace " + Path(spec[len("trace:") :]).stem
    return harness.routing_label(spec)


def open_checkpoint(path, args, variants, first_routing):
    """``(figures, shard files, stock models)`` of one checkpoint: its expert bytes, layers and
    experts, the disk probe at its expert size, the ram probe (``ram_probe``, with the ram regime),
    and the stocks (routed through ``first_routing`` now, pointed at each group's later; a
    ``model:DIR`` routing: not routed)."""
    files = harness.shards(path)
    if any(variant_options(v)[0].get("store") == "packed" for v in variants):
        from mlx_lm_streaming.tools.pack import pack_checkpoint

        start = time.time()
        pack_checkpoint(path, progress=False)
        log(f"packed in {time.time() - start:.0f} s")
    probe, _ = harness.load_streaming(path, expert_cache_gb=1e6)
    cache = probe.expert_streaming.cache
    ck = dict(
        path=str(path),
        total_expert_bytes=cache.total_expert_bytes,
        expert_bytes=cache.banks[0].layer.expert_nbytes,
        moe_layers=len(cache.banks),
        experts=cache.banks[0].num_experts,
    )
    del probe, cache
    gc.collect()
    threads = [int(t) for t in args.probe_threads.split(",")]
    bw = harness.probe_disk(files, ck["expert_bytes"], args.probe_mb * MB, threads)
    ck["disk_gbps"] = bw
    ck["disk_best_gbps"] = max(v for v in bw.values() if v)
    log(f"{path}: disk GB/s: {bw}")
    if "ram" in args.regimes and args.ram_probe_mb > 0:
        ck["ram_probe"] = ram_probe(path, files, ck, args)
        log(f"{path}: ram probe GB/s: {ck['ram_probe']['gbps']}")
    stocks = {}
    names = ("stock", "stock_again") + (FLOORS if args.floors else ())
    for name in names:
        stocks[name], config = harness.load_stock(path)
        routing = harness.make_routing(first_routing, ck["experts"], ck["moe_layers"])
        if routing is not None:
            # routed now, so the floors wrap the routed modules
            wrap(stocks[name], routing)
    if args.floors:
        sync_per_layer(stocks["stock_synclayer"])
        sync_per_token(stocks["stock_synctoken"])
    ck["vocab"] = config["vocab_size"]
    return ck, files, stocks


RAM_PROBE_REPS = 100  # a forward each: small experts must not make the probe long


def ram_probe(path, files, ck, args):
    """GB/s (decimal) of the ram regime's read path, the page cache warm, as the store reads: the
    package's own store (``store.read_many`` of an expert's (ref, buffer) jobs), into one layer's
    bank slots the package's way (``bank.reads.slot_reader``: through their host views, or on mlx-cuda
    by device copies, ``cuda_copy.py``), timed up to the device's next read of those slots (where
    pages the host wrote migrate back), and into plain numpy host memory (``np.empty``: fresh each
    rep, or reused); one expert alone, and K experts in parallel, one per demand thread
    (``bank.reads.DirectReads``'s way). Before each rep, one forward
    of the model and a device read of the slots about to be written: on a GPU (managed memory)
    their pages were last touched by the device, as in a decode step. At most ``--ram-probe-mb``
    and ``RAM_PROBE_REPS`` reps per figure. Model: ``default`` without lookahead (no background reads beside the probe) at the
    ram budget."""
    import mlx.core as mx
    import numpy as np

    from mlx_lm_streaming.runtime.bank import reads as bank_reads

    start_s = time.perf_counter()
    model = load_variant(
        path, "nolookahead", expert_cache_gb=args.ram_budget * ck["total_expert_bytes"]
        / harness.BUDGET_GB,
    )
    cache = model.expert_streaming.cache
    cache.ensure_planned()
    bank = cache.banks[0]
    layer = bank.layer
    parts, nbytes = layer.parts, layer.expert_nbytes
    offsets = np.cumsum([0] + [p.nbytes for p in parts])
    ks = [k for k in args.ram_probe_k if k <= bank.slots]
    token = mx.array([[1]])
    warm_page_cache(files)
    mx.eval(model(token))  # the banks filled as far as one token fills them

    def touch(slots):
        mx.eval(model(token))
        idx = mx.array(slots)
        mx.eval([bank.array(p.proj, p.part)[idx] for p in parts])

    def jobs(where, experts, slots, reused):
        bufs = reused if where == "host reused" else [np.empty(nbytes, np.uint8) for _ in experts]
        return [
            [(r, memoryview(b[offsets[i] : offsets[i + 1]])) for i, r in enumerate(layer.refs(e))]
            for e, b in zip(experts, bufs)
        ]

    def figure(where, k, spread=False):
        reps = min(RAM_PROBE_REPS, max(2, args.ram_probe_mb * 1_000_000 // (k * nbytes)))
        reused = [np.zeros(nbytes, np.uint8) for _ in range(k)]
        seconds = 0.0
        for rep in range(reps):
            experts = [(rep * k + j) % bank.num_experts for j in range(k)]
            slots = list(range(k))
            touch(slots)
            with bank.lock:
                if where == "slots":  # the package's own way into the slots, and the device's
                    t = time.perf_counter()  # next read of them (managed pages come back)
                    read = bank_reads.slot_reader(bank, spread=spread or k == 1)
                    members = list(range(len(parts)))
                    pool = cache.demand_pool
                    for f in [pool.submit(read, e, s, members) for e, s in zip(experts, slots)]:
                        f.result()
                    idx = mx.array(slots)
                    mx.eval([bank.array(p.proj, p.part)[idx].sum() for p in parts])
                    seconds += time.perf_counter() - t
                    continue
                todo = jobs(where, experts, slots, reused)
                t = time.perf_counter()
                if k == 1:
                    cache.store.read_many(todo[0])
                else:
                    # as read_direct reads a load of k experts: each on its own demand thread, its
                    # ranges on that thread alone (``spread_reads_upto``), or spread ("spread")
                    read = cache.store.read_many if spread else cache.store.read_on_this_thread
                    pool = cache.demand_pool
                    for f in [pool.submit(read, j) for j in todo]:
                        f.result()
                seconds += time.perf_counter() - t
        return reps * k * nbytes / seconds / 1e9

    wheres = ("slots", "host fresh", "host reused")
    if bank.views is None:
        wheres = wheres[1:]  # no host views of the banks here: direct reads are off
    gbps = {}
    for k in [1] + ks:
        for where in wheres:
            gbps[f"{where} {'alone' if k == 1 else f'k{k}'}"] = figure(where, k)
        if k > 1 and "slots" in wheres:
            gbps[f"slots k{k} spread"] = figure("slots", k, spread=True)
    out = dict(
        layer=bank.path, slots=bank.slots, expert_bytes=nbytes, k=ks, mb=args.ram_probe_mb,
        gbps=gbps, seconds=time.perf_counter() - start_s,
    )
    del model, cache, bank
    gc.collect()
    return out


def plan(args, routings):
    """``(regime, routing, budget)`` of every group, in run order."""
    if not args.regimes:
        return [("cold", r, b) for r in routings for b in args.budget_list]
    out = []
    for regime in args.regimes:
        budgets = {"hit": [args.hit_budget], "ram": args.ram_budgets}.get(regime, args.budget_list)
        out += [(regime, r, b) for r in routings for b in budgets]
    return out


QUICK = dict(
    shape="tiny", layers=4, rounds=2, block=2, probe_mb=8, prompt=6, probe_threads="1,4",
    ram_probe_mb=2,
    variants="default,default_tl", budgets="0.25,0.5", ckpt_dir="/tmp/bench_ckpt_quick",
)


def main(argv=None):
    import routing_replay

    routing_replay.unwind_on_rewind()  # verified steps that run a forward again
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ckpt-dir", default="/tmp/bench_ckpt")
    ap.add_argument("--out", default=str(ROOT / "docs" / "benchmarks"))
    ap.add_argument("--tag", default="gpu-trace")
    ap.add_argument("--shape", default="qwen3", choices=SHAPES)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on a GPU, float32 on the CPU")
    ap.add_argument(
        "--regimes",
        default=None,
        help="comma list of hit, ram, cold (default: cold only, at --budgets, as before)",
    )
    ap.add_argument("--budgets", default="0.25,0.5", help="the cold regime's budgets")
    ap.add_argument("--hit-budget", type=float, default=0.99)
    ap.add_argument("--ram-budget", default="0.90", help="the ram regime's budgets (comma list; "
                    "the probe runs at the first)")
    ap.add_argument(
        "--floors",
        action="store_true",
        help="also time stock_synclayer (one np.array(indices) per MoE layer) and stock_synctoken "
        "(one mx.eval(logits) per token) in the same rounds",
    )
    ap.add_argument(
        "--routings",
        default="uniform,trace:" + str(ROOT / "tests/data/routing/qwen3-30b-a3b.jsonl"),
    )
    ap.add_argument("--variants", default="staged,staged_t16,direct,direct_t16")
    ap.add_argument(
        "--tuning-variant",
        action="append",
        default=[],
        metavar="NAME:field=value,...",
        help="define variant word NAME setting those CacheTuning fields (bool/int/float/None/str "
        "values), usable in --variants alone or with other words; repeatable",
    )
    ap.add_argument(
        "--graph-ids",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the routing's ids computed after the layer's router (default: on with --regimes, off "
        "without, as before)",
    )
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--block", type=int, default=6)
    ap.add_argument("--prompt", type=int, default=None, help="prompt tokens (default: a trace's "
                    "prefill rows, 28 for uniform)")
    ap.add_argument("--probe-mb", type=int, default=768)
    ap.add_argument("--probe-threads", default="1,2,4,8,16")
    ap.add_argument(
        "--ram-probe-mb",
        type=int,
        default=256,
        help="the ram regime's read-path probe: MB (decimal) read per figure (0: no probe)",
    )
    ap.add_argument(
        "--ram-probe-k",
        default="2,4,8",
        help="the ram probe's parallel reads: experts read at once (a layer call's misses)",
    )
    ap.add_argument("--timeline-dir", default=None, help="where variants with 'tl' write (--out)")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="a CPU try of everything in well under a minute: " + ", ".join(
            f"{k}={v}" for k, v in QUICK.items()) + " (flags given explicitly still win)",
    )
    argv = sys.argv[1:] if argv is None else argv
    args = ap.parse_args(argv)
    if args.quick:
        given = {a.split("=")[0].lstrip("-").replace("-", "_") for a in argv if a.startswith("--")}
        for k, v in QUICK.items():
            if k not in given:
                setattr(args, k, v)
        if "routings" not in given:
            args.routings = "uniform,trace:" + str(ROOT / "tests/data/routing/qwen3-30b-a3b.jsonl")
    args.budget_list = [float(b) for b in args.budgets.split(",") if b]
    args.ram_budgets = [float(b) for b in str(args.ram_budget).split(",") if b]
    args.ram_budget = args.ram_budgets[0]
    args.ram_probe_k = sorted({int(k) for k in args.ram_probe_k.split(",") if k})
    args.regimes = [r for r in (args.regimes or "").split(",") if r]
    for r in args.regimes:
        if r not in REGIMES:
            raise SystemExit(f"--regimes: unknown {r!r} (known: {', '.join(REGIMES)})")
    global GRAPH_IDS
    GRAPH_IDS = bool(args.regimes) if args.graph_ids is None else args.graph_ids
    for spec in args.tuning_variant:
        name, fields = tuning_variant(spec)
        TUNING_VARIANTS[name] = fields

    import mlx.core as mx

    gpu = mx.default_device().type == mx.gpu
    dtype = args.dtype or ("bfloat16" if gpu else "float32")
    variants = [v for v in args.variants.split(",") if v]
    for v in variants:
        variant_options(v)  # an unknown word fails before anything is built
    for d in (args.out, args.timeline_dir):
        if d:
            Path(d).mkdir(parents=True, exist_ok=True)
    routings = [r for r in args.routings.split(",") if r]
    res = {
        "command": " ".join([Path(sys.argv[0]).name] + list(argv)),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "device": str(mx.default_device()),
        "mlx": mx.__version__,
        "machine": platform.node(),
        "shape": args.shape,
        "layers": args.layers,
        "dtype": dtype,
        "rounds": args.rounds,
        "block": args.block,
        "tuning_variants": TUNING_VARIANTS,
        "graph_ids": GRAPH_IDS,
    }
    # the synthetic checkpoint's routings first, then each model:DIR's on its own checkpoint
    synthetic = [r for r in routings if not r.startswith("model:")]
    runs = [(None, synthetic)] if synthetic else []
    runs += [(r, [r]) for r in routings if r.startswith("model:")]
    res["checkpoints"] = {}
    groups = []
    res["groups"] = groups
    import random

    rng = random.Random(1)
    for model_spec, specs in runs:
        if model_spec is None:
            path = harness.checkpoint(
                Path(args.ckpt_dir), args.shape, dtype, layers=args.layers, top_k=6
            )
        else:
            path = Path(model_spec[len("model:") :])
        ck, files, stocks = open_checkpoint(path, args, variants, specs[0])
        name = "synthetic" if model_spec is None else harness.routing_label(model_spec)
        res["checkpoints"][name] = ck
        for k in ("total_expert_bytes", "expert_bytes", "moe_layers", "experts", "disk_gbps",
                  "disk_best_gbps"):
            res.setdefault(k, ck[k])  # the first checkpoint's, as before model:DIR
        if model_spec is None:
            stream = [rng.randrange(ck["vocab"]) for _ in range(4096)]
        else:
            model_prompt, stream = text_tokens(path, args.prompt or 28)
        prompts = {}
        for regime, spec, budget in plan(args, specs):
            if spec not in prompts and model_spec is None:
                routing = harness.make_routing(spec, ck["experts"], ck["moe_layers"])
                prompt_len = args.prompt or (
                    routing.decode_rows() if hasattr(routing, "decode_rows") else 28
                )
                prompts[spec] = [rng.randrange(ck["vocab"]) for _ in range(prompt_len)]
            prompt = prompts.get(spec) or model_prompt
            g = run_group(
                stocks, path, spec, budget, variants, args, ck, files, prompt, stream, regime
            )
            g.update(routing=spec, budget=budget, prompt_tokens=len(prompt), checkpoint=name)
            if spec.startswith("trace:") and variants and regime != "hit":
                slots = g["configs"][variants[0]]["slots"]
                rows = g["decode_rows"]
                g["replay"] = replay_figures(
                    spec, ck["moe_layers"], slots, len(prompt), rows["warmup"], rows["measured"]
                )
            summarize(g, ck)
            groups.append(g)
            res["groups"] = groups
            # regime -> "routing budget" -> config -> its ratio (and stock's own run-to-run)
            where = f"{routing_cell(spec)} {budget}"
            res.setdefault("summary", {}).setdefault(regime, {})[where] = {
                k: {
                    "ratio": round(c["ratio"], 4),
                    "exact": f"{c['exact_steps']}/{c['total_steps']}",
                    "hit_rate": c.get("hit_rate"),
                }
                for k, c in g["configs"].items()
            }
            save(res, args)  # after every group: a run cut short keeps what it measured
            log(table(dict(res, groups=[g])))  # this group's detailed rows
        del stocks
        gc.collect()
    print(regime_tables(res), flush=True)
    bad = [
        f"{g['regime']} {g['routing']} {g['budget']} {k}"
        for g in groups
        for k, c in g["configs"].items()
        if not c["exact"]
    ]
    if bad:
        log("NOT EXACT: " + "; ".join(bad))
    return res


def save(res, args):
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.tag}.json").write_text(json.dumps(res, indent=1, default=str))
    if res.get("groups"):
        (out / f"{args.tag}.md").write_text(markdown(res))


def summarize(g, ck):
    """limit, ratio to it (also the median of per-round ratios), read GB/s, paired ratios to the
    base variant; the regime's headline ratio per configuration (``ratio``): to stock for hit and
    ram, to the limit for cold (stock configurations: to stock). ``ck``: the checkpoint's figures
    (``open_checkpoint``); with its ram probe, ram rows get ``ram_limit`` (``ram_limit``)."""
    disk = ck["disk_best_gbps"] * GB
    stock = g["configs"]["stock"]["s_per_token"]
    for key, c in g["configs"].items():
        c["ratio"] = c["ratio_to_stock"]
        if "bytes_per_token" not in c:
            continue
        limit_s = max(stock, c["bytes_per_token"] / disk)
        c["limit_tok_s"] = 1 / limit_s
        c["ratio_to_limit"] = c["tok_s"] * limit_s
        # per round: the limit with that round's stock time, over this one's
        c["ratio_to_limit_median"] = statistics.median(
            max(r["stock"], c["bytes_per_token"] / disk) / r[key] for r in g["rounds"]
        )
        if g.get("regime", "cold") == "cold":
            c["ratio"] = c["ratio_to_limit_median"]
        if g.get("regime") == "ram" and ck.get("ram_probe"):
            ram_limit(c, stock, ck)
        c["read_gbps_in_waits"] = (
            c["bytes_per_token"] / c["io_wait_s_per_token"] / GB
            if c["io_wait_s_per_token"]
            else None
        )
        c["read_gbps_wall"] = c["bytes_per_token"] / c["s_per_token"] / GB
        # paired against "default" where it ran, else "staged": median over rounds of
        # (base's s per token / this one's), > 1 is faster
        base = next((b for b in ("default", "staged") if b in g["rounds"][0]), None)
        c["vs_base"] = base
        c["vs_base_paired"] = (
            statistics.median(r[base] / r[key] for r in g["rounds"]) if base else None
        )


def ram_limit(c, stock_s, ck) -> None:
    """``c["ram_limit"]``: 1 / (stock's step + missed bytes per token / the ram probe's parallel
    reads into slots, at the probed K nearest this row's misses per layer call), and this row's
    tok/s as a fraction of it."""
    probe = ck["ram_probe"]
    per_call = c["misses_per_token"] / ck["moe_layers"]
    figures = {k: probe["gbps"].get(f"slots k{k}") for k in probe["k"]}
    figures = {k: v for k, v in figures.items() if v}
    if not figures:
        return
    k = min(figures, key=lambda k: (abs(k - per_call), k))
    missed = c["misses_per_token"] * ck["expert_bytes"]
    limit_s = stock_s + missed / (figures[k] * 1e9)
    c["ram_limit"] = {
        "tok_s": 1 / limit_s,
        "of_limit": c["tok_s"] * limit_s,
        "k": k,
        "gbps": figures[k],
        "missed_bytes_per_token": missed,
        "misses_per_layer_call": per_call,
    }


SPLIT_SHORT = (
    ("ids wait", "ids"),
    ("host to submit", "host"),
    ("reads", "reads"),
    ("installs", "inst"),
    ("compute", "comp"),
    ("rest", "rest"),
    ("between layers", "between"),
)


def _split_cell(c, per):
    sp = (c.get("timeline") or {}).get("split") or {}
    ms = sp.get(per)
    if not ms:
        return ""
    keys = [k for k, _ in SPLIT_SHORT] + (["outside", "token"] if per == "ms per token" else [])
    return " / ".join(f"{ms.get(k, 0):.3f}" for k in keys)


def regime_tables(res):
    """One markdown table per regime (see ``markdown``)."""
    lines = []
    for regime in REGIMES:
        groups = [g for g in res["groups"] if g.get("regime", "cold") == regime]
        if not groups:
            continue
        against = "limit" if regime == "cold" else "stock"
        # ram: the ram limit (1 / (stock step + missed bytes per token / the probe's parallel
        # reads into slots)) and tok/s as a fraction of it
        ram = regime == "ram"
        lines += [
            "",
            f"### {regime}",
            "",
            f"| routing | budget | config | tok/s | ratio to {against} | "
            + ("ram limit tok/s (K) | of ram limit | " if ram else "")
            + "stock/stock | exact | hit "
            "| ms per layer: " + " / ".join(s for _, s in SPLIT_SHORT)
            + " | ms per token: same / outside / token |",
            "|---|---|---|---|---|---|---|---|---|---|" + ("---|---|" if ram else ""),
        ]
        for g in groups:
            routing = routing_cell(g["routing"])
            for key, c in g["configs"].items():
                hit = "" if c.get("hit_rate") is None else f"{c['hit_rate']:.3f}"
                ratio = c.get("ratio", c["ratio_to_stock"])
                lim = c.get("ram_limit")
                cells = ""
                if ram:
                    cells = (
                        f"{lim['tok_s']:.2f} ({lim['k']}) | {lim['of_limit']:.3f} | " if lim
                        else " | | "
                    )
                lines.append(
                    f"| {routing} | {g['budget']} | {key} | {c['tok_s']:.2f} | {ratio:.3f} | "
                    f"{cells}{g['stock_vs_stock']:.3f} | {c['exact_steps']}/{c['total_steps']} | "
                    f"{hit} | {_split_cell(c, 'ms per layer')} | {_split_cell(c, 'ms per token')} |"
                )
            for w in g.get("warnings", []):
                lines.append(f"\n{w}\n")
    return "\n".join(lines).lstrip("\n")


def markdown(res):
    cks = res.get("checkpoints") or {"synthetic": None}
    what = [f"{res.get('shape')} shape" if k == "synthetic" else k for k in cks]
    head = [
        f"# gpu_pipeline: {', '.join(what)}, {res.get('moe_layers')} MoE layers, "
        f"{res.get('dtype')}, {res.get('device')} (mlx {res.get('mlx')})",
        "",
        f"`{res['command']}` ({res['date']}; {res['rounds']} rounds of {res['block'] + 1} decode "
        f"steps per configuration; disk best {res['disk_best_gbps']:.2f} GB/s; routing ids "
        f"{'after the router (graph ids)' if res.get('graph_ids') else 'host data'})",
        "",
        "Regimes: hit = budget 0.99 (or --hit-budget), page cache warm, the rounds' steps decoded "
        "once before them with the same routing (replayed), so every expert they use is resident; "
        "ram = budget 0.90 (or --ram-budget), page cache warm, the rounds' steps decoded once "
        "before them (the cache filled); cold = page cache dropped before every token. Floors "
        "(stock, patched in the benchmark only): stock_synclayer = one np.array(router ids) per MoE "
        "layer, stock_synctoken = one mx.eval(logits) per token.",
        "",
        "Ratios: medians over rounds of per-round ratios; hit and ram to stock, cold to the limit "
        "(1 / max(stock's step, bytes per token / the disk's best GB/s)); stock configurations: "
        "to stock. stock/stock: the second stock model to the first (stock's run-to-run). exact: "
        "steps whose log-probabilities equal stock's bit for bit. Per-layer split (from the "
        "timeline, variants with `tl`): ids = waiting for the router's ids (host sync), host = host "
        "work from then to the layer's compute submission, reads = waits for reads, inst = "
        "installs, comp = submit + wait for compute, rest = the rest of the layer call, between = "
        "between MoE layer calls (attention, norms), per MoE layer call; per token, the same plus "
        "outside = the token's measured time outside its first to last MoE layer call (embedding, "
        "head, sampling, mlx-lm) and token = the measured time per token.",
        "",
    ]
    return (
        "\n".join(head + checkpoint_lines(res)) + "\n" + regime_tables(res) + "\n\n## Details\n\n"
        + table(res) + "\n"
    )


def checkpoint_lines(res):
    """A line per checkpoint (its expert size, disk probe, ram probe), where model:DIR ran."""
    cks = res.get("checkpoints") or {}
    if len(cks) < 2 and "synthetic" in cks:
        return _probe_lines(cks["synthetic"])
    lines = []
    for name, ck in cks.items():
        lines += [
            f"Checkpoint {name}: {ck['moe_layers']} MoE layers x {ck['experts']} experts, "
            f"{ck['expert_bytes'] / 1e6:.3f} MB per expert; disk best {ck['disk_best_gbps']:.2f} "
            "GB/s.",
            "",
        ] + _probe_lines(ck)
    return lines


def _probe_lines(ck):
    probe = ck.get("ram_probe")
    if not probe:
        return []
    return [
        f"Ram probe ({probe['layer']}, {probe['expert_bytes'] / 1e6:.3f} MB per expert, page "
        "cache warm; GB/s decimal): "
        + ", ".join(f"{k} {v:.2f}" for k, v in probe["gbps"].items())
        + ". ram limit = 1 / (stock step + missed bytes per token / slots kK GB/s), K the probed "
        "count nearest the row's misses per layer call.",
        "",
    ]


def _ahead(p):
    """ "used/staged (precision)" of the lookahead's reads, per run."""
    if not p:
        return ""
    prec = p.get("lookahead_precision")
    tail = f" ({prec:.2f})" if prec is not None else ""
    return f"{p.get('lookahead_used', 0)}/{p.get('lookahead_staged', 0)}{tail}"


def table(res):
    lines = [
        f"disk best {res['disk_best_gbps']:.2f} GB/s; {res['moe_layers']} layers, "
        f"{res['expert_bytes'] / MB:.2f} MB per expert",
        "| regime | routing | budget | config | tok/s | limit | ratio | hit | MB/token | io ms | install ms | "
        "store ms | call ms | GB/s in waits | vs base | ahead used/staged (prec) | exact steps |",
        "|" + "---|" * 17,
    ]
    for g in res["groups"]:
        routing = routing_cell(g["routing"])
        for key, c in g["configs"].items():
            same = f"{sum(c['same_as_stock'])}/{len(c['same_as_stock'])}"
            if "bytes_per_token" not in c:
                lines.append(
                    f"| {g.get('regime', 'cold')} | {routing} | {g['budget']} | {key} | {c['tok_s']:.2f} | | | | | | | | "
                    f"{c['call_s_per_token'] * 1e3:.1f} | | | | {same} |"
                )
                continue
            lines.append(
                f"| {g.get('regime', 'cold')} | {routing} | {g['budget']} | {key} | {c['tok_s']:.2f} | {c['limit_tok_s']:.2f} | "
                f"{c['ratio_to_limit']:.3f} | {c['hit_rate']:.3f} | {c['bytes_per_token'] / MB:.1f} | "
                f"{c['io_wait_s_per_token'] * 1e3:.1f} | {c['install_s_per_token'] * 1e3:.1f} | "
                f"{c['store_s_per_token'] * 1e3:.1f} | {c['call_s_per_token'] * 1e3:.1f} | "
                f"{(c['read_gbps_in_waits'] or 0):.2f} | {(c['vs_base_paired'] or 0):.3f} | "
                f"{_ahead(c.get('prefetch') or {})} | {same} |"
            )
        if "replay" in g:
            lines.append(f"replay ({g['routing']}, {g['budget']}): {g['replay']}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
