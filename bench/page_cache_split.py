"""Expert cache or page cache: how a fixed memory is best split between the two, by routing replay.

Issue 22, item 3. Experts the expert cache misses are read with buffered reads (the ``safetensors``
store), so the OS page cache keeps a second copy of what was read; the default budget gives the
expert cache ``DEFAULT_CACHE_SHARE`` (0.5) of the free memory and leaves the rest to the page cache
(and the KV cache and activations). Of a memory M (here a share of all expert bytes), the expert
cache takes E = s * M and the page cache P = M - E; a miss whose bytes are in the page cache costs
a copy from RAM (``t_ram``), any other a disk read (``t_disk``).

The model:

- expert cache: the rule of ``mlx_lm_streaming.tools.replay`` (and of the traces' reference figures): one
  ``policy.SlotTable`` per MoE layer, the same slots in every layer (floor(s * M * experts per
  layer)), the whole trace in order from a cold start, prefill rows warming the cache; figures are
  per decode token, the misses taken from ``replay.replay`` itself (``miss_stream``);
- page cache: one LRU over all layers of the experts read, whole experts (every expert has the same
  size), capacity P experts = floor(M * all experts) - the expert cache's slots. Each expert-cache
  miss is a page-cache hit if the expert is in it (it moves to the front), else a disk read (it is
  inserted). Only misses touch it: an expert the expert cache keeps ages out of the page cache, and
  the experts just read are in both (the second copy).

An approximation: Linux's page cache is not one LRU (active and inactive lists: a page read twice is
promoted and outlives pages read once), readahead pulls neighbouring bytes (often a neighbouring
expert's) in with each read, and other files and the KV cache compete for the same memory; macOS
manages its unified memory differently again. Costs are per expert and serial: reads overlapped with
compute (the pipeline's lookahead) or with each other cost less than their sum. One prompt of 128
decode tokens per trace: decode's first touches of an expert (``first_touch``) are disk reads under
every split and weigh more here than in a long generation. Against the LRU's shortcomings, every
point is also given under the best page cache of the same capacity (``oracle_*``: Belady's MIN over
the same reads, evicting the expert read again furthest ahead): no replacement policy of a cache
that every buffered read goes through hits more often.

    python bench/page_cache_split.py [--traces FILE,...] [--out FILE.json] [--quick]

Writes ``docs/benchmarks/page-cache-split.json`` unless ``--out`` says otherwise. The whole grid,
both traces: ~8 s on the 2-core box, no subsampling. ``--quick``: one trace, two points (the CI
size).
"""

import argparse
import heapq
import json
import sys
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

import numpy as np

from mlx_lm_streaming.runtime.memory import DEFAULT_CACHE_SHARE
from mlx_lm_streaming.runtime.policy import DEFAULT_POLICY
from mlx_lm_streaming.tools.replay import ReplayResult, replay
from mlx_lm_streaming.files.routing_trace import RoutingTrace, check_decode_tokens, read_trace

ROOT = Path(__file__).resolve().parent.parent
TRACES = [
    ROOT / "tests" / "data" / "routing" / "qwen3-30b-a3b.jsonl",
    ROOT / "tests" / "data" / "routing" / "gemma-4-26b-a4b.jsonl",
]
OUT = ROOT / "docs" / "benchmarks" / "page-cache-split.json"

MEMORY_SHARES = (0.25, 0.5, 0.75, 1.0)  # M, of all expert bytes
CACHE_SHARES = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)  # s = E / M
DEFAULT_SHARE = DEFAULT_CACHE_SHARE  # the split under question
# one expert of the Qwen3-30B-A3B shape, 4-bit, bf16 scales (docs/benchmarks/README.md)
EXPERT_MB = 2.53
# (disk, page-cache copy) in GB/s for expert-sized reads; MB / (GB/s) = ms per expert
COSTS = {
    # bench runs on the H200 host: 16 reader threads, random expert reads, page cache dropped
    "h200": (1.65, 6.0),
    # the 2-core development box
    "cpu-box": (0.9, 4.4),
    # a Mac's NVMe (~5-7 GB/s) against a ~20 GB/s copy from the page cache: disk 3x a copy
    "mac-like": (20.0 / 3, 20.0),
}
# shares whose read time is within this of the best count as tied with it
NEAR = 0.01
# a share times a count that should be whole can land a hair below it in floating point
EPS = 1e-9


@dataclass
class Split:
    """One point of the grid; counts are per decode token, all MoE layers."""

    memory: float  # M
    cache_share: float  # s
    slots: int  # per layer
    page_cache: int  # P, experts
    hit_rate: float  # of the expert cache, decode
    misses: float  # of the expert cache: page_hits + disk_reads
    page_hits: float
    disk_reads: float
    oracle_page_hits: float  # the same reads through Belady's MIN of capacity P

    def ms(self, t_disk: float, t_ram: float, oracle: bool = False) -> float:
        """Expected read time per decode token, serial; ``oracle``: under Belady's page cache."""
        hits = self.oracle_page_hits if oracle else self.page_hits
        return hits * t_ram + (self.misses - hits) * t_disk


def cost_ms(name: str) -> Tuple[float, float]:
    """``(t_disk, t_ram)``: ms to read one expert from the disk, to copy it from the page cache."""
    disk, ram = COSTS[name]
    return EXPERT_MB / disk, EXPERT_MB / ram


def miss_stream(
    trace: RoutingTrace, slots: int, policy: str = DEFAULT_POLICY
) -> Tuple[ReplayResult, List[int], List[bool]]:
    """``(result, keys, decode)``: ``replay.replay`` of the expert cache, and its misses in the
    order they are read: ``layer * num_experts + expert``, and whether a decode token read it."""
    keys: List[int] = []
    decode: List[bool] = []

    def missed(layer: int, missing: np.ndarray, phase: str) -> None:
        keys.extend(layer * trace.num_experts + int(e) for e in missing)
        decode.extend([phase == "decode"] * len(missing))

    return replay(trace, slots, policy, misses=missed), keys, decode


def page_cache_reads(keys: Sequence[int], decode: Sequence[bool], capacity: int) -> Tuple[int, int]:
    """``(page_hits, disk_reads)`` of the reads flagged ``decode``, through an LRU of ``capacity``
    experts that every read (decode or not) goes through."""
    cache: "OrderedDict[int, None]" = OrderedDict()
    hits = disk = 0
    for key, counted in zip(keys, decode):
        if key in cache:
            cache.move_to_end(key)
            hits += counted
            continue
        disk += counted
        if capacity:
            cache[key] = None
            if len(cache) > capacity:
                cache.popitem(last=False)
    return hits, disk


def page_cache_oracle(
    keys: Sequence[int], decode: Sequence[bool], capacity: int
) -> Tuple[int, int]:
    """``page_cache_reads`` through Belady's MIN instead of an LRU: a read that finds the cache
    full evicts the expert read again furthest ahead (never again: first)."""
    n = len(keys)
    following = [0] * n  # index of the next read of the same expert, ``n`` if none
    last: Dict[int, int] = {}
    for i in range(n - 1, -1, -1):
        following[i] = last.get(keys[i], n)
        last[keys[i]] = i
    resident: Dict[int, int] = {}  # key -> its next read
    heap: List[Tuple[int, int]] = []  # (-next read, key); entries resident no longer are skipped
    hits = disk = 0
    for i, (key, counted) in enumerate(zip(keys, decode)):
        if key in resident:
            hits += counted
        else:
            disk += counted
            if not capacity:
                continue
            if len(resident) == capacity:
                while True:
                    ahead, victim = heapq.heappop(heap)
                    if resident.get(victim) == -ahead:
                        del resident[victim]
                        break
        resident[key] = following[i]
        heapq.heappush(heap, (-following[i], key))
    return hits, disk


def first_touches(trace: RoutingTrace) -> int:
    """Decode uses of a (layer, expert) that no earlier token used: disk reads under any split."""
    seen = set()
    count = 0
    for row in trace.rows:
        for layer, ids in enumerate(row.experts):
            fresh = {(layer, e) for e in ids} - seen
            seen |= fresh
            count += len(fresh) * (row.phase == "decode")
    return count


def sweep(
    trace: RoutingTrace,
    memories: Sequence[float] = MEMORY_SHARES,
    shares: Sequence[float] = CACHE_SHARES,
    policy: str = DEFAULT_POLICY,
) -> List[Split]:
    """Every (M, s) of the grid. The expert cache's misses depend on its slots only: replayed once
    per slot count, then through each page cache."""
    check_decode_tokens(trace)
    layers, experts = trace.num_layers, trace.num_experts
    streams: Dict[int, Tuple[ReplayResult, List[int], List[bool]]] = {}
    out = []
    for memory in memories:
        total = int(memory * layers * experts + EPS)
        for share in shares:
            slots = int(share * memory * experts + EPS)
            if slots not in streams:
                streams[slots] = miss_stream(trace, slots, policy)
            result, keys, decode = streams[slots]
            capacity = total - slots * layers
            hits, disk = page_cache_reads(keys, decode, capacity)
            oracle, _ = page_cache_oracle(keys, decode, capacity)
            n = result.decode_tokens
            out.append(
                Split(
                    memory=memory,
                    cache_share=share,
                    slots=slots,
                    page_cache=capacity,
                    hit_rate=result.hit_rate("decode"),
                    misses=(hits + disk) / n,
                    page_hits=hits / n,
                    disk_reads=disk / n,
                    oracle_page_hits=oracle / n,
                )
            )
    return out


def best_splits(points: List[Split]) -> List[Dict]:
    """Per M, cost and page cache (``lru``, ``oracle``): the cheapest s, the shares within ``NEAR``
    of it (on these short traces several s often read only the first touches), and how much slower
    ``DEFAULT_SHARE`` is (percent)."""
    out = []
    for memory in sorted({p.memory for p in points}):
        row = [p for p in points if p.memory == memory]
        for name in COSTS:
            for oracle in (False, True):
                ms = {p.cache_share: p.ms(*cost_ms(name), oracle=oracle) for p in row}
                best = min(ms, key=ms.get)
                entry = {
                    "memory": memory,
                    "cost": name,
                    "page_cache": "oracle" if oracle else "lru",
                    "best_share": best,
                    "near_best_shares": [s for s in ms if ms[s] <= ms[best] * (1 + NEAR)],
                    "best_ms": round(ms[best], 2),
                }
                if DEFAULT_SHARE in ms:
                    entry["default_ms"] = round(ms[DEFAULT_SHARE], 2)
                    entry["default_vs_best_pct"] = round(
                        100 * (ms[DEFAULT_SHARE] / ms[best] - 1), 1
                    )
                out.append(entry)
    return out


def run_trace(path: Path, memories, shares) -> Dict:
    trace = read_trace(path)
    start = time.perf_counter()
    points = sweep(trace, memories, shares)
    decode_tokens = sum(row.phase == "decode" for row in trace.rows)
    grid = []
    for p in points:
        entry = {k: round(v, 4) if isinstance(v, float) else v for k, v in asdict(p).items()}
        entry["ms"] = {name: round(p.ms(*cost_ms(name)), 2) for name in COSTS}
        entry["oracle_ms"] = {name: round(p.ms(*cost_ms(name), oracle=True), 2) for name in COSTS}
        grid.append(entry)
    return {
        "model": trace.header.get("model"),
        "moe_layers": trace.num_layers,
        "experts_per_layer": trace.num_experts,
        "top_k": trace.top_k,
        "decode_tokens": decode_tokens,
        "first_touch_per_decode_token": round(first_touches(trace) / decode_tokens, 2),
        "seconds": round(time.perf_counter() - start, 1),
        "grid": grid,
        "best": best_splits(points),
    }


def show(name: str, figures: Dict) -> None:
    print(
        f"\n{name}: {figures['moe_layers']} MoE layers x {figures['experts_per_layer']} experts, "
        f"{figures['decode_tokens']} decode tokens, first touches "
        f"{figures['first_touch_per_decode_token']} per token; per decode token:"
    )
    print("(page: page-cache hits, LRU; MIN: the same under Belady's page cache)")
    head = f"{'M':>5} {'s':>4} {'slots':>5} {'P':>5} {'hit':>6} {'page':>6} {'MIN':>6} {'disk':>6}"
    print(head + "".join(f" {c + ' ms':>12}" for c in COSTS))
    for p in figures["grid"]:
        print(
            f"{p['memory']:>5} {p['cache_share']:>4} {p['slots']:>5} {p['page_cache']:>5} "
            f"{p['hit_rate']:>6.3f} {p['page_hits']:>6.1f} {p['oracle_page_hits']:>6.1f} "
            f"{p['disk_reads']:>6.1f}" + "".join(f" {p['ms'][c]:>12.1f}" for c in COSTS)
        )
    print(f"best s per M (the shares within {NEAR:.0%} of it), and s={DEFAULT_SHARE} against it")
    for b in figures["best"]:
        near = ",".join(map(str, b["near_best_shares"]))
        line = (
            f"  M={b['memory']:<5} {b['cost']:<9} {b['page_cache']:<6} page cache: best s={near} "
            f"({b['best_ms']} ms)"
        )
        if "default_ms" in b:
            line += f", s={DEFAULT_SHARE} {b['default_ms']} ms ({b['default_vs_best_pct']:+}%)"
        print(line)


def _paragraph(start: str) -> str:
    """The module docstring's paragraph that begins with ``start``, on one line (the JSON says
    what the figures assume in the docstring's words)."""
    text = __doc__[__doc__.index(start) :].split("\n\n")[0]
    return " ".join(text.split())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--traces", default=",".join(map(str, TRACES)))
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--quick", action="store_true", help="one trace, M=0.25, s in {0.5, 1.0}")
    args = ap.parse_args(argv)
    paths = [Path(p) for p in args.traces.split(",")]
    memories, shares = MEMORY_SHARES, CACHE_SHARES
    if args.quick:
        paths, memories, shares = paths[:1], (0.25,), (0.5, 1.0)
    costs = {}
    for name, (disk, ram) in COSTS.items():
        t_disk, t_ram = cost_ms(name)
        costs[name] = {
            "disk_gbps": round(disk, 2),
            "page_cache_gbps": ram,
            "t_disk_ms": round(t_disk, 3),
            "t_ram_ms": round(t_ram, 3),
            "ratio": round(t_disk / t_ram, 2),
        }
    traces = {}
    for path in paths:
        traces[path.stem] = run_trace(path, memories, shares)
        show(path.stem, traces[path.stem])
    doc = {
        "question": "how a fixed memory M is best split between the expert cache (E = s*M) and the "
        "OS page cache (P = M - E), for buffered reads (issue 22, item 3)",
        "model": _paragraph("- expert cache:"),
        "caveat": _paragraph("An approximation:"),
        "policy": DEFAULT_POLICY,
        "expert_mb": EXPERT_MB,
        "costs": costs,
        "traces": traces,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
