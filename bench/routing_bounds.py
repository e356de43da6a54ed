"""How far an eviction policy can get on routing traces: two yardsticks that see the future.

    python bench/routing_bounds.py [--traces tests/data/routing] [--slots 8,16,32]
                                   [--policy decay_next] [--halves]

For every ``*.jsonl`` trace in ``--traces`` (with ``--halves``, also its halves as
``bench/routing_policy.py`` cuts them), at each slot count, prints the decode hit rate of:

- ``--policy`` with the same slots in every layer (``replay.replay``, the figure docs/routing.md
  gives), LRU, Belady and the halfway mark ``(LRU + Belady) / 2`` (issue 14, item 3);
- ``next k``: the policy told the layer's next ``k`` calls exactly: a resident expert one of them
  uses is never evicted while another can be (the sooner its use, the later it goes), the others in
  the policy's order. With ``k = 1`` this is a perfect guess of the next call's experts, what
  ``decay_next`` estimates online: about the most a better estimate of it can add;
- ``best split``: the policy with the same total slots split between the layers the best way for
  this trace, chosen knowing every layer's decode hit curve (from the trace's top-k to 4 x the
  slots per layer) and replayed through ``replay.replay`` with that split: no fixed split does
  better under this policy, and slots moved between layers online would have to beat a split
  chosen in hindsight.

Pure CPU; a minute or two per trace (the hit curves are one replay per slot count).
"""

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]

from mlx_lm_streaming.policy import SlotTable, make_policy  # noqa: E402
from mlx_lm_streaming.replay import belady, replay  # noqa: E402
from mlx_lm_streaming.routing_trace import RoutingTrace, read_trace  # noqa: E402
from routing_policy import halves  # noqa: E402


def foresight(trace: RoutingTrace, slots: int, policy: str, k: int) -> float:
    """Decode hit rate of ``policy`` told each layer's next ``k`` calls (``k = 0``: the policy
    alone, as ``replay.replay`` replays it). Needs ``slots`` at least the trace's widest call."""
    calls = [
        [set(r.experts[layer]) for r in trace.rows if r.experts[layer]]
        for layer in range(trace.num_layers)
    ]
    tables = []
    for layer in range(trace.num_layers):
        table = SlotTable(trace.num_experts, policy)
        table.reset(slots)
        table.policy = _Foresight(make_policy(policy, trace.num_experts), calls[layer], k)
        tables.append(table)
    hits = lookups = 0
    for row in trace.rows:
        for layer, ids in enumerate(row.experts):
            if not ids:
                continue
            missing, into, _ = tables[layer].admit(np.array(ids, dtype=np.int64))
            tables[layer].place(missing, into)
            if row.phase == "decode":
                hits += len(ids) - len(missing)
                lookups += len(ids)
    return hits / lookups


class _Foresight:
    """Wraps a policy: among the victims' candidates, those the next ``k`` calls use go last."""

    def __init__(self, inner, calls, k):
        self.inner, self.calls, self.k = inner, calls, k

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def evict(self, candidates, count):
        now = self.inner.clock  # this call's index: ``used`` counts it after the victims
        soon = np.zeros(len(candidates))  # 2^-j for the first of the next k calls that uses it
        for j in range(self.k, 0, -1):
            if now + j < len(self.calls):
                uses = np.array([e in self.calls[now + j] for e in candidates.tolist()])
                soon[uses] = 2.0**-j
        free = candidates[soon == 0]
        if len(free) >= count:
            return self.inner.evict(free, count)
        rest = candidates[soon > 0][np.argsort(soon[soon > 0], kind="stable")]
        return np.concatenate([free, rest[: count - len(free)]])


def best_split(trace: RoutingTrace, slots: int, policy: str, curves) -> list:
    """The split of ``slots`` x layers between the layers with the fewest decode misses, from
    ``curves[n][layer]`` (decode misses of the layer at ``n`` slots)."""
    sizes = sorted(n for n in curves if n <= 4 * slots)
    total = slots * trace.num_layers
    inf = np.iinfo(np.int64).max // 2
    best = np.full(total + 1, inf, dtype=np.int64)
    best[0] = 0
    choice = []
    for layer in range(trace.num_layers):
        nxt = np.full(total + 1, inf, dtype=np.int64)
        pick = np.zeros(total + 1, dtype=np.int64)
        for n in sizes:
            cand = np.full(total + 1, inf, dtype=np.int64)
            cand[n:] = best[: total + 1 - n] + curves[n][layer]
            better = cand < nxt
            nxt[better], pick[better] = cand[better], n
        best = nxt
        choice.append(pick)
    split, left = [], total
    for layer in reversed(range(trace.num_layers)):
        n = int(choice[layer][left])
        split.append(n)
        left -= n
    return split[::-1]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--traces", default=str(ROOT / "tests" / "data" / "routing"))
    ap.add_argument("--slots", default="8,16,32")
    ap.add_argument("--policy", default="decay_next")
    ap.add_argument("--halves", action="store_true", help="also each trace's two halves")
    args = ap.parse_args()
    slots = [int(s) for s in args.slots.split(",")]
    ks = (1, 2, 4, 8)
    head = ["trace", "slots", "LRU", args.policy, *(f"next {k}" for k in ks)]
    head += ["best split", "Belady", "halfway"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    traces = []
    for path in sorted(Path(args.traces).glob("*.jsonl")):
        trace = read_trace(path)
        traces.append((path.stem, trace))
        if args.halves:
            first, second = halves(trace)
            traces += [(f"{path.stem} first half", first)]
            traces += [(f"{path.stem} second half (cold)", second)]
    for name, trace in traces:
        widest = max(len(ids) for row in trace.rows for ids in row.experts)
        sizes = range(widest, min(4 * max(slots), trace.num_experts) + 1)
        curves = {n: replay(trace, n, args.policy).decode_misses for n in sizes}
        for n in slots:
            lru = replay(trace, n, "lru").hit_rate("decode")
            ours = replay(trace, n, args.policy).hit_rate("decode")
            assert abs(foresight(trace, n, args.policy, 0) - ours) < 1e-12
            ahead = [foresight(trace, n, args.policy, k) for k in ks]
            split = replay(trace, best_split(trace, n, args.policy, curves), args.policy)
            best = belady(trace, n).hit_rate("decode")
            cells = [name, n, lru, ours, *ahead, split.hit_rate("decode"), best]
            cells.append((lru + best) / 2)
            text = [f"{c:.3f}" if isinstance(c, float) else str(c) for c in cells]
            print("| " + " | ".join(text) + " |", flush=True)


if __name__ == "__main__":
    main()
