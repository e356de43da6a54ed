"""Where a step's time goes, from a ``--streaming-trace`` timeline: milliseconds per decode step.

    python bench/timeline_summary.py TRACE.json [--last N]

For the last ``N`` decode steps (all by default), the mean per step of: the step's wall time (its
``decode`` span: first MoE layer call to last), the MoE layer calls, the time between them (attention,
norms, mlx-lm's own work), and inside the layer calls the host syncs, the waits for reads, for staged
reads and for compute, the compute submissions, the installs and what is left (the layer's other
host work: maps, graph building). Reads: how many, their bytes, the summed read time over threads,
the time at least one read was in flight, and the GB/s over that time (what the disk gave while the
layer waited on it). Used by ``bench/gpu_pipeline.py`` (word ``tl`` of a variant).

``split``: the same step cut into the parts of one MoE layer call, in ms per token and per MoE layer
call (``layer_split``): waiting for the router's ids (``host sync``), the host work from the end of
that wait to the first submission of the layer's compute (less any read waits or installs inside
it; to the call's end where nothing is submitted), reads (``wait read``, ``wait staged``, ``wait
ahead``), installs, compute (``submit`` and ``wait compute``), the rest of the layer call, and the
time between layer calls (attention, norms, mlx-lm).
"""

import argparse
import json
import sys
from bisect import bisect_left, bisect_right
from collections import defaultdict

# names of the spans inside a layer call, on the calling thread (schedules/, bank/reads.py)
INSIDE = ("host sync", "wait read", "wait staged", "wait compute", "submit", "install")

# the per-layer split's parts (``layer_split``), from the spans on the layer's calling thread
SPLIT_PARTS = {
    "reads": ("wait read", "wait staged", "wait ahead"),
    "installs": ("install",),
    "compute": ("submit", "wait compute"),
}
SPLIT_KEYS = ("ids wait", "host to submit", "reads", "installs", "compute", "rest", "between layers")


def load_events(path):
    """The complete events of a finished or cut-short trace file."""
    text = open(path).read().rstrip().rstrip(",")
    if not text.endswith("]"):
        text += "]"
    return [e for e in json.loads(text) if e.get("ph") == "X"]


def span_union(spans):
    """Total length of the union of ``(start, end)`` spans (also ``harness.ReadSpans``)."""
    total, end = 0.0, None
    for a, b in sorted(spans):
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


def summarize(path, last=None):
    """Mean milliseconds (and read figures) per decode step; see the module docstring."""
    events = load_events(path)
    steps = [e for e in events if e["cat"] == "step" and e["name"] == "decode"]
    if last:
        steps = steps[-last:]
    if not steps:
        return {"steps": 0}
    sums = defaultdict(float)
    for step in steps:
        a, b = step["ts"], step["ts"] + step["dur"]
        tid = step["tid"]
        inside = [e for e in events if a <= e["ts"] and e["ts"] + e["dur"] <= b + 1]
        layers = [e for e in inside if e["cat"] == "layer" and e["tid"] == tid]
        sums["step"] += step["dur"]
        sums["layer calls"] += sum(e["dur"] for e in layers)
        for e in inside:
            if e["tid"] == tid and e["name"] in INSIDE:
                sums[e["name"]] += e["dur"]
        reads = [e for e in inside if e["cat"] == "read"]
        sums["reads"] += len(reads)
        sums["read bytes"] += sum(e["args"].get("bytes", 0) for e in reads)
        sums["read time summed"] += sum(e["dur"] for e in reads)
        sums["read in flight"] += span_union([(e["ts"], e["ts"] + e["dur"]) for e in reads])
    n = len(steps)
    split = layer_split(events, steps)
    ms = {k: v / n / 1e3 for k, v in sums.items() if k not in ("reads", "read bytes")}
    out = {"steps": n}
    out.update({f"{k} ms": round(v, 3) for k, v in ms.items()})
    out["between layer calls ms"] = round(ms["step"] - ms["layer calls"], 3)
    out["other in layer calls ms"] = round(
        ms["layer calls"] - sum(ms.get(k, 0.0) for k in INSIDE), 3
    )
    out["reads per step"] = sums["reads"] / n
    out["MB read per step"] = round(sums["read bytes"] / n / 1e6, 3)
    flight = sums["read in flight"] / 1e6
    out["GB/s while reads in flight"] = (
        round(sums["read bytes"] / 1e9 / flight, 3) if flight else None
    )
    out["split"] = split
    return out


def layer_split(events, steps):
    """Mean ms per token and per MoE layer call of each of ``SPLIT_KEYS`` over the decode
    ``steps`` (step events of ``events``); see the module docstring."""
    own = defaultdict(list)  # tid -> spans of INSIDE or SPLIT_PARTS names, by start
    names = set(INSIDE) | {n for parts in SPLIT_PARTS.values() for n in parts}
    for e in events:
        if e["name"] in names and e["cat"] != "read":
            own[e["tid"]].append(e)
    starts = {}
    for tid, spans in own.items():
        spans.sort(key=lambda e: e["ts"])
        starts[tid] = [e["ts"] for e in spans]
    layer_calls = defaultdict(list)
    for e in events:
        if e["cat"] == "layer":
            layer_calls[e["tid"]].append(e)
    for calls_of in layer_calls.values():
        calls_of.sort(key=lambda e: e["ts"])
    part_of = {n: k for k, parts in SPLIT_PARTS.items() for n in parts}
    sums = defaultdict(float)
    calls = 0
    for step in steps:
        a, b, tid = step["ts"], step["ts"] + step["dur"], step["tid"]
        layers = [e for e in layer_calls[tid] if a <= e["ts"] and e["ts"] + e["dur"] <= b + 1]
        calls += len(layers)
        in_layers = 0.0
        for lay in layers:
            la, lb = lay["ts"], lay["ts"] + lay["dur"]
            in_layers += lay["dur"]
            at = starts.get(tid, [])  # (a thread whose layers recorded no span of their own)
            lo, hi = bisect_left(at, la), bisect_right(at, lb + 1)
            inside = [e for e in own[tid][lo:hi] if e["ts"] + e["dur"] <= lb + 1]
            sync = [e for e in inside if e["name"] == "host sync"]
            sync_end = sync[0]["ts"] + sync[0]["dur"] if sync else la
            submits = [e["ts"] for e in inside if e["name"] == "submit" and e["ts"] >= sync_end]
            first_submit = min(submits) if submits else lb
            accounted = 0.0
            for e in inside:
                if e["name"] == "host sync":
                    sums["ids wait"] += e["dur"]
                    accounted += e["dur"]
                    continue
                key = part_of.get(e["name"])
                if key is None:
                    continue
                sums[key] += e["dur"]
                accounted += e["dur"]
                if sync_end <= e["ts"] and e["ts"] + e["dur"] <= first_submit:
                    sums["host to submit"] -= e["dur"]  # a wait or install before the submission
            gap = max(0.0, first_submit - sync_end)
            sums["host to submit"] += gap
            accounted += gap - sum(
                e["dur"]
                for e in inside
                if e["name"] in part_of and sync_end <= e["ts"] and e["ts"] + e["dur"] <= first_submit
            )
            sums["rest"] += lay["dur"] - accounted
        sums["between layers"] += step["dur"] - in_layers
    n = len(steps)
    per_layer = calls / n if n else 0
    out = {"layer calls per token": per_layer}
    out["ms per token"] = {k: round(sums[k] / n / 1e3, 4) for k in SPLIT_KEYS} if n else {}
    out["ms per layer"] = (
        {k: round(sums[k] / calls / 1e3, 4) for k in SPLIT_KEYS}
        if calls
        else {}
    )
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--last", type=int, default=None)
    args = ap.parse_args()
    json.dump(summarize(args.trace, args.last), sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
