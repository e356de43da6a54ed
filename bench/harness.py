"""The benchmarks' library: checkpoints of the real expert shapes, the page cache and the disk
probe, the routing a configuration replays and decode timing, loading stock and streaming models.

Imported by ``gpu_pipeline.py``, ``prefill.py``, ``memory.py`` and ``tiers_shift.py``
(bench/README.md); it imports only the standard library at import time. Why the routing and the
token stream are forced, how decode is timed: docs/benchmarks/methods.md (harness.py).
"""

import hashlib
import mmap
import os
import platform
import random
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

GB = 1 << 30
# the unit of ``expert_cache_gb`` (decimal GB, as the flag): budgets are bytes / BUDGET_GB
from mlx_lm_streaming.option_table import GB as BUDGET_GB  # noqa: E402
MB = 1 << 20


def _shape(label, arch, layers, **overrides):
    return dict(label=label, arch=arch, layers=layers, overrides=overrides)


# name -> the real model's expert shape at ``layers`` MoE layers (the real ones have 48, 32, 27;
# the hybrids' 40 and 30 decoder layers are each an MoE layer, their attention pattern kept)
ATTN = dict(heads=32, head_dim=128)
# Qwen3.5/3.6-35B-A3B (qwen3_5_moe: qwen3_next's sparse block and a shared expert in every layer,
# three Gated DeltaNet layers then one of full attention); gemma-4-26B-A4B (gemma4_text: experts
# beside a dense MLP in every layer, five sliding-window layers then one global)
QWEN35 = dict(hidden=2048, moe_intermediate=512, experts=256, top_k=8, heads=16, kv_heads=2,
              head_dim=256, shared_expert_intermediate_size=512, full_attention_interval=4,
              linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
              linear_value_head_dim=128)
GEMMA4 = dict(hidden=2816, moe_intermediate=704, experts=128, top_k=8, heads=16, kv_heads=8,
              head_dim=256, intermediate_size=2112, global_head_dim=512, sliding_window=1024,
              num_global_key_value_heads=2, attention_k_eq_v=True,
              layer_types=["sliding_attention"] * 5 + ["full_attention"])
TINY = dict(hidden=128, moe_intermediate=64, head_dim=32)
ARCHS = {
    "qwen3": _shape(
        "Qwen3-30B-A3B", "qwen3_moe", 4, hidden=2048, moe_intermediate=768, experts=128, top_k=8,
        kv_heads=4, **ATTN,
    ),
    "mixtral": _shape(
        "Mixtral-8x7B", "mixtral", 2, hidden=4096, moe_intermediate=14336, experts=8, top_k=2,
        kv_heads=8, **ATTN,
    ),
    "dsv2": _shape(
        "DeepSeek-V2-Lite", "deepseek_v2", 4, hidden=2048, moe_intermediate=1408, experts=64,
        top_k=6, n_shared_experts=2, heads=16, kv_heads=16, kv_lora_rank=512, q_lora_rank=None,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, topk_method="greedy",
        n_group=1, topk_group=1, first_k_dense_replace=0,
    ),
    "qwen35": _shape("Qwen3.5/3.6-35B-A3B", "qwen3_5_moe", 4, **QWEN35),
    "gemma4": _shape("gemma-4-26B-A4B", "gemma4_text", 6, **GEMMA4),
    # the Qwen3 layout at small dims: long prompts (4K-32K tokens) prefill in minutes on the CPU
    "small": _shape("small (Qwen3 layout)", "qwen3_moe", 2, hidden=256, moe_intermediate=128,
                    experts=64, top_k=4, heads=2, kv_heads=1, head_dim=32),
    # tiny dims for --quick runs on a CPU: the Qwen3 layout, the others' (experts, heads, layers)
    "tiny": _shape("tiny (Qwen3 layout)", "qwen3_moe", 2, hidden=128, moe_intermediate=64,
                   experts=128, top_k=6),
    "qwen35_tiny": _shape("tiny (Qwen3.5 layout)", "qwen3_5_moe", 4, **QWEN35 | TINY | dict(
        shared_expert_intermediate_size=64, linear_key_head_dim=32, linear_value_head_dim=32)),
    "gemma4_tiny": _shape("tiny (gemma-4 layout)", "gemma4_text", 6, **GEMMA4 | TINY | dict(
        intermediate_size=128, global_head_dim=64, sliding_window=16)),
}  # fmt: skip


def common_arguments(ap, archs_help: str) -> None:
    """The arguments ``prefill.py`` and ``memory.py`` share: ``--quick``, ``--device-kind``,
    ``--archs``, ``--ckpt-dir``, ``--out``, ``--tag``."""
    ap.add_argument("--quick", action="store_true", help="the tiny shape (seconds)")
    ap.add_argument("--device-kind", choices=["cpu", "gpu"], default="cpu")
    ap.add_argument("--archs", default=None, help=archs_help)
    ckpt = Path.home() / ".cache" / "mlx_lm_streaming_bench"
    ap.add_argument("--ckpt-dir", default=os.environ.get("MLX_LM_STREAMING_BENCH_DIR", ckpt))
    ap.add_argument("--out", default=str(ROOT / "docs" / "benchmarks"))
    ap.add_argument("--tag", default=None)


def use_device(kind: str) -> str:
    """MLX's default device set to ``kind`` (``cpu`` or ``gpu``); the activation dtype the
    benchmarks use there (bfloat16 on a GPU, float32 on the CPU)."""
    import mlx.core as mx

    mx.set_default_device(mx.gpu if kind == "gpu" else mx.cpu)
    return "bfloat16" if kind == "gpu" else "float32"


def log(*a):
    print(*a, file=sys.stderr, flush=True)


# -- checkpoints and the page cache ---------------------------------------------------------------


def checkpoint(ckpt_dir: Path, name: str, dtype: str, layers=None, top_k=None) -> Path:
    """The checkpoint of shape ``name`` (``layers``, ``top_k``: other than the shape's, for trace
    routing), built once."""
    spec = ARCHS[name]
    layers = layers or spec["layers"]
    overrides = dict(spec["overrides"])
    k = "" if top_k in (None, overrides["top_k"]) else f"-k{top_k}"
    overrides["top_k"] = top_k or overrides["top_k"]
    path = ckpt_dir / f"{name}-{layers}l{k}-{dtype}"
    if (path / ".complete").is_file():
        return path
    from synthetic import build_checkpoint

    log(f"building {path} ({spec['label']} experts, {layers} layers, {dtype}) ...")
    start = time.time()
    build_checkpoint(path, spec["arch"], "affine4", num_layers=layers, overrides=overrides,
                     dtype=dtype)
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


def probe_disk(files, read_bytes: int, total_bytes: int, threads=(1, 4, 8)):
    """``disk_bandwidth`` per thread count, buffered and O_DIRECT: {"t4_direct": GB/s or None}."""
    bw = {}
    for n in threads:
        for direct in (False, True):
            key = f"t{n}{'_direct' if direct else ''}"
            try:
                bw[key] = disk_bandwidth(files, read_bytes, total_bytes, n, direct)
            except OSError as e:
                bw[key] = None
                log(f"disk probe {key}: {e}")
    return bw


# -- configurations -------------------------------------------------------------------------------


class Config:
    """One model under test, with its own KV cache and counters."""

    def __init__(self, name, model, cold=False, files=()):
        self.name = name
        self.model = model
        self.cold = cold
        self.files = files
        self.kv = self.routing = self.stream = self.stats0 = None
        self.pos = 0
        self.decode_s = []  # per token
        self.tokens = []

    @property
    def cache(self):
        state = getattr(self.model, "expert_streaming", None)
        return None if state is None else state.cache

    def counters(self):
        """The cache's counters (stock: none), and the routing's host time in its modules."""
        cache, out = self.cache, {}
        if cache is not None:
            s, io = cache.summary(), cache.store.stats
            out = dict(
                hits=s["hits"], misses=s["misses"], bytes_read=io.bytes_read,
                store_read_seconds=io.seconds, io_wait_seconds=s["io_wait_seconds"],
                miss_read_busy_seconds=s["miss_read_busy_seconds"],
                install_seconds=s["install_seconds"], prefetch=_prefetch_counts(cache),
                # verified steps, the layers they ran again, the experts read on a pass's word and
                # those used (verified_step.py)
                **{k: s.get(k, 0) for k in ("verified_steps", "verified_replays", "verified_named",
                                             "verified_named_used", "checked_late", "verified_read_in_pass",
                                             "checked_late_dropped", "verified_first_call_reads")},
                store_reads=io.reads, uncached_bytes=io.uncached_bytes,
            )
            if s.get("tier_sampled_uses"):  # two tiers: uses served on the device, and moves
                out.update(tier_on=s["tier_device_share"] * s["tier_sampled_uses"],
                           tier_uses=s["tier_sampled_uses"], tier_moved=s["tier_moves"])
        return dict(out, call_seconds=getattr(self.routing, "call_seconds", 0.0))


def _prefetch_counts(cache):
    if cache._prefetcher is None:
        return {}
    st = cache._prefetcher.stats
    return dict(
        lookahead_staged=st.staged["lookahead"], lookahead_used=st.used["lookahead"],
        wave_staged=st.staged["wave"], wave_used=st.used["wave"], predicted=st.predicted,
        predicted_hit=st.predicted_hit, demand=st.demand, dropped=st.dropped,
        staged_wait_s=st.waited_s,
    )


def precision_recall(p):
    if not p:
        return {}
    pred, hit, demand = p.get("predicted", 0), p.get("predicted_hit", 0), p.get("demand", 0)
    return {
        "lookahead_precision": hit / pred if pred else None,
        "lookahead_recall": hit / demand if demand else None,
        **p,
    }


def make_routing(routing: str, num_experts: int, layers: int):
    """The routing a configuration replays (``routing_replay``'s): ``uniform`` (``ForcedRouting``),
    ``trace:FILE`` (``TraceRouting``: with fewer layers than the trace, its first ones), or None
    (``model:DIR``: that checkpoint's own router)."""
    from routing_replay import ForcedRouting, TraceRouting

    from mlx_lm_streaming.files.routing_trace import read_trace

    if routing == "uniform":
        return ForcedRouting(num_experts)
    if routing.startswith("trace:"):
        trace = read_trace(routing[len("trace:") :])
        return TraceRouting(trace, layers=None if layers == trace.num_layers else layers)
    return None


def routing_label(routing: str) -> str:
    """How a run's routing is named in its report."""
    if routing.startswith("model:"):
        return f"model {Path(routing[len('model:') :]).name} (its own router)"
    if routing.startswith("trace:"):
        return f"trace {Path(routing[len('trace:') :]).name}"
    return routing


def delta(a, b):
    """``b`` less ``a``, number by number, nested dicts too (values ``a`` lacks: ``b``'s)."""
    return {k: (v - a[k] if isinstance(v, (int, float)) else delta(a[k], v)
                if isinstance(v, dict) else v) if k in a else v for k, v in b.items()}  # fmt: skip


def reset_banks(model):
    """Empty every slot bank (as after load) and zero the counters, keeping the model."""
    from mlx_lm_streaming.runtime.memory.expert_cache import CacheStats

    cache = model.expert_streaming.cache
    cache.ensure_planned()
    for bank in cache.banks:
        bank.allocate(bank.slots)
    cache.stats = CacheStats()


class ForcedSampler:
    """Feeds a fixed random token stream (the same for every configuration) instead of sampling,
    and keeps each step's log-probabilities (hashed bit for bit after the block, to compare with
    stock). Why not greedy decoding: docs/benchmarks/methods.md (harness.py)."""

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

    def take_back(self, n):
        """The last ``n`` draws taken back (checked_late.py: tokens dropped after a miss)."""
        self.i, self.argmax = self.i - n, self.argmax[: len(self.argmax) - n]


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
        drop_page_cache(cfg.files)
    excluded = 0.0
    start = time.perf_counter()
    for _ in generate_step(prompt, cfg.model, max_tokens=n, prompt_cache=cfg.kv, sampler=sampler):
        if cfg.cold:
            # generate_step builds step i+1 (host syncs and reads included) before it yields step
            # i, so a drop here precedes every read of step i+2: every step reads from the disk.
            # The drop itself is left out of the timing.
            excluded += drop_page_cache(cfg.files)
    mx.synchronize()
    seconds = time.perf_counter() - start - excluded
    steps = sampler.i - cfg.pos
    cfg.pos = sampler.i
    cfg.tokens.extend(
        hashlib.sha1(np.array(lp.view(mx.uint8)).tobytes()).hexdigest()[:16]
        for lp in sampler.argmax
    )
    return [seconds / steps] * steps


def load_stock(path):
    """Stock mlx-lm's model of ``path`` (the package installed, streaming off), as the parity tool."""
    from mlx_lm_streaming.tools import parity

    model, config = parity.load_stock(Path(path))
    assert not hasattr(model, "expert_streaming")
    return model, config


def load_streaming(path, **options):
    from mlx_lm_streaming import _bootstrap
    from mlx_lm_streaming.tools import parity

    _bootstrap.install()  # as the startup hook (none on PYTHONPATH): generate_step wrapped
    return parity.load_streaming(Path(path), **options)


def expert_sizes(path):
    """The checkpoint's expert bytes, from a model loaded with room for every expert."""
    probe, _ = load_streaming(path, expert_cache_gb=1e6)
    state = probe.expert_streaming
    banks = state.cache.banks
    sizes = dict(
        total_expert_bytes=state.cache.total_expert_bytes,
        expert_bytes=banks[0].layer.expert_nbytes, moe_layers=len(banks),
        experts=banks[0].num_experts, resident_bytes=state.resident_bytes,
    )
    state.close()
    return sizes


def machine(device):
    """What ran a benchmark: platform, CPUs, RAM, mlx and mlx-lm, the default device (and the GPU's
    name), with a one-line ``summary``."""
    import mlx.core as mx
    import mlx_lm

    ram_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GB
    info = dict(platform=platform.platform(), cpus=os.cpu_count(), python=platform.python_version(),
                mlx=mx.__version__, mlx_lm=mlx_lm.__version__, ram_gb=ram_gb,
                device=str(mx.default_device()))  # fmt: skip
    if device == "gpu":
        query = ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"]
        try:
            info["gpu"] = subprocess.run(query, capture_output=True, text=True).stdout.strip()
        except OSError:  # no nvidia-smi: a GPU of another kind
            pass
    info["summary"] = (
        f"{info.get('gpu') or platform.processor() or platform.machine()}, {info['cpus']} CPUs, "
        f"{ram_gb:.0f} GiB RAM, mlx {info['mlx']}, mlx-lm {info['mlx_lm']}, default device "
        f"{info['device']}"
    )
    return info
