"""Eviction policies on routing traces: decode hit rate of LRU, each policy, and Belady's optimum.

    python bench/routing_policy.py [--traces tests/data/routing] [--slots 8,16,24,32,48,64]

Replays (``mlx_lm_streaming.replay``: per-layer slot tables, the same slots in every layer, cold
start, prefill rows warm the cache) every ``*.jsonl`` trace in ``--traces`` and held-out variants:

- ``first half``: the prefill and the first half of the decode rows;
- ``second half``: the other decode rows alone, cold (no prefill to warm the cache);
- ``zipf-drift``: synthetic (seeded), 48 layers x 128 experts, top 6, 28 prefill + 256 decode
  tokens: each layer's popularity is Zipf (s = 1) over its own random order of the experts, a fifth
  of which is reshuffled every 64 tokens, and each token reuses each of the previous token's experts
  with probability 0.3 (bursts).

Prints a Markdown table: per trace and slots, the decode hit rate of LRU, each policy, Belady, the
halfway mark ``(LRU + Belady) / 2``, and the default policy with lookahead (``replay.Lookahead``,
its defaults: guesses of the next layer read ahead); then experts read per decode token (misses,
plus reads ahead) for LRU, the default policy, and it with lookahead, and the lookahead's precision
(reads ahead used by the call they were read for). Pure CPU, a few seconds per trace.
"""

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]

from mlx_lm_streaming.policy import DEFAULT_POLICY, POLICIES  # noqa: E402
from mlx_lm_streaming.replay import Lookahead, belady, replay  # noqa: E402
from mlx_lm_streaming.routing_trace import RoutingTrace, TraceRow, read_trace  # noqa: E402


def halves(trace: RoutingTrace):
    decode = [r for r in trace.rows if r.phase == "decode"]
    prefill = [r for r in trace.rows if r.phase == "prefill"]
    mid = len(decode) // 2
    first = RoutingTrace(trace.header, prefill + decode[:mid], trace.path)
    second = RoutingTrace(trace.header, decode[mid:], trace.path)
    return first, second


def zipf_drift(layers=48, experts=128, top_k=6, prefill=28, decode=256, seed=0) -> RoutingTrace:
    rng = np.random.default_rng(seed)
    zipf = 1.0 / np.arange(1, experts + 1)
    order = [rng.permutation(experts) for _ in range(layers)]
    previous = [np.zeros(0, dtype=np.int64) for _ in range(layers)]
    rows = []
    for t in range(prefill + decode):
        if t and t % 64 == 0:
            for perm in order:
                moved = rng.choice(experts, experts // 5, replace=False)
                perm[moved] = perm[rng.permutation(moved)]
        token = []
        for layer in range(layers):
            again = [e for e in previous[layer].tolist() if rng.random() < 0.3]
            weights = np.empty(experts)
            weights[order[layer]] = zipf
            weights[again] = 0.0
            fresh = rng.choice(
                experts, top_k - len(again), replace=False, p=weights / weights.sum()
            )
            picked = np.array(again + fresh.tolist(), dtype=np.int64)
            token.append(picked.tolist())
            previous[layer] = picked
        rows.append(TraceRow(0, "prefill" if t < prefill else "decode", token))
    header = {"format": "moe-routing-trace", "version": 1, "model": "zipf-drift (synthetic)"}
    header.update(num_layers=layers, num_experts=experts, top_k=top_k)
    return RoutingTrace(header, rows)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--traces", default=str(ROOT / "tests" / "data" / "routing"))
    ap.add_argument("--slots", default="8,16,24,32,48,64")
    args = ap.parse_args()
    slots = [int(s) for s in args.slots.split(",")]
    traces = []
    for path in sorted(Path(args.traces).glob("*.jsonl")):
        trace = read_trace(path)
        first, second = halves(trace)
        traces += [(path.stem, trace), (f"{path.stem} first half", first)]
        traces += [(f"{path.stem} second half (cold)", second)]
    traces.append(("zipf-drift (synthetic)", zipf_drift()))
    policies = [p for p in sorted(POLICIES) if p != "lru"]
    ahead = f"{DEFAULT_POLICY} + lookahead"
    head = ["trace", "slots", "LRU", *policies, "Belady", "halfway", ahead]
    head += ["reads: LRU", DEFAULT_POLICY, ahead, "precision"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for name, trace in traces:
        for n in slots:
            if n >= trace.num_experts:
                continue
            lru = replay(trace, n, "lru")
            ours = {p: replay(trace, n, p) for p in policies}
            best = belady(trace, n).hit_rate("decode")
            look = replay(trace, n, DEFAULT_POLICY, Lookahead())
            rates = [lru, *ours.values()]
            cells = [name, n, *(r.hit_rate("decode") for r in rates)]
            cells += [best, (lru.hit_rate("decode") + best) / 2, look.hit_rate("decode")]
            reads = [lru, ours[DEFAULT_POLICY], look]
            cells += [f"{r.reads_per_decode_token:.1f}" for r in reads] + [look.precision]
            text = [f"{c:.3f}" if isinstance(c, float) else str(c) for c in cells]
            print("| " + " | ".join(text) + " |")


if __name__ == "__main__":
    main()
