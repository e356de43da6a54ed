"""Expert streaming benchmark: ours vs stock resident and vs the seed designs, side by side in one run.

    python bench/experts.py [--quick] [--device-kind cpu|gpu] [--archs qwen3,mixtral,dsv2]
                            [--ckpt-dir DIR] [--out docs/benchmarks] [--tag NAME]

For each architecture a synthetic checkpoint with the real expert shapes is built once (stock mlx-lm
classes, random weights, affine 4-bit, group 64; float32 on CPU, bfloat16 on GPU) under ``--ckpt-dir``:

- ``qwen3``:   Qwen3-30B-A3B experts (hidden 2048, moe_intermediate 768, 128 experts, top 8), 4 of 48 layers
- ``mixtral``: Mixtral-8x7B experts (hidden 4096, intermediate 14336, 8 experts, top 2), 2 of 32 layers
- ``dsv2``:    DeepSeek-V2-Lite experts (hidden 2048, moe_intermediate 1408, 64 routed + 2 shared, top 6),
               4 of 27 layers, all MoE

The vocabulary is 512 tokens (the head is not what is measured). In one process, every configuration
is loaded, then timed in interleaved rounds (each round runs every configuration once), so noise from
a shared machine hits them alike; ratios are medians of per-round ratios.

Configurations: ``stock`` (mlx-lm, every weight resident); ``warm`` (ours, budget = every expert, after
the background fill completed); ``cold`` (ours, budget = 25% of the expert bytes, the checkpoint
dropped from the page cache with ``posix_fadvise(DONTNEED)`` before every token, so every miss reads
the disk); the seeds ``seed_loop`` and ``seed_stack`` (``bench/seeds.py``) under the same cold
conditions; and ablations (``cold_nolookahead``, ``warm_sync``, ``cold_packed``, ...).

Measured: decode tok/s; prefill of a 512-token prompt (stock, warm, cold with empty banks and cold
page cache); bytes read per token; hit rate; seconds waiting for I/O vs the rest; lookahead
precision / recall; the disk's own bandwidth for reads of one expert (1 and 4 threads, buffered and
O_DIRECT); peak RSS of stock / warm / cold, each in a process of its own. With uniform or trace
routing, the cold configuration's own rows are replayed offline through its policy, LRU and Belady
at its slots per layer, and the GB/s its reads achieved is reported beside the disk's. Writes
``<out>/<tag>.json``, ``<out>/<tag>.md`` and ``<out>/<tag>.png``.
"""

import argparse
import gc
import hashlib
import json
import math
import mmap
import os
import platform
import random
import resource
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

GB = 1 << 30
MB = 1 << 20
COLD_SHARE = 0.25
PREFILL_TOKENS = 512

ARCHS = {
    "qwen3": dict(
        label="Qwen3-30B-A3B",
        arch="qwen3_moe",
        layers=4,
        real_layers=48,
        overrides={
            "hidden": 2048,
            "moe_intermediate": 768,
            "experts": 128,
            "top_k": 8,
            "heads": 32,
            "kv_heads": 4,
            "head_dim": 128,
        },
    ),
    "mixtral": dict(
        label="Mixtral-8x7B",
        arch="mixtral",
        layers=2,
        real_layers=32,
        overrides={
            "hidden": 4096,
            "moe_intermediate": 14336,
            "experts": 8,
            "top_k": 2,
            "heads": 32,
            "kv_heads": 8,
            "head_dim": 128,
        },
    ),
    "dsv2": dict(
        label="DeepSeek-V2-Lite",
        arch="deepseek_v2",
        layers=4,
        real_layers=27,
        overrides={
            "hidden": 2048,
            "moe_intermediate": 1408,
            "experts": 64,
            "top_k": 6,
            "n_shared_experts": 2,
            "heads": 16,
            "kv_heads": 16,
            "kv_lora_rank": 512,
            "q_lora_rank": None,
            "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64,
            "v_head_dim": 128,
            "topk_method": "greedy",
            "n_group": 1,
            "topk_group": 1,
            "first_k_dense_replace": 0,
        },
    ),
}


def log(*a):
    print(*a, file=sys.stderr, flush=True)


# -- checkpoints and the page cache ---------------------------------------------------------------


def checkpoint(
    ckpt_dir: Path, name: str, dtype: str, layers=None, top_k=None, experts=None
) -> Path:
    """The checkpoint of shape ``name`` (``layers``, ``top_k``, ``experts`` per layer: other than
    the shape's, for trace routing), built once."""
    spec = ARCHS[name]
    layers = layers or spec["layers"]
    overrides = dict(spec["overrides"])
    k = "" if top_k in (None, overrides["top_k"]) else f"-k{top_k}"
    e = "" if experts in (None, overrides["experts"]) else f"-e{experts}"
    overrides["top_k"] = top_k or overrides["top_k"]
    overrides["experts"] = experts or overrides["experts"]
    path = ckpt_dir / f"{name}-{layers}l{k}{e}-{dtype}"
    if (path / ".complete").is_file():
        return path
    from mlx_lm_streaming.synthetic import build_checkpoint

    log(f"building {path} ({spec['label']} experts, {layers} layers, {dtype}) ...")
    start = time.time()
    build_checkpoint(
        path,
        spec["arch"],
        "affine4",
        num_layers=layers,
        overrides=overrides,
        dtype=dtype,
    )
    (path / ".complete").write_text("ok")
    log(f"built in {time.time() - start:.0f} s")
    return path


def shards(path: Path):
    return sorted(Path(path).glob("model*.safetensors"))


def drop_page_cache(files) -> float:
    """Drop ``files`` from the OS page cache; returns the seconds it took."""
    start = time.perf_counter()
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return time.perf_counter() - start


# -- disk bandwidth -------------------------------------------------------------------------------


def disk_bandwidth(files, read_bytes: int, total_bytes: int, threads: int, direct: bool):
    """GB/s of random ``read_bytes`` reads (4 KiB-aligned offsets), page cache dropped first."""
    read_bytes = -(-read_bytes // 4096) * 4096
    n = max(4, total_bytes // read_bytes)
    sizes = [os.path.getsize(f) for f in files]
    rng = random.Random(0)
    jobs = []
    for _ in range(n):
        i = rng.randrange(len(files))
        off = rng.randrange(0, max(1, sizes[i] - read_bytes)) // 4096 * 4096
        jobs.append((i, off))
    drop_page_cache(files)
    flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)
    fds = [os.open(f, flags) for f in files]
    bufs = [mmap.mmap(-1, read_bytes) for _ in range(threads)]

    def read(t, job):
        i, off = job
        return os.preadv(fds[i], [bufs[t]], off)

    start = time.perf_counter()
    try:
        if threads == 1:
            got = sum(read(0, j) for j in jobs)
        else:
            with ThreadPoolExecutor(threads) as pool:
                got = sum(pool.map(lambda a: read(a[0] % threads, a[1]), enumerate(jobs)))
    finally:
        for fd in fds:
            os.close(fd)
    seconds = time.perf_counter() - start
    return got / seconds / GB


# -- configurations -------------------------------------------------------------------------------


class Config:
    """One model under test, with its own KV cache and counters."""

    def __init__(self, name, model, cold=False, files=(), lru=None):
        self.name = name
        self.model = model
        self.cold = cold
        self.files = files
        self.lru = lru  # seeds
        self.kv = None
        self.routing = None
        self.stream = None
        self.pos = 0
        self.decode_s = []  # per token
        self.tokens = []
        self.drop_s = 0.0
        self.stats0 = None
        self.calls = None  # CallLog of the routing's ids (cold, routing replaced)
        self.decode_from = 0
        self.spans = None  # ReadSpans of the store (cold)

    @property
    def cache(self):
        state = getattr(self.model, "expert_streaming", None)
        return None if state is None or self.lru is not None else state.cache

    def counters(self):
        if self.lru is not None:
            return {
                "hits": self.lru.hits,
                "misses": self.lru.misses,
                "bytes_read": self.lru.bytes_read,
                "io_wait_seconds": self.lru.io_seconds,
            }
        cache = self.cache
        if cache is None:
            return {}
        s = cache.summary()
        return {
            "hits": s["hits"],
            "misses": s["misses"],
            "bytes_read": cache.store.stats.bytes_read,
            "store_read_seconds": cache.store.stats.seconds,
            "io_wait_seconds": s["io_wait_seconds"],
            "install_seconds": s["install_seconds"],
            "prefetch": _prefetch_counts(cache),
        }


def _prefetch_counts(cache):
    p = cache._prefetcher
    if p is None:
        return {}
    st = p.stats
    return {
        "lookahead_staged": st.staged["lookahead"],
        "lookahead_used": st.used["lookahead"],
        "wave_staged": st.staged["wave"],
        "wave_used": st.used["wave"],
        "predicted": st.predicted,
        "predicted_hit": st.predicted_hit,
        "demand": st.demand,
        "dropped": st.dropped,
        "staged_wait_s": st.waited_s,
    }


def precision_recall(p):
    if not p:
        return {}
    pred, hit, demand = p.get("predicted", 0), p.get("predicted_hit", 0), p.get("demand", 0)
    return {
        "lookahead_precision": hit / pred if pred else None,
        "lookahead_recall": hit / demand if demand else None,
        **p,
    }


class ForcedRouting:
    """Replaces a layer's router choice by uniformly random experts, the same in every configuration.

    A random-weight model routes almost every token to the same few experts (measured: Mixtral-shaped,
    2 experts for every token; Qwen3-shaped, ~35 distinct experts of 128 over 64 tokens past layer 0),
    which would leave nothing to stream. Uniform routing is the hard case instead: a 25% budget hits
    25% of the time, and no router predicts the next layer. The choice depends only on (layer, call
    number), so every configuration computes the same thing and logits stay comparable."""

    def __init__(self, num_experts: int, seed: int = 0):
        self.num_experts = num_experts
        self.seed = seed
        self.calls = {}

    def wrap(self, model):
        import mlx.nn as nn
        from mlx_lm.models.switch_layers import SwitchGLU

        from mlx_lm_streaming.switch import StreamingSwitchGLU

        import seeds
        from routing_replay import routed

        kinds = (SwitchGLU, StreamingSwitchGLU, seeds._SeedSwitch)
        found = [(p, m) for p, m in model.named_modules() if isinstance(m, kinds)]
        for layer_no, (path, module) in enumerate(found):
            parent = model
            parts = path.split(".")
            for q in parts[:-1]:
                parent = parent[int(q)] if isinstance(parent, list) else parent[q]
            parent[parts[-1]] = routed(module, self, layer_no)
        return len(found)

    def reset(self):
        self.calls = {}

    def indices(self, layer_no, shape):
        import mlx.core as mx

        from routing_replay import taken

        pick = self.peek(layer_no, shape)
        self.calls[layer_no] = self.calls.get(layer_no, 0) + 1
        taken(self, layer_no, 1)
        return mx.array(pick)

    def unwind(self, layer_no, calls):
        self.calls[layer_no] -= calls

    def peek(self, layer_no, shape):
        """What ``indices`` will return next for layer ``layer_no``, without taking it (numpy)."""
        import numpy as np

        rng = np.random.default_rng([self.seed, layer_no, self.calls.get(layer_no, 0)])
        rows = int(np.prod(shape[:-1]))
        pick = np.argsort(rng.random((rows, self.num_experts)), axis=-1)[:, : shape[-1]]
        return pick.astype(np.uint32).reshape(shape)


def make_routing(routing: str, num_experts: int, layers: int, fold=None):
    """The routing a configuration replays (``--routing``): ``ForcedRouting``, a trace's
    (``routing_replay.TraceRouting``: with fewer layers than the trace, its first ones; ``fold`` =
    (experts, top_k): the trace folded onto them, ``routing_replay.fold_trace``), or None."""
    if routing == "uniform":
        return ForcedRouting(num_experts)
    if routing.startswith("trace:"):
        from routing_replay import TraceRouting, fold_trace, read_trace

        trace = read_trace(routing[len("trace:") :])
        if fold is not None:
            trace = fold_trace(trace, *fold)
        return TraceRouting(trace, layers=None if layers == trace.num_layers else layers)
    return None


def routing_label(routing: str, fold=None, layers=None) -> str:
    """How a run's routing is named in its report."""
    if not routing.startswith("trace:"):
        return routing
    label = f"trace {Path(routing[len('trace:') :]).name}"
    if layers:
        label += f", its first {layers} MoE layers"
    if fold:
        label += (
            f", folded onto {fold[0]} experts, top {fold[1]} (id % {fold[0]}, the first "
            f"{fold[1]} distinct ids in rank order): a real trace's reuse, not this model's routing"
        )
    return label


class CallLog:
    """The expert ids a configuration's routing passed each MoE layer, call by call (taken with the
    routing's ``peek`` just before its ``indices``: the very ids the layer computed), so that the
    same rows can be replayed offline through LRU and Belady (``replay_figures``)."""

    def __init__(self, routing):
        self.calls = {}
        take = routing.indices

        def indices(layer_no, shape):
            import numpy as np

            ids = np.asarray(routing.peek(layer_no, shape)).reshape(-1, shape[-1])
            self.calls.setdefault(layer_no, []).append(ids.copy())
            return take(layer_no, shape)

        routing.indices = indices

    def clear(self):
        self.calls = {}

    def rows(self) -> int:
        return min((sum(len(c) for c in calls) for calls in self.calls.values()), default=0)


def replay_figures(log: CallLog, decode_from: int, slots, num_experts: int, policy: str):
    """Decode hit rates of the cold configuration's own rows (``log``: from its cold start, the
    rows before ``decode_from`` warm the tables and are not counted) replayed through the package's
    slot tables with its own policy, LRU and Belady's offline optimum, at its slots per layer."""
    from routing_replay import trace_of_calls

    from mlx_lm_streaming import replay as rp

    trace = trace_of_calls(log.calls, num_experts, decode_from)
    rows = len(trace.rows)
    return {
        "rows_warm": decode_from,
        "rows_decode": rows - decode_from,
        "slots": list(slots),
        "num_experts": num_experts,
        "top_k": trace.top_k,
        "policy": policy,
        "policy_hit_rate": rp.replay(trace, slots, policy).hit_rate("decode"),
        "lru_hit_rate": rp.replay(trace, slots, "lru").hit_rate("decode"),
        "belady_hit_rate": rp.belady(trace, slots).hit_rate("decode"),
        "random_hit_rate": sum(slots) / len(slots) / num_experts,
    }


class ReadSpans:
    """When each of a store's reads ran (its ``stats.add`` reports a read's bytes and seconds as it
    ends): the union of their spans is the wall time at least one read was in flight."""

    def __init__(self, store):
        self.spans = []
        add = store.stats.add

        def record(reads, nbytes, seconds):
            end = time.perf_counter()
            self.spans.append((end - seconds, end, nbytes))
            add(reads, nbytes, seconds)

        store.stats.add = record

    def clear(self):
        self.spans = []

    def figures(self):
        """bytes, summed read seconds, and seconds with a read in flight."""
        from timeline_summary import span_union

        spans = list(self.spans)
        return {
            "bytes": sum(n for _, _, n in spans),
            "read_seconds": sum(b - a for a, b, _ in spans),
            "in_flight_seconds": span_union((a, b) for a, b, _ in spans),
            "reads": len(spans),
        }


def routing_arg(value: str) -> str:
    """One or more of uniform, model, trace:FILE, comma-separated (each is run in turn)."""
    for one in value.split(","):
        if one in ("uniform", "model"):
            continue
        if one.startswith("trace:"):
            from mlx_lm_streaming.routing_trace import TraceError, read_trace

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


def delta(a, b):
    out = {}
    for k, v in b.items():
        if isinstance(v, (int, float)) and k in a:
            out[k] = v - a[k]
        elif isinstance(v, dict) and k in a:
            out[k] = delta(a[k], v)
        else:
            out[k] = v
    return out


def reset_banks(model):
    """Empty every slot bank (as after load) and zero the counters, keeping the model."""
    from mlx_lm_streaming.expert_cache import CacheStats

    cache = model.expert_streaming.cache
    cache.ensure_planned()
    for bank in cache.banks:
        bank.allocate(bank.slots)
    cache.stats = CacheStats()


def prefill(cfg, tokens):
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    kv = make_prompt_cache(cfg.model)
    start = time.perf_counter()
    logits = cfg.model(tokens[None], cache=kv)
    mx.eval(logits)
    return time.perf_counter() - start, kv, logits


class ForcedSampler:
    """Feeds a fixed random token stream (the same for every configuration) instead of sampling.

    Greedy decoding of a random-weight model soon repeats one token, hence one routing, and every
    expert would be a hit; a random stream routes like varied text (worse than real text, which
    reuses experts more). Each step's log-probabilities are recorded (hashed bit for bit) to check
    that every configuration computes exactly what stock mlx-lm computes."""

    def __init__(self, stream, start):
        self.stream = stream
        self.i = start
        self.argmax = []

    def __call__(self, logprobs):
        import mlx.core as mx

        self.argmax.append(logprobs)  # kept lazily; hashed bit for bit after the block
        tok = self.stream[self.i % len(self.stream)]
        self.i += 1
        return mx.array([tok], dtype=mx.uint32)


def decode_block(cfg, n):
    """Decode steps with mlx-lm's generate_step (async pipelining and all), continuing ``cfg``'s KV
    cache, fed the forced token stream. generate_step(max_tokens=n) runs n + 1 single-token steps
    (it computes one step ahead of what it yields); all are timed, through a final synchronize, so
    nothing of this configuration runs into the next one's timing. Returns seconds per step."""
    import mlx.core as mx
    import numpy as np
    from mlx_lm.generate import generate_step

    sampler = ForcedSampler(cfg.stream, cfg.pos)
    prompt = mx.array([cfg.stream[cfg.pos - 1]])
    if cfg.cold:
        cfg.drop_s += drop_page_cache(cfg.files)
    excluded = 0.0
    start = time.perf_counter()
    for _ in generate_step(prompt, cfg.model, max_tokens=n, prompt_cache=cfg.kv, sampler=sampler):
        if cfg.cold:
            # generate_step builds step i+1 (host syncs and reads included) before it yields step
            # i, so a drop here precedes every read of step i+2: every step reads from the disk.
            # The drop itself is left out of the timing.
            d = drop_page_cache(cfg.files)
            cfg.drop_s += d
            excluded += d
    mx.synchronize()
    seconds = time.perf_counter() - start - excluded
    steps = sampler.i - cfg.pos
    cfg.pos = sampler.i
    cfg.tokens.extend(
        hashlib.sha1(np.array(lp.view(mx.uint8)).tobytes()).hexdigest()[:16]
        for lp in sampler.argmax
    )
    return [seconds / steps] * steps


# -- one architecture, paired ---------------------------------------------------------------------


def load_stock(path):
    import mlx_lm.utils

    from mlx_lm_streaming.integration import install

    install()
    model, config = mlx_lm.utils.load_model(Path(path), model_config={"streaming_experts": False})
    assert not hasattr(model, "expert_streaming")
    return model, config


DIRECT_READS = "auto"  # --direct-reads: the option for every streaming configuration


def load_streaming(path, **options):
    import mlx_lm.utils

    from mlx_lm_streaming.integration import install

    install()
    if DIRECT_READS != "auto":
        options.setdefault("direct_reads", DIRECT_READS == "on")
    return mlx_lm.utils.load_model(Path(path), model_config={"streaming_experts": options})


def run_arch(name, path, args, device):
    import mlx.core as mx
    import seeds

    from mlx_lm_streaming.expert_cache import CacheTuning

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
    cold_gb = COLD_SHARE * total_expert / GB
    cold_slots = int(COLD_SHARE * total_expert) // per_slot
    res["cold_budget_bytes"] = cold_slots * per_slot
    res["cold_slots"] = cold_slots

    # the disk's own bandwidth for reads of one expert
    total = (
        min(512 * MB, res["checkpoint_bytes"])
        if not args.quick
        else min(256 * MB, res["checkpoint_bytes"])
    )
    bw = {}
    for threads in (1, 4, 8):
        for direct in (False, True):
            try:
                bw[f"t{threads}{'_direct' if direct else ''}"] = disk_bandwidth(
                    files, expert_nbytes, total, threads, direct
                )
            except OSError as e:
                bw[f"t{threads}{'_direct' if direct else ''}"] = None
                log(f"disk bandwidth threads={threads} direct={direct}: {e}")
    res["disk_gbps"] = bw
    disk = max(v for v in bw.values() if v)
    res["disk_best_gbps"] = disk
    log(f"[{name}] disk GB/s: {bw}")

    configs = {"stock": Config("stock", stock)}
    warm, _ = load_streaming(path, expert_cache_gb=total_expert / GB * 1.001)
    configs["warm"] = Config("warm", warm)
    sopts = {"store_options": {"threads": args.store_threads}} if args.store_threads else {}
    cold, _ = load_streaming(path, expert_cache_gb=cold_gb, **sopts)
    configs["cold"] = Config("cold", cold, cold=True, files=files)
    ablations = args.ablations
    if "stock_again" in ablations:
        # a second stock model, timed like the others: stock vs stock_again is the run's noise floor
        m, _ = load_stock(path)
        configs["stock_again"] = Config("stock_again", m)
    if "warm_sync" in ablations:
        m, _ = load_streaming(
            path, expert_cache_gb=total_expert / GB * 1.001, tuning=CacheTuning(skip_sync=False)
        )
        configs["warm_sync"] = Config("warm_sync", m)
    for threads in (4, 8):
        if f"cold_t{threads}" in ablations:
            m, _ = load_streaming(path, expert_cache_gb=cold_gb, store_options={"threads": threads})
            configs[f"cold_t{threads}"] = Config(f"cold_t{threads}", m, cold=True, files=files)
    for hint in ("prefetch", "host"):
        # CUDA unified-memory hints with direct reads (bench/cuda_uvm.py)
        if f"cold_uvm_{hint}" in ablations:
            import cuda_uvm

            tuning = CacheTuning(**cuda_uvm.hint_hooks(hint))
            m, _ = load_streaming(
                path, expert_cache_gb=cold_gb, direct_reads=True, tuning=tuning, **sopts
            )
            configs[f"cold_uvm_{hint}"] = Config(f"cold_uvm_{hint}", m, cold=True, files=files)
    if "cold_nophase" in ablations:
        # every expert read whole (by default experts of 16 MB and more are read a projection at a
        # time where partial calls are exact: switch.py ``_by_projection``)
        tuning = CacheTuning(phase_min_bytes=None)
        m, _ = load_streaming(path, expert_cache_gb=cold_gb, tuning=tuning, **sopts)
        configs["cold_nophase"] = Config("cold_nophase", m, cold=True, files=files)
    if "cold_staged" in ablations:
        # demand reads through staging buffers and an MLX copy into the banks (before direct reads)
        m, _ = load_streaming(path, expert_cache_gb=cold_gb, direct_reads=False, **sopts)
        configs["cold_staged"] = Config("cold_staged", m, cold=True, files=files)
    if "cold_hitsfirst" in ablations:
        # a decode call's hits' rows submitted before its reads are issued (before 2026-12-01)
        tuning = CacheTuning(reads_first=False)
        m, _ = load_streaming(path, expert_cache_gb=cold_gb, tuning=tuning, **sopts)
        configs["cold_hitsfirst"] = Config("cold_hitsfirst", m, cold=True, files=files)
    if "cold_nolookahead" in ablations:
        tuning = CacheTuning(lookahead=False)
        m, _ = load_streaming(path, expert_cache_gb=cold_gb, tuning=tuning, **sopts)
        configs["cold_nolookahead"] = Config("cold_nolookahead", m, cold=True, files=files)
    for store, label in (("packed", "cold_packed"), ("packed_direct", "cold_packed_direct")):
        if label in ablations:
            opts = {"direct": True} if store == "packed_direct" else {}
            if args.store_threads:
                opts["threads"] = args.store_threads
            # crc32 of each expert's first read is left out: it is CPU time (2.2 GB/s here), not I/O
            opts["verify"] = "off"
            try:
                m, _ = load_streaming(
                    path, expert_cache_gb=cold_gb, store="packed", store_options=opts
                )
            except Exception as e:  # no pack file yet, or the store is missing
                log(f"[{name}] {label} skipped: {e}")
                continue
            configs[label] = Config(label, m, cold=True, files=pack_files(path))
    for kind in ("seed_loop", "seed_stack"):
        if kind in args.seeds:
            m, _ = load_streaming(path, expert_cache_gb=cold_gb, **sopts)
            lru = seeds.install(m, res["cold_budget_bytes"], kind)
            configs[kind] = Config(kind, m, cold=True, files=files, lru=lru)

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
            if not cfg.name.startswith("seed_"):
                prefill(cfg, long)
    for key in ("warm", "warm_sync"):
        if key in configs:
            cfg = configs[key]
            start = time.perf_counter()
            calls = 0
            cache = cfg.model.expert_streaming.cache
            while True:
                prefill(cfg, short)
                calls += 1
                if all(b.complete for b in cache.banks) or calls > 200:
                    break
                time.sleep(0.05)
            res[f"{key}_fill"] = {
                "seconds": time.perf_counter() - start,
                "calls": calls,
                "complete": all(b.complete for b in cache.banks),
            }
            log(f"[{name}] {key} filled: {res[f'{key}_fill']}")

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
            n = 1 if key.startswith("seed_stack") else args.block
            times = decode_block(cfg, n)
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
    from mlx_lm_streaming import prefetch

    # whether staging buffers are MLX memory written through host views (else numpy + a copy)
    res["staging_host_views"] = prefetch._HOST_VIEWS
    # whether the cold configuration read straight into its banks (host views of MLX memory)
    res["direct_reads"] = all(b.direct for b in cold.expert_streaming.cache.banks)
    if any(k.startswith("cold_uvm_") for k in configs):
        import cuda_uvm

        bank = cold.expert_streaming.cache.banks[0]
        view = bank.views[0] if bank.views else None
        res["uvm_hints_work"] = bool(view is not None and cuda_uvm.prefetch(view.ctypes.data, 4096))
        res["uvm_last_error"] = cuda_uvm.last_error()
    res["ratios"] = ratios(res, rounds)
    del configs, stock, warm, cold
    gc.collect()
    return res


def paired(rounds, num, den):
    """Median over rounds of (time of ``den``) / (time of ``num``): speed of num relative to den."""
    vals = [r[den] / r[num] for r in rounds if num in r and den in r]
    return statistics.median(vals) if vals else None


def ratios(res, rounds):
    dec = res["decode"]
    disk = res["disk_best_gbps"] * GB
    out = {}
    out["warm_vs_stock"] = paired(rounds, "warm", "stock")
    # cold: limit per token = max(stock compute time, bytes the misses need / disk bandwidth)
    limits = []
    for r in rounds:
        if "cold" in r:
            io = dec["cold"]["miss_bytes_per_token"] / disk
            limits.append(max(r["stock"], io) / r["cold"])
    out["cold_vs_limit"] = statistics.median(limits) if limits else None
    out["cold_limit_io_s_per_token"] = dec["cold"]["miss_bytes_per_token"] / disk
    # the same limit from the run's totals: limit tok/s = 1 / max(stock s per token, miss bytes per
    # token / disk); cold tok/s over it (the median of per-round ratios above weighs rounds alike)
    limit_s = max(dec["stock"]["s_per_token_mean"], out["cold_limit_io_s_per_token"])
    out["cold_limit_tok_s"] = 1 / limit_s
    out["cold_vs_limit_totals"] = dec["cold"]["tok_s"] / out["cold_limit_tok_s"]
    for key in dec:
        if key != "stock":
            out[f"{key}_vs_stock"] = paired(rounds, key, "stock")
    for seed in ("seed_loop", "seed_stack"):
        if seed in dec:
            out[f"cold_vs_{seed}"] = paired(rounds, "cold", seed)
    pre = res["prefill_s"]
    if "cold" in pre:
        read_once = res["total_expert_bytes"] / disk
        out["prefill_limit_s"] = max(pre["stock"], read_once)
        out["prefill_cold_vs_limit"] = out["prefill_limit_s"] / pre["cold"]
    if "warm" in pre:
        out["prefill_warm_vs_stock"] = pre["stock"] / pre["warm"]
    return out


# -- peak RSS, one process per configuration ------------------------------------------------------


def peak_rss() -> int:
    """This process's peak RSS in bytes (VmHWM: ru_maxrss would include the parent's, kept over exec)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def num_experts(model):
    from mlx_lm.models.switch_layers import SwitchGLU

    from mlx_lm_streaming.switch import StreamingSwitchGLU

    for _, m in model.named_modules():
        if isinstance(m, StreamingSwitchGLU):
            return m.num_experts
        if isinstance(m, SwitchGLU):
            return m.gate_proj["weight"].shape[0]
    raise ValueError("no MoE layer")


def rss_child(path, which, prefill_tokens, decode_tokens, routing, store_threads=None):
    import mlx.core as mx
    import mlx_lm.generate  # noqa: F401  (imports are the interpreter's, not the model's memory)
    import mlx_lm.utils  # noqa: F401

    from mlx_lm_streaming.integration import install

    install()
    base = peak_rss()
    if which == "stock":
        model, config = load_stock(path)
        budget = 0
        resident = None
    else:
        probe, config = load_streaming(path, expert_cache_gb=1e6)
        total = probe.expert_streaming.cache.total_expert_bytes
        del probe
        gc.collect()
        gb = total / GB * (1.001 if which == "warm" else COLD_SHARE)
        drop_page_cache(shards(path))
        sopts = {"store_options": {"threads": store_threads}} if store_threads else {}
        model, config = load_streaming(path, expert_cache_gb=gb, **sopts)
        cache = model.expert_streaming.cache
        cache.ensure_planned()
        budget = cache.resident_bytes
        resident = model.expert_streaming.resident_bytes
    vocab = config.get("vocab_size") or config["text_config"]["vocab_size"]
    rng = random.Random(1)
    tokens = mx.array([rng.randrange(vocab) for _ in range(prefill_tokens)])
    from mlx_lm.generate import generate_step

    fold = None
    if routing.startswith("trace:"):
        from routing_replay import _expert_counts, read_trace

        experts, top_k = _expert_counts(model)
        if read_trace(routing[len("trace:") :]).num_experts != experts:
            fold = (experts, top_k)  # as the run's --trace-fold
    forced = make_routing(routing, num_experts(model), len(model.layers), fold=fold)
    if forced is not None:
        forced.wrap(model)

    for _ in generate_step(tokens, model, max_tokens=decode_tokens):
        pass
    peak = peak_rss()
    out = {
        "which": which,
        "peak_rss": peak,
        "rss_after_imports": base,
        "budget": budget,
        "resident_bytes": resident,
        "mlx_peak": mx.get_peak_memory(),
    }
    if which != "stock":
        out["staging_limit"] = model.expert_streaming.cache.prefetcher.max_bytes
    print("RSS_JSON " + json.dumps(out), flush=True)


def measure_rss(path, args):
    out = {}
    for which in ("stock", "warm", "cold"):
        cmd = [
            sys.executable,
            __file__,
            "--rss-child",
            which,
            "--rss-path",
            str(path),
            "--rss-prefill",
            str(min(args.prefill_tokens, 64) if args.device_kind == "cpu" else args.prefill_tokens),
            "--rss-decode",
            str(8),
            "--routing",
            args.routing,
            "--direct-reads",
            args.direct_reads,
        ]
        if args.device_kind == "gpu":
            cmd += ["--device-kind", "gpu"]
        if args.store_threads:
            cmd += ["--store-threads", str(args.store_threads)]
        p = subprocess.run(cmd, capture_output=True, text=True)
        line = [l for l in p.stdout.splitlines() if l.startswith("RSS_JSON ")]
        if p.returncode or not line:
            log(f"rss child {which} failed: {p.stderr[-2000:]}")
            continue
        out[which] = json.loads(line[-1][9:])
        log(f"rss {which}: {out[which]['peak_rss'] / GB:.2f} GB")
    return out


def pack_files(path):
    return sorted(Path(path).glob("*.pack"))


# -- report ---------------------------------------------------------------------------------------


TARGETS = [
    ("warm decode vs stock resident", "warm_vs_stock", ">= 0.95 (GPU: >= 0.9)"),
    ("cold decode vs max(stock compute, miss bytes / disk bandwidth)", "cold_vs_limit", ">= 0.87"),
    (
        "prefill (cold) vs max(stock prefill, reading each expert once)",
        "prefill_cold_vs_limit",
        ">= 0.75",
    ),
    ("peak RSS (cold) vs resident weights + cache budget", "rss_cold_over_budget", "<= +15%"),
]


def fmt(v, pct=False):
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    if pct:
        return f"{v:+.0%}"
    return f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"


def _spread(res):
    """min-max over rounds of the paired decode ratios, and the ratio of each configuration's fastest
    round (on a shared machine other load only slows a round down), as text."""
    rounds = res.get("rounds") or []
    out = {}

    def span(vals):
        return f"rounds {min(vals):.2f}-{max(vals):.2f}" if vals else None

    def best(key):
        return min(r[key] for r in rounds)

    if rounds and "stock_again" in rounds[0]:
        out["stock_again_vs_stock"] = span([r["stock"] / r["stock_again"] for r in rounds])
    if rounds and "warm" in rounds[0]:
        out["warm_vs_stock"] = span([r["stock"] / r["warm"] for r in rounds])
        out["warm_vs_stock"] += f"; fastest rounds {best('stock') / best('warm'):.2f}"
    dec = res.get("decode", {})
    if rounds and "cold" in rounds[0] and "cold" in dec:
        io = dec["cold"]["miss_bytes_per_token"] / (res["disk_best_gbps"] * GB)
        out["cold_vs_limit"] = span([max(r["stock"], io) / r["cold"] for r in rounds])
        out["cold_vs_limit"] += f"; fastest rounds {max(best('stock'), io) / best('cold'):.2f}"
    return {k: v for k, v in out.items() if v}


def _pct(v):
    return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.1%}"


def _gbps(v):
    return "n/a" if v is None else f"{v:.2f}"


def routing_summary(report):
    """Per shape, one row per routing: the cold configuration's hit rate beside the replay's LRU and
    Belady at the same slots, tok/s against the limit, and the GB/s its reads achieved beside the
    disk probe's best (runs with ``res["replay"]``, written since 2026-12-01)."""
    runs = [res for res in report["archs"] if "replay" in res and "cold" in res["decode"]]
    if not runs:
        return []
    lines = [
        "## Cold decode by shape and routing",
        "",
        "`cold`: budget 25% of the expert bytes, page cache dropped before every decode step. Hit "
        "rate: the cold configuration's own (cache stats, measured steps). Beside it, its very rows "
        "(the ids its layers were called with, recorded from its cold start: the short prompt's "
        "rows and the warm-up steps warm the tables and are not counted, then every measured step) "
        "replayed through `mlx_lm_streaming.replay` with its slots per layer: the cache's own "
        "policy, LRU, Belady (offline optimum), and slots / experts (what random choices hit). The "
        "replay takes a prompt row by row where the model took it in one call. Limit tok/s = 1 / "
        "max(stock s per token, miss bytes per token / probe best GB/s), from the run's totals; "
        "cold / limit = cold tok/s / limit tok/s (the paired median of per-round ratios in "
        "brackets). Read GB/s (GB = 2^30): bytes the store read over the wall time at least one "
        "read was in flight (union of the reads' spans); in brackets over the store's own read "
        "seconds (`store.stats.seconds`, summed over reads that overlap on its threads) and over "
        "the calling thread's I/O wait (`cache.stats.io_wait_seconds`).",
        "",
    ]
    by_shape = {}
    for res in runs:
        by_shape.setdefault(res["label"], []).append(res)
    for label, group in by_shape.items():
        lines += [
            f"### {label}",
            "",
            "| routing | layers x experts, top-k, slots | hit rate | replay: own policy | LRU | "
            "Belady | slots / experts | cold tok/s | stock tok/s | limit tok/s | cold / limit | "
            "MB read / token | read GB/s in flight (store s; I/O wait) | probe best GB/s | "
            "bit-exact logits |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for res in group:
            rp, d, r = res["replay"], res["decode"], res["ratios"]
            slots = sorted(set(rp["slots"]))
            exact = res["same_tokens"]
            bad = [k for k, v in exact.items() if not v]
            lines.append(
                f"| {res.get('routing_label', res['routing'])} | {res['layers']} x "
                f"{res['experts']}, top {rp['top_k']}, {'/'.join(map(str, slots))} | "
                f"{_pct(d['cold']['hit_rate'])} | {_pct(rp['policy_hit_rate'])} "
                f"({rp['policy']}) | {_pct(rp['lru_hit_rate'])} | {_pct(rp['belady_hit_rate'])} | "
                f"{_pct(rp['random_hit_rate'])} | {d['cold']['tok_s']:.2f} | "
                f"{d['stock']['tok_s']:.2f} | {r['cold_limit_tok_s']:.2f} | "
                f"{r['cold_vs_limit_totals']:.3f} ({fmt(r['cold_vs_limit'])}) | "
                f"{d['cold']['bytes_per_token'] / MB:.1f} | "
                f"{_gbps(d['cold'].get('read_gbps_in_flight'))} "
                f"({_gbps(d['cold'].get('read_gbps_store_seconds'))}; "
                f"{_gbps(d['cold'].get('read_gbps_io_wait'))}) | {res['disk_best_gbps']:.2f} | "
                f"{'all (' + ', '.join(exact) + ')' if not bad else 'NOT ' + ', '.join(bad)} |"
            )
        lines.append("")
        for res in group:
            rp = res["replay"]
            lines.append(
                f"- {res.get('routing_label', res['routing'])}: {rp['rows_decode']} measured rows "
                f"per layer replayed after {rp['rows_warm']} warm-up rows; "
                f"{res['decode']['cold']['tokens']} cold decode steps timed."
            )
        lines.append("")
    return lines


def markdown(report):
    lines = [f"# Expert streaming benchmark: {report['tag']}", ""]
    m = report["machine"]
    lines += [f"Machine: {m['summary']}. Command: `{report['command']}`. {report['when']}.", ""]
    lines += routing_summary(report)
    for res in report["archs"]:
        r = res["ratios"]
        routing = res.get("routing_label") or res.get("routing")
        lines += [
            f"## {res['label']} experts ({res['layers']} layers, {res['experts']} experts of "
            f"{res['expert_bytes'] / MB:.2f} MB, {res['total_expert_bytes'] / GB:.2f} GB of experts"
            + (f"; routing: {routing}" if routing and "routing_label" in res else "")
            + ")",
            "",
            "| target | measured | goal |",
            "|---|---|---|",
        ]
        spread = _spread(res)
        for label, key, goal in TARGETS:
            extra = f" ({spread[key]})" if key in spread else ""
            lines.append(
                f"| {label} | {fmt(r.get(key), pct=key.startswith('rss'))}{extra} | {goal} |"
            )
        for seed in ("seed_loop", "seed_stack"):
            if f"cold_vs_{seed}" in r:
                lines.append(
                    f"| cold decode vs {seed} (same budget, same disk) | "
                    f"{fmt(r[f'cold_vs_{seed}'])} | > 1 |"
                )
        lines += [
            "",
            "| configuration | tok/s | vs stock (paired) | hit rate | MB read / token | "
            "I/O wait ms / token | install ms / token | "
            + ("bit-exact logits |" if report.get("exact_check") else "same greedy argmax |"),
            "|---|---|---|---|---|---|---|---|",
        ]
        for key, d in res["decode"].items():
            hr = d["hit_rate"]
            lines.append(
                f"| {key} | {d['tok_s']:.2f} | {fmt(r.get(f'{key}_vs_stock')) if key != 'stock' else '1'} | "
                f"{'' if hr is None else f'{hr:.1%}'} | {d['bytes_per_token'] / MB:.1f} | "
                f"{d['io_wait_s_per_token'] * 1e3:.0f} | {d['install_s_per_token'] * 1e3:.0f} | "
                f"{res['same_tokens'].get(key, 'n/a')} |"
            )
        p = res["decode"].get("cold", {}).get("prefetch") or {}
        if p:
            lines += [
                "",
                f"Lookahead (cold): precision {fmt(p.get('lookahead_precision'))}, recall "
                f"{fmt(p.get('lookahead_recall'))}.",
            ]
        if r.get("stock_again_vs_stock") is not None:
            lines += [
                "",
                f"Noise floor: a second stock model timed like the others (`stock_again`) ran at "
                f"{fmt(r['stock_again_vs_stock'])} of stock ({spread['stock_again_vs_stock']}): "
                f"differences between configurations smaller than its distance from 1 are within "
                f"this run's noise.",
            ]
        lines += ["", f"| prefill {res['prefill_tokens']} tokens | seconds |", "|---|---|"]
        for key, v in res["prefill_s"].items():
            lines.append(f"| {key} | {v:.2f} |")
        lines.append(
            f"| limit: max(stock, experts once / disk) | {fmt(r.get('prefill_limit_s'))} |"
        )
        lines += [
            "",
            "Disk GB/s (reads of one expert, page cache dropped): "
            + ", ".join(f"{k} {fmt(v)}" for k, v in res["disk_gbps"].items()),
        ]
        rss = res.get("rss", {})
        if rss:
            lines += [
                "",
                "| peak RSS | GB | net of interpreter | weights + budget |",
                "|---|---|---|---|",
            ]
            for k, v in rss.items():
                want = (v.get("resident_bytes") or 0) + v.get("budget", 0)
                lines.append(
                    f"| {k} | {v['peak_rss'] / GB:.2f} | {(v['peak_rss'] - v['rss_after_imports']) / GB:.2f} | "
                    f"{want / GB if k != 'stock' else res['checkpoint_bytes'] / GB:.2f} |"
                )
        lines.append("")
    return "\n".join(lines)


def plot(report, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot"
    archs = report["archs"]
    cols = min(len(archs), 3)
    rows = -(-len(archs) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 4 * rows), squeeze=False)
    for ax in axes.flat[len(archs) :]:
        ax.set_visible(False)
    for ax, res in zip(axes.flat, archs):
        keys = list(res["decode"])
        vals = [res["decode"][k]["tok_s"] for k in keys]
        ax.bar(
            range(len(keys)),
            vals,
            color=[
                "#555" if k == "stock" else "#2a7" if k.startswith(("warm", "cold")) else "#c53"
                for k in keys
            ],
        )
        ax.set_xticks(range(len(keys)))
        ax.set_xticklabels(keys, rotation=45, ha="right", fontsize=8)
        ax.set_yscale("log")
        for i, v in enumerate(vals):
            ax.text(i, v, f"{v:.3g}", ha="center", va="bottom", fontsize=7)
        limit = res.get("ratios", {}).get("cold_limit_tok_s")
        if limit and "cold" in keys:
            i = keys.index("cold")
            ax.hlines(limit, i - 0.45, i + 0.45, colors="#000", linestyles="dashed")
            ax.text(i, limit, "limit", ha="center", va="bottom", fontsize=7)
        drawn = vals + ([limit] if limit else [])
        ax.set_ylim(bottom=min(drawn) * 0.5, top=max(drawn) * 1.25)
        ax.set_ylabel("decode tok/s (log scale)")
        routing = res.get("routing", "uniform")
        routing = "trace" if routing.startswith("trace:") else routing
        routing += ", folded" if res.get("routing_fold") else ""
        ax.set_title(
            f"{res['label']} ({res['layers']} layers, {report['device']}, {routing})", fontsize=9
        )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return None


def machine(device):
    import mlx.core as mx

    info = {
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
    }
    try:
        import importlib.metadata as md

        info["mlx"] = md.version("mlx")
        info["mlx_lm"] = md.version("mlx-lm")
    except Exception:
        pass
    try:
        info["ram_gb"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GB
    except (ValueError, OSError):
        pass
    info["device"] = str(mx.default_device())
    if device == "gpu":
        try:
            info["gpu"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                capture_output=True,
                text=True,
            ).stdout.strip()
        except OSError:
            pass
    info["summary"] = (
        f"{info.get('gpu') or platform.processor() or platform.machine()}, "
        f"{info['cpus']} CPUs, {info.get('ram_gb', 0):.0f} GiB RAM, mlx {info.get('mlx')}, "
        f"mlx-lm {info.get('mlx_lm')}, default device {info['device']}"
    )
    return info


def main():
    import routing_replay

    routing_replay.unwind_on_rewind()  # verified steps that run a forward again
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="qwen3 only, fewer rounds (a few minutes)")
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
        type=int,
        default=None,
        help=f"default {PREFILL_TOKENS} ({PREFILL_TOKENS // 4} with --quick: the CPU is slow)",
    )
    ap.add_argument(
        "--ablations",
        default=None,
        help="comma-separated: stock_again (noise floor),warm_sync,cold_staged,"
        "cold_nolookahead,cold_hitsfirst,cold_t4,cold_t8,"
        "cold_packed,cold_packed_direct,cold_nophase,cold_uvm_prefetch,cold_uvm_host (CUDA)",
    )
    ap.add_argument("--seeds", default="seed_loop,seed_stack")
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
        "--store-threads",
        type=int,
        default=None,
        help="reader threads of the store (default: the store's own)",
    )
    ap.add_argument(
        "--pack", action="store_true", help="pack the checkpoints first (for cold_packed)"
    )
    ap.add_argument(
        "--direct-reads",
        choices=["auto", "on", "off"],
        default="auto",
        help="the direct_reads option for every streaming configuration (cold_staged: off)",
    )
    ap.add_argument("--render", default=None, help="rewrite the .md and .png of a results JSON")
    ap.add_argument("--rss-child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--rss-path", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--rss-prefill", type=int, default=PREFILL_TOKENS, help=argparse.SUPPRESS)
    ap.add_argument("--rss-decode", type=int, default=8, help=argparse.SUPPRESS)
    args = ap.parse_args()
    global DIRECT_READS
    DIRECT_READS = args.direct_reads

    if args.render:
        files = [Path(f) for f in args.render.split(",")]
        report = json.loads(files[0].read_text())
        if len(files) > 1:
            # several results merged into <out>/<tag>: one report, every run's sections
            for f in files[1:]:
                more = json.loads(f.read_text())
                report["archs"] += more["archs"]
                report["command"] += f"`; `{more['command']}"
            report["tag"] = args.tag or report["tag"]
            return write(report, Path(args.out), report["tag"]) or print(
                f"wrote {args.out}/{report['tag']}.json, .md and .png"
            )
        src = files[0]
        (src.with_suffix(".md")).write_text(markdown(report))
        note = plot(report, src.with_suffix(".png"))
        return print(note or f"wrote {src.with_suffix('.md')} and {src.with_suffix('.png')}")

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
            args.store_threads,
        )

    archs = args.archs.split(",") if args.archs else (["qwen3"] if args.quick else list(ARCHS))
    args.rounds = args.rounds or (3 if args.quick else 6)
    args.prefill_tokens = args.prefill_tokens or (
        PREFILL_TOKENS // 4 if args.quick else PREFILL_TOKENS
    )
    if args.ablations is None:
        args.ablations = (
            "warm_sync,cold_staged,cold_nolookahead,cold_packed"
            if args.quick
            else "warm_sync,cold_staged,cold_nolookahead,cold_t8,cold_packed," "cold_packed_direct"
        )
    args.ablations = [a for a in args.ablations.split(",") if a]
    args.seeds = [s for s in args.seeds.split(",") if s]
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
    from mlx_lm_streaming.routing_trace import read_trace

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
        if args.pack or any(a.startswith("cold_packed") for a in args.ablations):
            try:
                from mlx_lm_streaming.pack import pack_checkpoint

                pack_checkpoint(path, progress=False)
            except ImportError:
                pass
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


def write(report, out: Path, tag: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{tag}.json").write_text(json.dumps(report, indent=1, default=str))
    (out / f"{tag}.md").write_text(markdown(report))
    note = plot(report, out / f"{tag}.png")
    if note:
        report["plot"] = note
        log(note)


if __name__ == "__main__":
    main()
